"""Launcher of the split-KV path: the segment kernel, then the reduction of the partials."""

from __future__ import annotations

import torch

from pagedattn.ops.common.bundles import AttentionArgs, output_rows, partial_rows
from pagedattn.ops.common.host_math import next_power_of_2
from pagedattn.ops.common.launching import launch
from pagedattn.ops.common.pdl import pdl_option, use_pdl
from pagedattn.ops.common.tiles import Tiles
from pagedattn.ops.split_kv.kernel import reduce_splits_kernel, split_kv_attention_kernel
from pagedattn.ops.unified.launch import common_kernel_args, q_block_grid_size


def launch_split_kv(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    a: AttentionArgs,
    tiles: Tiles,
    *,
    num_splits: int,
    segment_size: int,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
) -> None:
    num_tokens, _, head_size = a.q.shape
    if num_tokens == 0 or a.seq_lens.shape[0] == 0:
        return
    grid = (q_block_grid_size(a, tiles), a.k_cache.shape[2], num_splits)
    pdl = use_pdl(a.q.device)
    launch(split_kv_attention_kernel, grid, part=partial_rows(partial_out, partial_lse), segment_size=segment_size,
           USE_PDL=pdl, **common_kernel_args(a, tiles))
    # an even cut stores every split's out (empty segments too), so the merge reads the outs
    # with the lses, one L2 round trip less after the segment grid
    launch_merge_splits(out, lse, partial_out, partial_lse, num_splits, pdl=pdl,
                        num_warps=1 if head_size <= 64 else 2, all_written=segment_size == 0)


def launch_merge_splits(out, lse, partial_out, partial_lse, num_splits: int, *, pdl: bool, num_warps: int,
                        all_written: bool = False) -> None:
    """Merge ``[num_tokens, num_heads, num_splits, head_size]`` fp32 partials (and their lse) into
    out / lse, one program per (token, head) row; ``pdl``: the kernel before it was launched with
    USE_PDL (split-KV, MLA decode); ``all_written``: every split stored its out, not only its lse
    (``reduce_splits_kernel``'s ALL_WRITTEN)."""
    num_tokens, num_heads, head_size = out.shape
    launch(reduce_splits_kernel, (num_tokens, num_heads), dst=output_rows(out, lse),
           part=partial_rows(partial_out, partial_lse), num_splits=num_splits, HEAD_SIZE=head_size,
           HEAD_SIZE_PAD=next_power_of_2(head_size), USE_PDL=pdl, ALL_WRITTEN=all_written, num_warps=num_warps,
           **pdl_option(pdl))
