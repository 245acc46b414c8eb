"""One attention call, described once: its score features and the shapes of its paged inputs.

``Features`` bundles the keywords every attention entry point takes (``paged_attention``,
``varlen_attention``, the Helion API, the references) and checks them in one place;
``check_paged_inputs`` checks the six positional tensors of a paged call and returns what their
shapes say. Both run on tensor metadata only: no check reads device memory.

The replay path of a call (a recorded launch found by its key, ``pagedattn.ops.common.launching``)
reads the same keywords straight from the call's arguments, in ``Features``' order, without
building the object: building the key and the rebound tensors from an object took 1.05-1.33 µs
against 0.67 µs inline (2-core CPU of the development machine, Python 3.11).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from pagedattn._checks import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    check_fp8_cache,
    check_head_size,
    check_optional_int,
    check_paged_metadata,
    check_per_head,
    check_runs_on,
    check_shape,
    check_tensor,
    refuse_autograd,
)
from pagedattn.ops.common.attention_math import ALIBI_LINEAR, ALIBI_NONE, ALIBI_SQRT

__all__ = ["Features", "PagedShapes", "check_cache_pair", "check_out", "check_paged_inputs", "lse_buffer"]


class Features(NamedTuple):
    """The score features of one call (docs/contract.md says what each means).

    The scalars come first (part of the key a recorded launch is found by), then the per-head and
    per-sequence tensors (rebound when a recorded launch replays).
    """

    scale: float | None = None
    causal: bool = True
    sliding_window: int | None = None
    softcap: float | None = None
    alibi_sqrt: bool = False
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    prefix_ranges: torch.Tensor | None = None

    def check(self, *, num_q_heads: int, num_seqs: int, device) -> None:
        """ValueError / TypeError naming the keyword that is out of its domain."""
        check_optional_int("sliding_window", self.sliding_window, minimum=1)
        if self.softcap is not None and not (isinstance(self.softcap, (int, float)) and self.softcap >= 0):
            raise ValueError(f"softcap must be a float >= 0 or None, got {self.softcap!r}")
        if self.scale is not None and not isinstance(self.scale, (int, float)):
            raise TypeError(f"scale must be a float, got {type(self.scale).__name__}")
        check_per_head("alibi_slopes", self.alibi_slopes, num_q_heads, device)
        if self.alibi_sqrt and self.alibi_slopes is None:
            raise ValueError("alibi_sqrt=True needs alibi_slopes")
        check_per_head("sinks", self.sinks, num_q_heads, device)
        if self.prefix_ranges is not None:
            check_tensor("prefix_ranges", self.prefix_ranges, ndim=3, dtypes=(torch.int32,), device=device)
            check_shape("prefix_ranges", self.prefix_ranges, (num_seqs, None, 2))

    def kernel_fields(self, head_size: int) -> dict:
        """The features as the launchers' ``AttentionArgs`` holds them: defaults filled in, the
        modes as numbers (0 for no window, no soft cap)."""
        if self.alibi_slopes is None:
            alibi_mode = ALIBI_NONE.value
        else:
            alibi_mode = (ALIBI_SQRT if self.alibi_sqrt else ALIBI_LINEAR).value
        return dict(scale=float(self.scale if self.scale is not None else 1.0 / math.sqrt(head_size)),
                    causal=bool(self.causal), sliding_window=int(self.sliding_window or 0),
                    softcap=float(self.softcap or 0.0), alibi_mode=alibi_mode, alibi_slopes=self.alibi_slopes,
                    sinks=self.sinks, prefix_ranges=self.prefix_ranges)

    def kwargs(self) -> dict:
        """The features as keywords of the public functions and the references."""
        return self._asdict()


class PagedShapes(NamedTuple):
    """What the paged inputs' shapes say about the call."""

    num_tokens: int
    num_q_heads: int
    head_size: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    num_seqs: int


def check_paged_inputs(fn: str, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, *,
                       fp8_cache: bool, interpreted: bool) -> PagedShapes:
    """The checks on the positional tensors of a paged call (``fn`` names it in errors): q
    ``[num_tokens, num_q_heads, head_size]`` float; the caches ``[num_blocks, block_size,
    num_kv_heads, head_size]`` of q's dtype (or fp8 e4m3 where ``fp8_cache``); the batch's int32
    metadata. ``interpreted``: the kernels were made for Triton's interpreter (CPU tensors run)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_runs_on("q", q, interpreted)
    device = q.device
    num_tokens, num_q_heads, head_size = q.shape
    check_cache_pair(k_cache, v_cache, q.dtype, device, fp8_cache=fp8_cache)
    refuse_autograd(fn, q=q, k_cache=k_cache, v_cache=v_cache)
    num_blocks, block_size, num_kv_heads, cache_head_size = k_cache.shape
    check_head_size("q", head_size)
    if cache_head_size != head_size:
        raise ValueError(f"k_cache head_size {cache_head_size} differs from q head_size {head_size}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"q has {num_q_heads} heads, which is not a multiple of k_cache's {num_kv_heads} KV heads")
    if block_size < 1:
        raise ValueError("k_cache block_size (dim 1) must be >= 1")
    num_seqs = check_paged_metadata(block_table, seq_lens, query_start_loc, device)
    return PagedShapes(num_tokens, num_q_heads, head_size, num_blocks, block_size, num_kv_heads, num_seqs)


def check_cache_pair(k_cache, v_cache, dtype: torch.dtype, device, *, fp8_cache: bool = True) -> None:
    """K and V caches ``[num_blocks, block_size, num_kv_heads, head_size]``, alike, of ``dtype``
    (or fp8 e4m3 where ``fp8_cache`` and the target has it) on ``device``."""
    cache_dtypes = (dtype, *FP8_DTYPES) if fp8_cache else (dtype,)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=cache_dtypes, device=device)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=cache_dtypes, device=device)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache dtype {v_cache.dtype} differs from k_cache dtype {k_cache.dtype}")
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    if fp8_cache:
        check_fp8_cache("k_cache", k_cache, device)


def check_out(out, dtype: torch.dtype, device, shape: tuple) -> None:
    """``out=``, when given: of ``dtype`` on ``device`` with ``shape``."""
    if out is not None:
        check_tensor("out", out, dtypes=(dtype,), device=device)
        check_shape("out", out, shape)


def lse_buffer(lse_out, return_lse: bool, num_tokens: int, num_heads: int, device) -> torch.Tensor | None:
    """The lse tensor to write: ``lse_out`` (checked), a new one when ``return_lse``, else None."""
    if lse_out is not None:
        check_tensor("lse_out", lse_out, dtypes=(torch.float32,), device=device, last_dim_contiguous=False)
        check_shape("lse_out", lse_out, (num_tokens, num_heads))
        return lse_out
    if return_lse:
        return torch.empty(num_tokens, num_heads, dtype=torch.float32, device=device)
    return None
