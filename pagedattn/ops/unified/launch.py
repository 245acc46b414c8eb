"""Launcher of the unified kernel: picks tiles and grid from the shapes, launches, nothing else."""

from __future__ import annotations

import torch
import triton

from pagedattn.ops.unified.kernel import unified_attention_kernel


def _is_interpreter() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pick_tiles(max_query_len: int, num_queries_per_kv: int, head_size_pad: int, page_size: int):
    """(BLOCK_M, BLOCK_Q, TILE_N, num_warps).

    Decode-only batches get the smallest M that ``tl.dot`` accepts (16), filled by the query
    heads of one KV head; longer queries get 64-row blocks so K/V tiles are reused more.
    """
    min_m = 16 if max_query_len <= 1 else 64
    block_m = max(min_m, triton.next_power_of_2(num_queries_per_kv))
    block_q = block_m // num_queries_per_kv
    tile_n = 32 if head_size_pad > 128 or max_query_len <= 1 else 64
    num_warps = 4 if block_m * head_size_pad <= 16 * 256 else 8
    if _is_interpreter():
        num_warps = 1
    return block_m, block_q, tile_n, num_warps


def launch_unified(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    max_query_len: int,
    scale: float,
    causal: bool,
    sliding_window: int,
    softcap: float,
    alibi_mode: int,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    prefix_ranges: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    num_tokens, num_q_heads, head_size = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    num_queries_per_kv = num_q_heads // num_kv_heads
    head_size_pad = max(16, triton.next_power_of_2(head_size))
    block_m, block_q, tile_n, num_warps = pick_tiles(
        max_query_len, num_queries_per_kv, head_size_pad, k_cache.shape[1]
    )
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    pr_strides = (prefix_ranges.stride(0), prefix_ranges.stride(1)) if prefix_ranges is not None else (0, 0)
    unified_attention_kernel[grid](
        out_ptr=out,
        lse_ptr=lse,
        q_ptr=q,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        block_table_ptr=block_table,
        seq_lens_ptr=seq_lens,
        query_start_loc_ptr=query_start_loc,
        sinks_ptr=sinks,
        alibi_slopes_ptr=alibi_slopes,
        prefix_ranges_ptr=prefix_ranges,
        k_scale_ptr=k_scale,
        v_scale_ptr=v_scale,
        stride_q_t=q.stride(0), stride_q_h=q.stride(1),
        stride_o_t=out.stride(0), stride_o_h=out.stride(1),
        stride_lse_t=lse_strides[0], stride_lse_h=lse_strides[1],
        stride_k_b=k_cache.stride(0), stride_k_s=k_cache.stride(1), stride_k_h=k_cache.stride(2),
        stride_v_b=v_cache.stride(0), stride_v_s=v_cache.stride(1), stride_v_h=v_cache.stride(2),
        stride_bt_s=block_table.stride(0),
        stride_pr_s=pr_strides[0], stride_pr_r=pr_strides[1],
        scale=scale,
        softcap=softcap,
        sliding_window=sliding_window,
        num_seqs=num_seqs,
        num_prefix_ranges=0 if prefix_ranges is None else prefix_ranges.shape[1],
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PAD=head_size_pad,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        IS_CAUSAL=causal,
        USE_SOFTCAP=softcap > 0,
        ALIBI_MODE=alibi_mode,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=2,
    )
