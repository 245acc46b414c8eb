"""Launcher of the unified kernel: builds the grid and keyword arguments, launches, nothing else."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedattn.ops.common.host_math import next_power_of_2
from pagedattn.ops.common.offsets import needs_int64_offsets
from pagedattn.ops.unified.kernel import unified_attention_kernel
from pagedattn.ops.common.tiles import Tiles
from pagedattn.ops.common.launching import launch


@dataclass
class AttentionArgs:
    """Validated inputs of one attention call, as the launchers of every path take them."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    causal: bool
    sliding_window: int  # 0: none
    softcap: float  # 0: none
    alibi_mode: int
    alibi_slopes: torch.Tensor | None
    sinks: torch.Tensor | None
    prefix_ranges: torch.Tensor | None
    k_scale: torch.Tensor | None  # [1] fp32 for an fp8 cache
    v_scale: torch.Tensor | None
    max_q_len_served: int = 2**31 - 1  # longer sequences go to the prefill kernel


def common_kernel_args(a: AttentionArgs, tiles: Tiles) -> dict:
    """Keyword arguments shared by the paged-attention kernels of every path."""
    q, k_cache, v_cache = a.q, a.k_cache, a.v_cache
    pr = a.prefix_ranges
    return dict(
        q_ptr=q,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        block_table_ptr=a.block_table,
        seq_lens_ptr=a.seq_lens,
        query_start_loc_ptr=a.query_start_loc,
        sinks_ptr=a.sinks,
        alibi_slopes_ptr=a.alibi_slopes,
        prefix_ranges_ptr=pr,
        k_scale_ptr=a.k_scale,
        v_scale_ptr=a.v_scale,
        stride_q_t=q.stride(0), stride_q_h=q.stride(1),
        stride_k_b=k_cache.stride(0), stride_k_s=k_cache.stride(1), stride_k_h=k_cache.stride(2),
        stride_v_b=v_cache.stride(0), stride_v_s=v_cache.stride(1), stride_v_h=v_cache.stride(2),
        stride_bt_s=a.block_table.stride(0),
        stride_pr_s=pr.stride(0) if pr is not None else 0,
        stride_pr_r=pr.stride(1) if pr is not None else 0,
        scale=a.scale,
        softcap=a.softcap,
        sliding_window=a.sliding_window,
        num_seqs=a.seq_lens.shape[0],
        num_tokens=q.shape[0],
        num_blocks=k_cache.shape[0],
        max_blocks_per_seq=a.block_table.shape[1],
        num_prefix_ranges=pr.shape[1] if pr is not None else 0,
        max_q_len_served=a.max_q_len_served,
        NUM_QUERIES_PER_KV=q.shape[1] // k_cache.shape[2],
        HEAD_SIZE=q.shape[2],
        HEAD_SIZE_PAD=max(16, next_power_of_2(q.shape[2])),
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_Q=tiles.block_q,
        BLOCK_M=tiles.block_m,
        TILE_N=tiles.tile_n,
        IS_CAUSAL=a.causal,
        USE_SOFTCAP=a.softcap > 0,
        ALIBI_MODE=a.alibi_mode,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        LARGE_CACHE=needs_int64_offsets(k_cache, v_cache),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def q_block_grid_size(a: AttentionArgs, tiles: Tiles) -> int:
    """Programs along the Q-block axis: enough for any split of num_tokens among num_seqs."""
    return a.q.shape[0] // tiles.block_q + a.seq_lens.shape[0]


def launch_unified(out: torch.Tensor, lse: torch.Tensor | None, a: AttentionArgs, tiles: Tiles) -> None:
    if a.q.shape[0] == 0 or a.seq_lens.shape[0] == 0:
        return
    grid = (q_block_grid_size(a, tiles), a.k_cache.shape[2])
    launch(unified_attention_kernel, grid,
        out_ptr=out,
        lse_ptr=lse,
        stride_o_t=out.stride(0), stride_o_h=out.stride(1),
        stride_lse_t=lse.stride(0) if lse is not None else 0,
        stride_lse_h=lse.stride(1) if lse is not None else 0,
        **common_kernel_args(a, tiles),
    )
