"""Whether a kernel may address a tensor with 32-bit element offsets (host side, shapes only)."""

from __future__ import annotations

import torch

INT32_OFFSET_LIMIT = 2**31


def needs_int64_offsets(*tensors: torch.Tensor) -> bool:
    """True if some element of some tensor lies ``INT32_OFFSET_LIMIT`` or more elements past its
    first one; the kernels then compute K/V offsets in int64 (their ``LARGE_CACHE`` flag)."""
    return any(sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1 >= INT32_OFFSET_LIMIT
               for t in tensors if t.numel() > 0)
