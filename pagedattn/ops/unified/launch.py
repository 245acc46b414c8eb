"""Launcher of the unified kernel: builds the grid and keyword arguments, launches, nothing else."""

from __future__ import annotations

import torch

from pagedattn.ops.common.bundles import AttentionArgs, kernel_args, output_rows
from pagedattn.ops.common.launching import launch
from pagedattn.ops.common.tiles import Tiles
from pagedattn.ops.unified.kernel import unified_attention_kernel

__all__ = ["AttentionArgs", "common_kernel_args", "launch_unified", "q_block_grid_size"]


def common_kernel_args(a: AttentionArgs, tiles: Tiles) -> dict:
    """Keyword arguments shared by the Q-block kernels of every path (the bundles, sizes, CFG)."""
    return dict(kernel_args(a, tiles), max_q_len_served=a.max_q_len_served)


def q_block_grid_size(a: AttentionArgs, tiles: Tiles) -> int:
    """Programs along the Q-block axis: enough for any split of num_tokens among num_seqs."""
    return a.q.shape[0] // tiles.block_q + a.seq_lens.shape[0]


def launch_unified(out: torch.Tensor, lse: torch.Tensor | None, a: AttentionArgs, tiles: Tiles) -> None:
    if a.q.shape[0] == 0 or a.seq_lens.shape[0] == 0:
        return
    grid = (q_block_grid_size(a, tiles), a.k_cache.shape[2])
    launch(unified_attention_kernel, grid, dst=output_rows(out, lse), **common_kernel_args(a, tiles))
