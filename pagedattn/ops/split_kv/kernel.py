"""Split-KV ("3D", parallel tiled softmax) paged attention for decode and short queries.

Program (Q block, KV head, split) attends to one segment of the keys its Q block can see and
writes a partial (out, lse) pair; ``reduce_splits_kernel`` merges a row's partials:
``out = sum_i e^{lse_i - lse} out_i`` with ``lse = log sum_i e^{lse_i}``. The sink joins only
split 0, so the merge counts it once. How a segment is cut: ``attend_segment``.
"""

import triton
import triton.language as tl

from pagedattn.ops.merge.partials import merge_row
from pagedattn.ops.common.program import attend_segment, locate_q_block, store_partial


@triton.heuristics(
    {
        "USE_SINKS": lambda args: args["sinks_ptr"] is not None,
        "USE_PREFIX": lambda args: args["prefix_ranges_ptr"] is not None,
        "KV_FP8": lambda args: args["k_scale_ptr"] is not None,
    }
)
@triton.jit(do_not_specialize=[
    "num_seqs", "num_tokens", "num_blocks", "max_blocks_per_seq", "num_prefix_ranges", "sliding_window",
    "max_q_len_served", "segment_size",
])
def split_kv_attention_kernel(
    partial_out_ptr,  # [num_tokens, num_q_heads, num_splits, head_size] fp32
    partial_lse_ptr,  # [num_tokens, num_q_heads, num_splits] fp32
    stride_po_t, stride_po_h, stride_po_s,
    stride_pl_t, stride_pl_h,
    segment_size,
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
    max_q_len_served,
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
    LARGE_CACHE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Partial softmax(mods(scale * q k^T) + mask) v over one segment of a sequence's keys."""
    if USE_PDL:  # the merge kernel may launch now; it waits for this grid in the kernel
        tl.extra.cuda.gdc_launch_dependents()
    seq, q_start, q_len, seq_len, q_block_local, valid = locate_q_block(
        query_start_loc_ptr, seq_lens_ptr, tl.program_id(0), num_seqs, max_q_len_served, BLOCK_Q
    )
    if not valid:
        return
    split = tl.program_id(2)
    out, lse, token, head, row_ok = attend_segment(
        q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr,
        sinks_ptr, alibi_slopes_ptr, prefix_ranges_ptr, k_scale_ptr, v_scale_ptr,
        seq, q_start, q_len, seq_len, q_block_local, tl.program_id(1), split, tl.num_programs(2), segment_size,
        stride_q_t, stride_q_h, stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
        stride_bt_s, stride_pr_s, stride_pr_r,
        scale, softcap, sliding_window, num_tokens, num_blocks, max_blocks_per_seq, num_prefix_ranges,
        NUM_QUERIES_PER_KV, HEAD_SIZE, HEAD_SIZE_PAD, PAGE_SIZE, BLOCK_Q, BLOCK_M, TILE_N,
        IS_CAUSAL, USE_SOFTCAP, ALIBI_MODE, DOT_PRECISION, USE_SINKS, USE_PREFIX, KV_FP8, LARGE_CACHE,
        False,  # PAGE_WORK_HOISTED (experiment 24)
    )
    store_partial(partial_out_ptr, partial_lse_ptr, out, lse, token, head, row_ok, split,
                  stride_po_t, stride_po_h, stride_po_s, stride_pl_t, stride_pl_h, HEAD_SIZE, HEAD_SIZE_PAD)


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
    stride_pl_t, stride_pl_h, stride_pl_s,
    num_splits,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One (token, head) row: merge its partials in split order (deterministic). Also MLA's merge."""
    if USE_PDL:  # launched early (programmatic dependent launch): wait for the split kernel
        tl.extra.cuda.gdc_wait()
    merge_row(out_ptr, lse_ptr, partial_out_ptr, partial_lse_ptr,
              tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), num_splits,
              stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
              stride_po_t, stride_po_h, stride_po_s, stride_pl_t, stride_pl_h, stride_pl_s,
              HEAD_SIZE, HEAD_SIZE_PAD, RETURN_LSE)
