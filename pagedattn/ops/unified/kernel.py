"""The unified ("2D") paged-attention kernel: one program per (Q block, KV head).

A Q block packs BLOCK_Q consecutive query tokens of one sequence times all NUM_QUERIES_PER_KV
query heads that share a KV head, so ``tl.dot`` sees BLOCK_M >= 16 rows even for decode.
Each program walks the keys of its sequence in tiles of TILE_N tokens through the block
table, keeps the online softmax in fp32 (base 2), and skips tiles that the causal, window
and prefix-range rules leave empty. The grid's first axis has ``num_tokens // BLOCK_Q +
num_seqs`` entries, enough for every sequence's blocks without a host sync; extra programs exit.
"""

import triton
import triton.language as tl

from pagedattn.ops.common.program import attend_segment, locate_q_block, store_rows


@triton.heuristics(
    {
        "USE_SINKS": lambda args: args["sinks_ptr"] is not None,
        "USE_PREFIX": lambda args: args["prefix_ranges_ptr"] is not None,
        "KV_FP8": lambda args: args["k_scale_ptr"] is not None,
        "RETURN_LSE": lambda args: args["lse_ptr"] is not None,
    }
)
@triton.jit(do_not_specialize=[
    "num_seqs", "num_tokens", "num_blocks", "max_blocks_per_seq", "num_prefix_ranges", "sliding_window",
    "max_q_len_served",
])
def unified_attention_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_size]
    lse_ptr,  # [num_tokens, num_q_heads] fp32 or None
    stride_o_t, stride_o_h,
    stride_lse_t, stride_lse_h,
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
    RETURN_LSE: tl.constexpr,
):
    """out = softmax(mods(scale * q k^T) + mask) v, over the pages of one sequence."""
    seq, q_start, q_len, seq_len, q_block_local, valid = locate_q_block(
        query_start_loc_ptr, seq_lens_ptr, tl.program_id(0), num_seqs, max_q_len_served, BLOCK_Q
    )
    if not valid:
        return
    out, lse, token, head, row_ok = attend_segment(
        q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr,
        sinks_ptr, alibi_slopes_ptr, prefix_ranges_ptr, k_scale_ptr, v_scale_ptr,
        seq, q_start, q_len, seq_len, q_block_local, tl.program_id(1), 0, 1, 0,
        stride_q_t, stride_q_h, stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
        stride_bt_s, stride_pr_s, stride_pr_r,
        scale, softcap, sliding_window, num_tokens, num_blocks, max_blocks_per_seq, num_prefix_ranges,
        NUM_QUERIES_PER_KV, HEAD_SIZE, HEAD_SIZE_PAD, PAGE_SIZE, BLOCK_Q, BLOCK_M, TILE_N,
        IS_CAUSAL, USE_SOFTCAP, ALIBI_MODE, DOT_PRECISION, USE_SINKS, USE_PREFIX, KV_FP8, LARGE_CACHE,
        True,  # PAGE_WORK_HOISTED (experiment 24)
    )
    store_rows(out_ptr, lse_ptr, out, lse, token, head, row_ok, stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
               HEAD_SIZE, HEAD_SIZE_PAD, RETURN_LSE)
