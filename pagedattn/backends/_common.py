"""Helpers of the PyTorch-op backends (sdpa, flex): one sequence's K/V, visibility and biases.

These follow the contract's rules (docs/contract.md) directly; they are written apart from ``pagedattn.reference`` so
that comparing a backend with the reference is a comparison of two implementations. The
engine's SDPA attention (``pagedattn.engine.attention``) builds its extend masks with
``query_positions`` and ``visible`` too.
"""

from __future__ import annotations

import math

import torch


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


def query_positions(num_queries: int, seq_len: int, device) -> torch.Tensor:
    """``[num_queries]`` int64: the positions of a sequence's queries, its last ``num_queries``
    tokens (query j sits at ``seq_len - num_queries + j``)."""
    return torch.arange(num_queries, device=device) + (seq_len - num_queries)


def visible(q_pos: torch.Tensor, seq_len: int, *, causal: bool, sliding_window, prefix_rows) -> torch.Tensor:
    """``[len(q_pos), seq_len]`` bool: (causal and window rule) or (p and k in one prefix range)."""
    p = q_pos[:, None]
    k = torch.arange(seq_len, device=q_pos.device)[None, :]
    if causal:
        vis = k <= p
    else:
        vis = torch.ones(p.shape[0], seq_len, dtype=torch.bool, device=q_pos.device)
    if sliding_window:
        vis = vis & (k > p - sliding_window)
        if not causal:
            vis = vis & (k < p + sliding_window)
    if prefix_rows is not None:
        for start, end in prefix_rows:
            if start < end:
                vis = vis | ((p >= start) & (p < end) & (k >= start) & (k < end))
    return vis


def alibi_bias(q_pos: torch.Tensor, seq_len: int, slopes: torch.Tensor, sqrt: bool) -> torch.Tensor:
    """``[num_q_heads, len(q_pos), seq_len]`` float32: ``slope * (k - p)``, or ``-slope * sqrt(p - k)``."""
    rel = (torch.arange(seq_len, device=q_pos.device)[None, :] - q_pos[:, None]).float()
    slopes = slopes.float()[:, None, None]
    if sqrt:
        return -slopes * torch.sqrt(torch.clamp(-rel, min=0))[None]
    return slopes * rel[None]


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
