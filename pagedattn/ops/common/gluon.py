"""What the Gluon launchers share (host side; importing it does not import Gluon): the Triton
release the kernels are written for, the GPUs they run on, the layouts their copies need."""

from __future__ import annotations

import functools
import importlib

import torch
import triton

GLUON_TRITON = "3.6"  # Gluon's API changes between releases; the kernels are written against this one
GLUON_DTYPES = (torch.bfloat16, torch.float16)  # the 16-bit inputs wgmma takes from shared memory
NO_GLUON = "triton.experimental.gluon is not available in this Triton"
# what a PAGEDATTN_*_GLUON variable's ``0`` maps to: the portable kernel, whatever the automatic rule says
GLUON_OFF = "off"


@functools.lru_cache(maxsize=None)
def load_kernel(module: str, name: str):
    """The ``@gluon.jit`` kernel ``name`` of ``module``, imported at first use (importing it
    imports Gluon), or None where this Triton has no usable Gluon."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None


def unavailable_reason(kernel) -> str | None:
    """None when ``kernel`` (from ``load_kernel``) can be compiled by the installed Triton, else why not."""
    if kernel is None:
        return NO_GLUON
    return triton_reason()


def required(kernel):
    """``kernel`` for a launch: RuntimeError where Gluon is missing (callers ask
    ``unavailable_reason`` first)."""
    if kernel is None:
        raise RuntimeError(NO_GLUON)
    return kernel


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
