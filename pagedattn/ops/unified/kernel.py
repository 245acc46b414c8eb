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
        "RETURN_LSE": lambda args: args["lse_ptr"] is not None,
        "KV_FP8": lambda args: args["k_scale_ptr"] is not None,
    }
)
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_blocks", "max_blocks_per_seq", "num_prefix_ranges", "sliding_window"])
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
    num_tokens,
    num_blocks,
    max_blocks_per_seq,
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
    kv_head = tl.program_id(1)
    seq, q_start, q_len, q_block_local, seq_len, valid = locate_q_block(
        query_start_loc_ptr, seq_lens_ptr, tl.program_id(0), num_seqs, BLOCK_Q
    )
    if not valid:
        return
    context_len = seq_len - q_len  # negative for cross attention with more queries than keys
    token, head, row_ok, q_pos = q_block_rows(
        q_start, q_len, q_block_local, context_len, kv_head, num_tokens, NUM_QUERIES_PER_KV, BLOCK_Q, BLOCK_M
    )
    q = load_q_block(q_ptr, token, head, row_ok, stride_q_t, stride_q_h, HEAD_SIZE, HEAD_SIZE_PAD)
    kv_lo, kv_hi = visible_kv_bounds(
        prefix_ranges_ptr, seq, stride_pr_s, stride_pr_r, num_prefix_ranges,
        seq_len, q_len, context_len, q_block_local, sliding_window, BLOCK_Q, IS_CAUSAL, USE_PREFIX,
    )
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ALIBI_MODE != 0:
        slope = tl.load(alibi_slopes_ptr + head, mask=row_ok, other=0.0)
    k_scale = 1.0
    v_scale = 1.0
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    m_i, l_i, acc = init_softmax_state(sinks_ptr, head, row_ok, True, BLOCK_M, HEAD_SIZE_PAD, USE_SINKS)

    m_i, l_i, acc = attend_kv_range(
        q, m_i, l_i, acc, q_pos, row_ok, slope, k_scale, v_scale,
        k_cache_ptr, v_cache_ptr, block_table_ptr + seq.to(tl.int64) * stride_bt_s, prefix_ranges_ptr,
        seq, kv_head, (kv_lo // TILE_N) * TILE_N, kv_lo, kv_hi, num_blocks, max_blocks_per_seq,
        stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
        stride_pr_s, stride_pr_r, num_prefix_ranges, scale, softcap, sliding_window,
        HEAD_SIZE, HEAD_SIZE_PAD, PAGE_SIZE, TILE_N, IS_CAUSAL, USE_SOFTCAP, ALIBI_MODE,
        DOT_PRECISION, USE_PREFIX, KV_FP8,
    )

    out, lse = finalize_softmax(acc, m_i, l_i)
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    tl.store(
        out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (offs_d < HEAD_SIZE)[None, :],
    )
    if RETURN_LSE:
        tl.store(lse_ptr + token * stride_lse_t + head * stride_lse_h, lse, mask=row_ok)
