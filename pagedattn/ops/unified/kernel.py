"""The unified ("2D") paged-attention kernel: one program per (Q block, KV head).

A Q block packs BLOCK_Q consecutive query tokens of one sequence times all NUM_QUERIES_PER_KV
query heads that share a KV head, so ``tl.dot`` sees BLOCK_M >= 16 rows even for decode.
Each program walks the keys of its sequence in tiles of TILE_N tokens through the block
table, keeps the online softmax in fp32 (base 2), and skips tiles that the causal, window
and prefix-range rules leave empty.
"""

import triton
import triton.language as tl

from pagedattn.ops.common.attention_math import (
    LOG2E,
    causal_window_mask,
    finalize_softmax,
    online_softmax_step,
    score_mods,
)


@triton.jit
def find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global Q block ``q_block_idx``.

    Sequence s owns the Q blocks from ``query_start_loc[s] // BLOCK_Q + s`` on; this start is
    non-decreasing in s, so a binary search finds the last s whose start is <= q_block_idx.
    The ``+ s`` leaves room for one partial block per sequence.
    """
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def prefix_visible(prefix_ranges_ptr, seq, stride_pr_s, stride_pr_r, num_prefix_ranges, q_pos, k_pos):
    """[M, N]: the pair (p, k) lies inside one bidirectional prefix range of sequence ``seq``."""
    vis = (q_pos[:, None] < 0) & (k_pos[None, :] < 0)  # all False (keys are >= 0), [M, N]
    base = prefix_ranges_ptr + seq * stride_pr_s
    for r in range(num_prefix_ranges):
        start = tl.load(base + r * stride_pr_r)
        end = tl.load(base + r * stride_pr_r + 1)
        in_q = (q_pos >= start) & (q_pos < end)
        in_k = (k_pos >= start) & (k_pos < end)
        vis = vis | (in_q[:, None] & in_k[None, :])
    return vis


@triton.jit
def prefix_kv_bounds(prefix_ranges_ptr, seq, stride_pr_s, stride_pr_r, num_prefix_ranges,
                     p_first, p_last, kv_lo, kv_hi):
    """Widen [kv_lo, kv_hi) to every prefix range that holds a query position of the block."""
    base = prefix_ranges_ptr + seq * stride_pr_s
    for r in range(num_prefix_ranges):
        start = tl.load(base + r * stride_pr_r)
        end = tl.load(base + r * stride_pr_r + 1)
        hit = (start < end) & (start <= p_last) & (end > p_first)
        kv_lo = tl.where(hit, tl.minimum(kv_lo, start), kv_lo)
        kv_hi = tl.where(hit, tl.maximum(kv_hi, end), kv_hi)
    return kv_lo, kv_hi


@triton.heuristics(
    {
        "USE_SINKS": lambda args: args["sinks_ptr"] is not None,
        "USE_PREFIX": lambda args: args["prefix_ranges_ptr"] is not None,
        "RETURN_LSE": lambda args: args["lse_ptr"] is not None,
        "KV_FP8": lambda args: args["k_scale_ptr"] is not None,
    }
)
@triton.jit(do_not_specialize=["num_seqs", "num_prefix_ranges", "sliding_window", "softcap", "scale"])
def unified_attention_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_size]
    lse_ptr,  # [num_tokens, num_q_heads] fp32 or None
    q_ptr,  # [num_tokens, num_q_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,
    block_table_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    sinks_ptr,  # [num_q_heads] fp32 or None
    alibi_slopes_ptr,  # [num_q_heads] fp32 or None
    prefix_ranges_ptr,  # [num_seqs, R, 2] int32 or None
    k_scale_ptr,  # [1] fp32 for an fp8 cache, else None
    v_scale_ptr,
    stride_q_t, stride_q_h,
    stride_o_t, stride_o_h,
    stride_lse_t, stride_lse_h,
    stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h,
    stride_bt_s,
    stride_pr_s, stride_pr_r,
    scale,
    softcap,
    sliding_window,
    num_seqs,
    num_prefix_ranges,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    ALIBI_MODE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_PREFIX: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """out = softmax(mods(scale * q k^T) + mask) v, over the pages of one sequence."""
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block_idx - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # negative for cross attention with more queries than keys

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    offs_n = tl.arange(0, TILE_N)
    q_tok = q_block_local * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # [BLOCK_M], within the sequence
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_ok = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_tok < q_len)
    dim_ok = offs_d < HEAD_SIZE
    token = (q_start + q_tok).to(tl.int64)
    head64 = head.to(tl.int64)
    q_pos = context_len + q_tok

    q = tl.load(
        q_ptr + token[:, None] * stride_q_t + head64[:, None] * stride_q_h + offs_d[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_SIZE_PAD]

    # Keys any row of this block can see: [kv_lo, kv_hi).
    p_first = context_len + q_block_local * BLOCK_Q
    p_last = tl.minimum(p_first + BLOCK_Q, context_len + q_len) - 1
    kv_lo = seq_len * 0
    kv_hi = seq_len
    if IS_CAUSAL:
        kv_hi = tl.minimum(kv_hi, p_last + 1)
    if sliding_window > 0:
        kv_lo = tl.maximum(kv_lo, p_first - sliding_window + 1)
        if not IS_CAUSAL:
            kv_hi = tl.minimum(kv_hi, p_last + sliding_window)
    if USE_PREFIX:
        kv_lo, kv_hi = prefix_kv_bounds(
            prefix_ranges_ptr, seq, stride_pr_s, stride_pr_r, num_prefix_ranges,
            p_first, p_last, kv_lo, kv_hi,
        )
        kv_lo = tl.maximum(kv_lo, 0)
        kv_hi = tl.minimum(kv_hi, seq_len)

    if ALIBI_MODE != 0:
        slope = tl.load(alibi_slopes_ptr + head, mask=row_ok, other=0.0)
    else:
        slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_SINKS:
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32) * LOG2E
        l_i = tl.where(m_i > float("-inf"), 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PAD], dtype=tl.float32)
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)

    block_row = block_table_ptr + seq.to(tl.int64) * stride_bt_s
    tile_start = (kv_lo // TILE_N) * TILE_N
    for start in range(tile_start, kv_hi, TILE_N):
        k_pos = start + offs_n  # [TILE_N]
        k_ok = (k_pos >= kv_lo) & (k_pos < kv_hi)
        page = tl.load(block_row + k_pos // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
        in_page = (k_pos % PAGE_SIZE).to(tl.int64)
        k_off = page * stride_k_b + in_page * stride_k_s + kv_head * stride_k_h
        v_off = page * stride_v_b + in_page * stride_v_s + kv_head * stride_v_h
        k = tl.load(
            k_cache_ptr + k_off[None, :] + offs_d[:, None],
            mask=dim_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [HEAD_SIZE_PAD, TILE_N]
        v = tl.load(
            v_cache_ptr + v_off[:, None] + offs_d[None, :],
            mask=k_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_SIZE_PAD]
        if KV_FP8:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, TILE_N]
        s = score_mods(s, q_pos, k_pos, softcap, slope, USE_SOFTCAP, ALIBI_MODE)
        vis = causal_window_mask(q_pos, k_pos, sliding_window, IS_CAUSAL)
        if USE_PREFIX:
            vis = vis | prefix_visible(
                prefix_ranges_ptr, seq, stride_pr_s, stride_pr_r, num_prefix_ranges, q_pos, k_pos
            )
        vis = vis & k_ok[None, :] & row_ok[:, None]
        s = tl.where(vis, s * LOG2E, float("-inf"))

        p, alpha, m_i, l_i = online_softmax_step(m_i, l_i, s)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)

    out, lse = finalize_softmax(acc, m_i, l_i)
    tl.store(
        out_ptr + token[:, None] * stride_o_t + head64[:, None] * stride_o_h + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )
    if RETURN_LSE:
        tl.store(lse_ptr + token * stride_lse_t + head64 * stride_lse_h, lse, mask=row_ok)
