"""Programmatic dependent launch (CUDA, sm90+), for the merge kernel that follows a split-KV kernel.

The split kernel's programs signal at their start (``griddepcontrol.launch_dependents``), so the
merge kernel is launched while the split kernel's last programs still run; its programs wait in
the kernel (``griddepcontrol.wait``: the split kernel has finished and its writes are visible)
instead of behind a drained grid and a launch. Off on the interpreter, other GPUs, CUDA runtimes
before 12.3, and with ``PAGEDATTN_PDL=0``.
"""

from __future__ import annotations

import functools
import os

import torch

from pagedattn.plan import interpreter_on


@functools.lru_cache(maxsize=None)
def _sm90_or_newer(index: int) -> bool:
    """sm90+ and a CUDA runtime of 12.3 or later (dependent launches kept inside captured graphs)."""
    if torch.version.hip is not None or torch.version.cuda is None:
        return False
    major, minor = (int(x) for x in torch.version.cuda.split(".")[:2])
    return (major, minor) >= (12, 3) and torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    if interpreter_on() or device.type != "cuda" or os.environ.get("PAGEDATTN_PDL", "1") == "0":
        return False
    return _sm90_or_newer(device.index if device.index is not None else torch.cuda.current_device())
