"""Split-KV ("3D", parallel tiled softmax) paged attention for decode and short queries.

Program (Q block, KV head, split) attends to one segment of the keys its Q block can see and
writes a partial (out, lse) pair; ``reduce_splits_kernel`` merges a row's partials:
``out = sum_i e^{lse_i - lse} out_i`` with ``lse = log sum_i e^{lse_i}``. The sink joins only
split 0, so the merge counts it once.

Segments: with ``segment_size == 0`` the visible range is cut into ``num_splits`` equal,
tile-aligned pieces; with ``segment_size > 0`` (batch-invariant mode) split i covers the
absolute key positions ``[i * segment_size, (i + 1) * segment_size)``, so a sequence is cut the
same way whatever else is in the batch.
"""

import triton
import triton.language as tl

from pagedattn.ops.common.attention_math import finalize_softmax
from pagedattn.ops.unified.program import (
    attend_kv_range,
    init_softmax_state,
    load_q_block,
    locate_q_block,
    q_block_rows,
    visible_kv_bounds,
)


@triton.heuristics(
    {
        "USE_SINKS": lambda args: args["sinks_ptr"] is not None,
        "USE_PREFIX": lambda args: args["prefix_ranges_ptr"] is not None,
        "KV_FP8": lambda args: args["k_scale_ptr"] is not None,
    }
)
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_blocks", "max_blocks_per_seq", "num_prefix_ranges", "sliding_window", "segment_size"])
def split_kv_attention_kernel(
    partial_out_ptr,  # [num_tokens, num_q_heads, num_splits, head_size] fp32
    partial_lse_ptr,  # [num_tokens, num_q_heads, num_splits] fp32
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
    stride_po_t, stride_po_h, stride_po_s,
    stride_pl_t, stride_pl_h,
    stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h,
    stride_bt_s,
    stride_pr_s, stride_pr_r,
    scale,
    softcap,
    sliding_window,
    num_seqs,
    num_tokens,
    num_blocks,
    max_blocks_per_seq,
    num_prefix_ranges,
    segment_size,
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
    KV_FP8: tl.constexpr,
):
    """Partial softmax(mods(scale * q k^T) + mask) v over one segment of a sequence's keys."""
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq, q_start, q_len, q_block_local, seq_len, valid = locate_q_block(
        query_start_loc_ptr, seq_lens_ptr, tl.program_id(0), num_seqs, BLOCK_Q
    )
    if not valid:
        return
    context_len = seq_len - q_len
    token, head, row_ok, q_pos = q_block_rows(
        q_start, q_len, q_block_local, context_len, kv_head, num_tokens, NUM_QUERIES_PER_KV, BLOCK_Q, BLOCK_M
    )
    kv_lo, kv_hi = visible_kv_bounds(
        prefix_ranges_ptr, seq, stride_pr_s, stride_pr_r, num_prefix_ranges,
        seq_len, q_len, context_len, q_block_local, sliding_window, BLOCK_Q, IS_CAUSAL, USE_PREFIX,
    )
    first_tile = (kv_lo // TILE_N) * TILE_N
    if segment_size > 0:
        seg_start = split * segment_size
        seg_end = seg_start + segment_size
        tile_lo = tl.maximum(seg_start, first_tile)
    else:
        tiles = tl.cdiv(tl.cdiv(kv_hi - first_tile, TILE_N), num_splits)
        seg_start = first_tile + split * tiles * TILE_N
        seg_end = seg_start + tiles * TILE_N
        tile_lo = seg_start
    seg_end = tl.minimum(seg_end, kv_hi)

    q = load_q_block(q_ptr, token, head, row_ok, stride_q_t, stride_q_h, HEAD_SIZE, HEAD_SIZE_PAD)
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ALIBI_MODE != 0:
        slope = tl.load(alibi_slopes_ptr + head, mask=row_ok, other=0.0)
    k_scale = 1.0
    v_scale = 1.0
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    m_i, l_i, acc = init_softmax_state(
        sinks_ptr, head, row_ok, split == 0, BLOCK_M, HEAD_SIZE_PAD, USE_SINKS
    )
    m_i, l_i, acc = attend_kv_range(
        q, m_i, l_i, acc, q_pos, row_ok, slope, k_scale, v_scale,
        k_cache_ptr, v_cache_ptr, block_table_ptr + seq.to(tl.int64) * stride_bt_s, prefix_ranges_ptr,
        seq, kv_head, tile_lo, kv_lo, seg_end, num_blocks, max_blocks_per_seq,
        stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
        stride_pr_s, stride_pr_r, num_prefix_ranges, scale, softcap, sliding_window,
        HEAD_SIZE, HEAD_SIZE_PAD, PAGE_SIZE, TILE_N, IS_CAUSAL, USE_SOFTCAP, ALIBI_MODE,
        DOT_PRECISION, USE_PREFIX, KV_FP8,
    )

    out, lse = finalize_softmax(acc, m_i, l_i)
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    row = token * stride_po_t + head * stride_po_h + split * stride_po_s
    tl.store(
        partial_out_ptr + row[:, None] + offs_d[None, :],
        out,
        mask=row_ok[:, None] & (offs_d < HEAD_SIZE)[None, :],
    )
    tl.store(partial_lse_ptr + token * stride_pl_t + head * stride_pl_h + split, lse, mask=row_ok)


@triton.heuristics({"RETURN_LSE": lambda args: args["lse_ptr"] is not None})
@triton.jit(do_not_specialize=["num_splits"])
def reduce_splits_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_size]
    lse_ptr,  # [num_tokens, num_q_heads] fp32 or None
    partial_out_ptr,  # [num_tokens, num_q_heads, num_splits, head_size] fp32
    partial_lse_ptr,  # [num_tokens, num_q_heads, num_splits] fp32
    stride_o_t, stride_o_h,
    stride_lse_t, stride_lse_h,
    stride_po_t, stride_po_h, stride_po_s,
    stride_pl_t, stride_pl_h,
    num_splits,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    """One (token, head) row: merge its partials in split order (deterministic)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    dim_ok = offs_d < HEAD_SIZE
    lse_row = partial_lse_ptr + token * stride_pl_t + head * stride_pl_h
    out_row = partial_out_ptr + token * stride_po_t + head * stride_po_h

    lse_max = tl.load(lse_row)
    for i in range(1, num_splits):
        lse_max = tl.maximum(lse_max, tl.load(lse_row + i))
    shift = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    acc = tl.zeros([HEAD_SIZE_PAD], dtype=tl.float32)
    total = tl.full([], 0.0, tl.float32)
    for i in range(num_splits):
        lse_i = tl.load(lse_row + i)
        w = tl.exp(lse_i - shift)
        has_keys = tl.broadcast_to(lse_i, [HEAD_SIZE_PAD]) > float("-inf")  # (interpreter: no scalar & vector)
        part = tl.load(out_row + i * stride_po_s + offs_d, mask=dim_ok & has_keys, other=0.0)
        acc += w * part
        total += w
    out = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + offs_d, out.to(out_ptr.dtype.element_ty), mask=dim_ok)
    if RETURN_LSE:
        lse = tl.where(total > 0.0, shift + tl.log(total), float("-inf"))
        tl.store(lse_ptr + token * stride_lse_t + head * stride_lse_h, lse)
