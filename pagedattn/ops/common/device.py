"""Which Hopper-or-newer CUDA features a launcher may use (host side)."""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def _sm90_or_newer(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def cuda_sm90_or_newer(device: torch.device) -> bool:
    """An NVIDIA GPU of compute capability 9.0 or newer (TMA descriptors, dependent launch)."""
    if device.type != "cuda":
        return False
    return _sm90_or_newer(device.index if device.index is not None else torch.cuda.current_device())


def current_stream_handle(device: torch.device) -> int:
    """The raw handle of ``device``'s current CUDA stream (0 off CUDA): a key part, cheaply read."""
    if device.type != "cuda":
        return 0
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else torch.cuda.current_device())


def interpreter_on() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``), read at each call (the tests
    and the CPU fallbacks set it after import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
