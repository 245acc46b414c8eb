"""Programmatic dependent launch (CUDA, sm90+), for the merge kernel that follows a split-KV kernel.

The split kernel's programs signal at their start (``griddepcontrol.launch_dependents``), so the
merge kernel is launched while the split kernel's last programs still run; its programs wait in
the kernel (``griddepcontrol.wait``: the split kernel has finished and its writes are visible)
instead of behind a drained grid and a launch. Off on the interpreter, other GPUs, CUDA runtimes
before 12.3, and with ``PAGEDATTN_PDL=0``.
"""

from __future__ import annotations

import os

import torch

from pagedattn.ops.common.device import cuda_sm90_or_newer, interpreter_on
from pagedattn.ops.common.target import target_override


# a CUDA runtime of 12.3 or later keeps dependent launches inside captured graphs
_RUNTIME_OK = torch.version.cuda is not None and tuple(int(x) for x in torch.version.cuda.split(".")[:2]) >= (12, 3)


def use_pdl(device: torch.device) -> bool:
    # planning for a target that is not here (the compile matrix) assumes a runtime that has it
    if not (_RUNTIME_OK or target_override() is not None) or interpreter_on() or os.environ.get("PAGEDATTN_PDL", "1") == "0":
        return False
    return cuda_sm90_or_newer(device)


def pdl_option(pdl: bool) -> dict:
    """The launch option of a dependent launch: ``launch_pdl=True`` when ``pdl``, else nothing
    (the AMD backend refuses the option by name, even False)."""
    return {"launch_pdl": True} if pdl else {}
