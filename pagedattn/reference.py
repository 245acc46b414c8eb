"""Plain-PyTorch semantics of every pagedattn feature, computed in float64 by default.

This module is the contract written as code: the tests compare every kernel against it,
and it also serves as the slow "torch" backend on any device. Nothing here modifies its
inputs. The log-sum-exp (lse) is a natural logarithm everywhere in pagedattn.

NaN and inf: a row whose query, or a key or value it sees, holds a NaN or inf gets output NaN
and lse NaN; entries a row cannot see never reach it (they are zeroed before the products, so
0 * NaN cannot leak through a masked weight); lse -inf (output 0) means no visible key.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "attention_ref",
    "paged_attention_ref",
    "varlen_attention_ref",
    "write_kv_ref",
    "gather_kv_ref",
]


def _as_scale(x) -> float:
    if x is None:
        return 1.0
    if isinstance(x, torch.Tensor):
        return float(x.reshape(-1)[0].item())
    return float(x)


def visible_mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    causal: bool,
    sliding_window: int | None,
    prefix_ranges: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which (query, key) pairs may attend: ``[len(q_pos), len(k_pos)]`` bool.

    visible = (causal rule and window rule) or (p and k in the same prefix range).
    """
    p = q_pos[:, None]
    k = k_pos[None, :]
    vis = torch.ones(p.shape[0], k.shape[1], dtype=torch.bool, device=q_pos.device)
    if causal:
        vis &= k <= p
    if sliding_window is not None and sliding_window > 0:
        vis &= k > p - sliding_window
        if not causal:
            vis &= k < p + sliding_window
    if prefix_ranges is not None:
        for start, end in prefix_ranges.tolist():
            if start >= end:
                continue
            vis |= (p >= start) & (p < end) & (k >= start) & (k < end)
    return vis


def _finite_or_zero(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x with its NaN / inf entries zeroed, [...] bool: the last dim is all finite)."""
    finite = torch.isfinite(x)
    return torch.where(finite, x, 0.0), finite.all(-1)


def _poisoned_rows(q_ok: torch.Tensor, kv_ok: torch.Tensor, vis: torch.Tensor) -> torch.Tensor:
    """[heads, q_len] rows that read a non-finite input: q_ok [q_len, heads], kv_ok [kv_len, heads],
    vis [q_len, kv_len]."""
    reads_bad = ~q_ok.transpose(0, 1)[:, :, None] | ~kv_ok.transpose(0, 1)[:, None, :]
    return (reads_bad & vis[None]).any(-1)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_pos: torch.Tensor,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    alibi_sqrt: bool = False,
    sinks: torch.Tensor | None = None,
    prefix_ranges: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence.

    Parameters
    ----------
    q : ``[q_len, num_q_heads, head_size]``
    k : ``[kv_len, num_kv_heads, head_size]``
    v : ``[kv_len, num_kv_heads, head_size_v]``
    q_pos : ``[q_len]`` absolute position of each query (keys sit at 0..kv_len-1).

    Returns
    -------
    out : ``[q_len, num_q_heads, head_size_v]`` in ``compute_dtype``
    lse : ``[q_len, num_q_heads]`` natural-log sum of exponentials (sink included); NaN (and
        out NaN) for a row that reads a NaN or inf in its query or a key or value it sees.
    """
    q_len, num_q_heads, _ = q.shape
    kv_len, num_kv_heads, head_size_v = v.shape
    group = num_q_heads // num_kv_heads
    qf, q_ok = _finite_or_zero(q.to(compute_dtype))
    kf, k_ok = _finite_or_zero(k.to(compute_dtype).repeat_interleave(group, dim=1))
    vf, v_ok = _finite_or_zero(v.to(compute_dtype).repeat_interleave(group, dim=1))
    k_pos = torch.arange(kv_len, device=q.device)
    q_pos = q_pos.to(device=q.device, dtype=torch.int64)

    s = torch.einsum("qhd,khd->hqk", qf, kf) * scale  # [heads, q_len, kv_len]
    if softcap is not None and softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        rel = (k_pos[None, :] - q_pos[:, None]).to(compute_dtype)  # k - p
        slopes = alibi_slopes.to(device=q.device, dtype=compute_dtype)[:, None, None]
        if alibi_sqrt:
            s = s - slopes * torch.sqrt(torch.clamp(-rel, min=0))[None]
        else:
            s = s + slopes * rel[None]
    vis = visible_mask(
        q_pos, k_pos, causal=causal, sliding_window=sliding_window, prefix_ranges=prefix_ranges
    )
    s = s.masked_fill(~vis[None], float("-inf"))

    if sinks is not None:
        sink = sinks.to(device=q.device, dtype=compute_dtype)[:, None, None].expand(-1, q_len, 1)
        full = torch.cat([s, sink], dim=-1)
    else:
        full = s
    lse = torch.logsumexp(full, dim=-1)  # [heads, q_len]
    finite = torch.isfinite(lse)
    weights = torch.where(
        finite[..., None], torch.exp(s - torch.where(finite, lse, 0.0)[..., None]), 0.0
    )
    out = torch.einsum("hqk,khd->qhd", weights, vf)
    if q_len == 0:
        out = out.reshape(0, num_q_heads, head_size_v)
    bad = _poisoned_rows(q_ok, k_ok & v_ok, vis)  # [heads, q_len]
    lse = lse.masked_fill(bad, float("nan"))
    out = out.masked_fill(bad.transpose(0, 1)[..., None], float("nan"))
    return out, lse.transpose(0, 1).contiguous()


def gather_kv_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    seq_len: int,
    *,
    k_scale=None,
    v_scale=None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The contiguous ``[seq_len, num_kv_heads, head_size]`` K and V of one sequence."""
    block_size = k_cache.shape[1]
    num_pages = -(-seq_len // block_size)
    pages = block_table_row[:num_pages].to(torch.int64)
    k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:seq_len]
    v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:seq_len]
    k = k.to(compute_dtype)
    v = v.to(compute_dtype)
    if k_cache.dtype == torch.float8_e4m3fn:
        k = k * _as_scale(k_scale)
    if v_cache.dtype == torch.float8_e4m3fn:
        v = v * _as_scale(v_scale)
    return k, v


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    alibi_sqrt: bool = False,
    sinks: torch.Tensor | None = None,
    prefix_ranges: torch.Tensor | None = None,
    k_scale=None,
    v_scale=None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`pagedattn.paged_attention` (same arguments, see docs/contract.md).

    Returns ``(out, lse)`` in ``compute_dtype``: out ``[num_tokens, num_q_heads, head_size]``,
    lse ``[num_tokens, num_q_heads]``.
    """
    lens = seq_lens.tolist()

    def kv_of(s):
        return gather_kv_ref(k_cache, v_cache, block_table[s], lens[s], k_scale=k_scale, v_scale=v_scale,
                             compute_dtype=compute_dtype)

    return _attend_sequences(q, v_cache.shape[-1], query_start_loc.tolist(), lens, kv_of, scale=scale,
                             prefix_ranges=prefix_ranges, compute_dtype=compute_dtype, causal=causal,
                             sliding_window=sliding_window, softcap=softcap, alibi_slopes=alibi_slopes,
                             alibi_sqrt=alibi_sqrt, sinks=sinks)


def _attend_sequences(q, head_size_v, qsl, kv_lens, kv_of, *, scale, prefix_ranges, compute_dtype, **features):
    """(out, lse) of every sequence s: its queries ``q[qsl[s]:qsl[s + 1]]``, the last tokens of its
    ``kv_lens[s]`` keys, over ``kv_of(s)`` = (K, V); rows of no query stay 0 / -inf."""
    num_tokens, num_q_heads, head_size = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(head_size)
    out = torch.zeros(num_tokens, num_q_heads, head_size_v, dtype=compute_dtype, device=q.device)
    lse = torch.full((num_tokens, num_q_heads), float("-inf"), dtype=compute_dtype, device=q.device)
    for s in range(len(kv_lens)):
        q0, q1 = qsl[s], qsl[s + 1]
        if q1 == q0:
            continue
        k, v = kv_of(s)
        q_pos = torch.arange(q1 - q0, device=q.device) + (kv_lens[s] - (q1 - q0))
        o, l = attention_ref(
            q[q0:q1], k, v, q_pos=q_pos, scale=scale,
            prefix_ranges=None if prefix_ranges is None else prefix_ranges[s],
            compute_dtype=compute_dtype, **features,
        )
        out[q0:q1] = o
        lse[q0:q1] = l
    return out, lse


def varlen_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
    **features,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference over contiguous K/V: sequence s owns ``k[cu_seqlens_k[s]:cu_seqlens_k[s+1]]``.

    The queries of a sequence are its last tokens (same position rule as the paged form).
    """
    ck = cu_seqlens_k.tolist()
    kv_lens = [ck[s + 1] - ck[s] for s in range(len(ck) - 1)]
    prefix_ranges = features.pop("prefix_ranges", None)
    return _attend_sequences(q, v.shape[-1], cu_seqlens_q.tolist(), kv_lens,
                             lambda s: (k[ck[s]:ck[s + 1]], v[ck[s]:ck[s + 1]]), scale=scale,
                             prefix_ranges=prefix_ranges, compute_dtype=compute_dtype, **features)


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale=None,
    v_scale=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`pagedattn.write_kv`: returns updated copies of the caches."""
    k_out = k_cache.clone()
    v_out = v_cache.clone()
    block_size = k_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, block_size)
        for src, dst, sc in ((key, k_out, k_scale), (value, v_out, v_scale)):
            x = src[i]
            if dst.dtype == torch.float8_e4m3fn:
                x = (x.to(torch.float32) / _as_scale(sc)).clamp(-448.0, 448.0)
            dst[b, o] = x.to(dst.dtype)
    return k_out, v_out


def mla_decode_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    kv_scale=None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`pagedattn.mla_decode` (MLA in the latent space, causal).

    Every head attends to the shared latent rows ``[c_kv | k_pe]`` of its sequence:
    ``s = scale * (q_nope . c_kv + q_pe . k_pe)``, values ``c_kv``. Heads are not expanded, so
    128 heads at 32K keys stay small. Returns ``(out, lse)`` in ``compute_dtype``: out
    ``[num_tokens, num_heads, latent_dim]``, lse ``[num_tokens, num_heads]`` (natural log; NaN
    with out NaN for a row that reads a NaN or inf, as in :func:`attention_ref`).
    """
    num_tokens, num_heads, latent_dim = q_nope.shape
    block_size, row_dim = kv_cache.shape[1], kv_cache.shape[2]
    out = torch.zeros(num_tokens, num_heads, latent_dim, dtype=compute_dtype, device=q_nope.device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=compute_dtype, device=q_nope.device)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s in range(len(lens)):
        q0, q1 = qsl[s], qsl[s + 1]
        if q1 == q0:
            continue
        seq_len = lens[s]
        pages = block_table[s, : -(-seq_len // block_size)].to(torch.int64)
        rows = kv_cache[pages].reshape(-1, row_dim)[:seq_len].to(compute_dtype)
        if kv_cache.dtype == torch.float8_e4m3fn:
            rows = rows * _as_scale(kv_scale)
        rows, rows_ok = _finite_or_zero(rows)
        c_kv, k_pe = rows[:, :latent_dim], rows[:, latent_dim:]
        qn, qn_ok = _finite_or_zero(q_nope[q0:q1].to(compute_dtype))
        qp, qp_ok = _finite_or_zero(q_pe[q0:q1].to(compute_dtype))
        scores = torch.einsum("qhd,kd->hqk", qn, c_kv)
        scores = (scores + torch.einsum("qhd,kd->hqk", qp, k_pe)) * scale
        k_pos = torch.arange(seq_len, device=q_nope.device)
        q_pos = torch.arange(q1 - q0, device=q_nope.device) + (seq_len - (q1 - q0))
        vis = visible_mask(q_pos, k_pos, causal=True, sliding_window=None)
        scores = scores.masked_fill(~vis[None], float("-inf"))
        l = torch.logsumexp(scores, dim=-1)  # [heads, q_len]
        finite = torch.isfinite(l)
        weights = torch.where(finite[..., None], torch.exp(scores - torch.where(finite, l, 0.0)[..., None]), 0.0)
        bad = _poisoned_rows(qn_ok & qp_ok, rows_ok[:, None].expand(-1, num_heads), vis)  # [heads, q_len]
        out[q0:q1] = torch.einsum("hqk,kd->qhd", weights, c_kv).masked_fill(bad.transpose(0, 1)[..., None], float("nan"))
        lse[q0:q1] = l.masked_fill(bad, float("nan")).transpose(0, 1)
    return out, lse


def write_mla_kv_ref(
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_scale=None,
) -> torch.Tensor:
    """Reference for :func:`pagedattn.write_mla_kv`: returns an updated copy of the cache.

    Slots outside ``[0, num_blocks * block_size)`` (-1 marks padding) are skipped.
    """
    cache = kv_cache.clone()
    num_blocks, block_size = kv_cache.shape[:2]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0 or slot >= num_blocks * block_size:
            continue
        b, o = divmod(slot, block_size)
        x = torch.cat([c_kv[i], k_pe[i]])
        if cache.dtype == torch.float8_e4m3fn:
            x = (x.to(torch.float32) / _as_scale(kv_scale)).clamp(-448.0, 448.0)
        cache[b, o] = x.to(cache.dtype)
    return cache


__all__ += ["mla_decode_ref", "write_mla_kv_ref"]
