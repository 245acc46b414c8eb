"""What the Gluon launchers share (host side; importing it does not import Gluon): the Triton
release the kernels are written for, the GPUs they run on, the layouts their copies need."""

from __future__ import annotations

import functools

import torch
import triton

GLUON_TRITON = "3.6"  # Gluon's API changes between releases; the kernels are written against this one


def triton_reason() -> str | None:
    """None when the installed Triton is the release the Gluon kernels are written for, else why not."""
    if ".".join(triton.__version__.split(".")[:2]) != GLUON_TRITON:
        return f"Triton {triton.__version__}: the Gluon kernels are written for Triton {GLUON_TRITON}"
    return None


@functools.lru_cache(maxsize=None)
def _sm9x(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] == 9


def on_sm9x(t: torch.Tensor) -> bool:
    """Whether ``t`` is on a CUDA GPU of compute capability 9.x (wgmma and setmaxnreg)."""
    if t.device.type != "cuda":
        return False
    return _sm9x(t.device.index if t.device.index is not None else torch.cuda.current_device())


def aligned(t: torch.Tensor, dims) -> bool:
    """16-byte aligned start, unit last stride, and the strides of ``dims`` multiples of 16
    elements (Triton then specializes them as such and each cp.async moves 16 bytes)."""
    return t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and all(t.stride(d) % 16 == 0 for d in dims)
