"""Host-side conversions the public functions share (``api`` and ``mla``): arguments into the
forms the launchers take, and interpreter results back into the caller's dtype."""

from __future__ import annotations

import torch


def scale_tensor(x, device: torch.device) -> torch.Tensor:
    """A 1-element fp32 device tensor for an fp8 scale; a float becomes a device fill (no sync)."""
    if x is None:
        x = 1.0
    if isinstance(x, torch.Tensor):
        return x.reshape(1)
    return torch.full((1,), float(x), dtype=torch.float32, device=device)


def rounded_into(res, out, like: torch.Tensor):
    """An fp32 result (out, or (out, lse)) of an interpreter call rounded to ``like``'s dtype, into ``out``."""
    res_out, lse = (res, None) if isinstance(res, torch.Tensor) else res
    if out is None:
        out = torch.empty(res_out.shape, dtype=like.dtype, device=like.device)
    out.copy_(res_out)
    return out if lse is None else (out, lse)
