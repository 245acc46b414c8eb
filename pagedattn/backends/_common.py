"""Helpers of the PyTorch-op backends (sdpa, flex): one sequence's K/V and visibility at a time.

These follow the contract's rules (docs/contract.md) directly, through the masks of
:mod:`pagedattn.adapters.sdpa`; they are written apart from ``pagedattn.reference`` so that
comparing a backend with the reference is a comparison of two implementations.
"""

from __future__ import annotations

import math

import torch

from pagedattn.adapters.sdpa import query_positions, visible


def scale_value(x) -> float:
    """An fp8 dequantization scale as a float (a tensor costs one host sync)."""
    if x is None:
        return 1.0
    if isinstance(x, torch.Tensor):
        return float(x.reshape(-1)[0].item())
    return float(x)


def sequence_kv(k_cache, v_cache, block_table_row, seq_len: int, dtype, k_scale=None, v_scale=None):
    """The contiguous ``[seq_len, num_kv_heads, head_size]`` K and V of one sequence, in ``dtype``."""
    block_size = k_cache.shape[1]
    pages = block_table_row[: -(-seq_len // block_size)].long()
    k = k_cache.index_select(0, pages).flatten(0, 1)[:seq_len]
    v = v_cache.index_select(0, pages).flatten(0, 1)[:seq_len]
    if k_cache.dtype == torch.float8_e4m3fn:
        k = (k.float() * scale_value(k_scale)).to(dtype)
        v = (v.float() * scale_value(v_scale)).to(dtype)
    return k.to(dtype), v.to(dtype)


def loop_sequences(q, k_cache, v_cache, metadata, *, causal, sliding_window, prefix_ranges, k_scale, v_scale):
    """``(q0, q1, seq_len, q_pos, k, v, vis)`` for each sequence with queries and keys: host ints,
    the query positions, the sequence's contiguous K/V in q's dtype (``sequence_kv``) and its
    ``[q1 - q0, seq_len]`` visibility (``visible``)."""
    qsl = metadata.query_start_loc_host
    prefix_host = prefix_ranges.tolist() if prefix_ranges is not None else None
    for s, seq_len in enumerate(metadata.seq_lens_host):
        q0, q1 = qsl[s], qsl[s + 1]
        if q1 <= q0 or seq_len == 0:
            continue
        q_pos = query_positions(q1 - q0, seq_len, q.device)
        k, v = sequence_kv(k_cache, v_cache, metadata.block_table[s], seq_len, q.dtype, k_scale, v_scale)
        vis = visible(q_pos, seq_len, causal=causal, sliding_window=sliding_window,
                      prefix_rows=None if prefix_host is None else prefix_host[s])
        yield q0, q1, seq_len, q_pos, k, v, vis


def default_scale(scale, head_size: int) -> float:
    return 1.0 / math.sqrt(head_size) if scale is None else float(scale)


def prepare_out(q: torch.Tensor, out, return_lse: bool):
    if out is None:
        out = torch.zeros_like(q)
    else:
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must have q's shape {list(q.shape)} and dtype {q.dtype}")
        out.zero_()
    lse = None
    if return_lse:
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse
