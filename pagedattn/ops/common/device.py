"""Which Hopper-or-newer CUDA features a launcher may use (host side)."""

from __future__ import annotations

import functools
import os

import torch

from pagedattn.ops.common.target import target_override


@functools.lru_cache(maxsize=None)
def _sm90_or_newer(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def cuda_sm90_or_newer(device: torch.device) -> bool:
    """An NVIDIA GPU of compute capability 9.0 or newer (TMA descriptors, dependent launch); the
    target of an active ``targeting`` block (pagedattn.ops.common.target) when there is one."""
    override = target_override()
    if override is not None:
        return override.sm90_or_newer
    if device.type != "cuda":
        return False
    return _sm90_or_newer(device.index if device.index is not None else torch.cuda.current_device())


def current_stream_handle(device: torch.device) -> int:
    """The raw handle of ``device``'s current CUDA stream (0 off CUDA): a key part, cheaply read."""
    if device.type != "cuda":
        return 0
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else torch.cuda.current_device())


def environ_is(name: str, value: str) -> bool:
    """``os.environ.get(name) == value``, read at each call from the mapping behind ``os.environ``
    (which every change through ``os.environ`` updates): ``os.environ.get`` encodes the name on
    every read, about 1 us of the ~20 us a planned per-layer call may take; this takes ~0.1."""
    if _ENVIRON_DATA is None:  # not CPython's os._Environ
        return os.environ.get(name) == value
    return _ENVIRON_DATA.get(_encode_key(name)) == _encode_value(value)


def environ_value(name: str, choices: dict):
    """``choices.get(os.environ.get(name))``, read as cheaply as :func:`environ_is`."""
    if _ENVIRON_DATA is None:
        return choices.get(os.environ.get(name))
    raw = _ENVIRON_DATA.get(_encode_key(name))
    return None if raw is None else choices.get(_decode_value(raw))


_ENVIRON_DATA = getattr(os.environ, "_data", None)
if not isinstance(_ENVIRON_DATA, dict):
    _ENVIRON_DATA = None
_encode_key = functools.lru_cache(maxsize=None)(getattr(os.environ, "encodekey", str))
_encode_value = functools.lru_cache(maxsize=None)(getattr(os.environ, "encodevalue", str))
_decode_value = functools.lru_cache(maxsize=64)(getattr(os.environ, "decodevalue", str))


def interpreter_on() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``), read at each call (the tests
    and the CPU fallbacks set it after import)."""
    return environ_is("TRITON_INTERPRET", "1")
