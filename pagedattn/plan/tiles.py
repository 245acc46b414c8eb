"""Tile choice for the Q-block kernels (unified, split-KV, persistent), fitted to the target."""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedattn.ops.common.device import interpreter_on
from pagedattn.ops.common.host_math import next_power_of_2
from pagedattn.ops.common.target import TargetProps, fit_tiles, target_props
from pagedattn.ops.common.tiles import Tiles
from pagedattn.plan.rule import SPLIT_KV_MAX_QUERY_LEN


def num_sms(device) -> int:
    """SMs (CUs) of ``device``'s target (:func:`pagedattn.ops.common.target.target_props`; the
    interpreter: 4, a few programs are plenty)."""
    return target_props(device).num_sms


def fitted(tiles: Tiles, target: TargetProps, head_size: int, dtype: torch.dtype,
           kv_dtype: torch.dtype | None = None) -> Tiles:
    """A choice of :func:`pick_tiles` or :func:`pick_prefill_tiles` (the H200's tables) fitted
    into ``target``'s shared memory and warp width (:func:`pagedattn.ops.common.target.fit_tiles`);
    the same tiles wherever they fit, the sm90 GPUs included."""
    q_bytes = dtype.itemsize
    kv_bytes = q_bytes if kv_dtype is None else kv_dtype.itemsize
    return fit_tiles(tiles, target, max(16, next_power_of_2(head_size)), q_bytes, kv_bytes)


def pick_tiles(max_query_len: int, num_queries_per_kv: int, head_size: int, *, fixed: bool = False) -> Tiles:
    """Tile shapes from the shapes alone (``fixed``: independent of the batch, for invariance).

    Decode gets the smallest M that ``tl.dot`` accepts (16), filled by the query heads of one
    KV head; longer queries get 64-row blocks so each K/V tile serves more rows. Decode tiles:
    64 keys, 4 warps, 3 stages (146 registers per thread with 32-bit offsets: 3 programs per SM;
    H200 sweeps in docs/perf-notes.md, "Decode tiles and splits").
    """
    head_size_pad = max(16, next_power_of_2(head_size))
    short = fixed or max_query_len <= 1
    block_m = max(16 if short else 64, next_power_of_2(num_queries_per_kv))
    if not short and max_query_len <= SPLIT_KV_MAX_QUERY_LEN:
        # speculative decode: rows for the longest query only (6 tokens x 4 heads fill 24 of 32
        # rows, not 24 of 64): H200, 16 x 6 at 8192, 216 -> 166 us
        block_m = max(16, min(block_m, next_power_of_2(max_query_len * num_queries_per_kv)))
    block_q = block_m // num_queries_per_kv
    tile_n = 32 if head_size_pad > 128 else 64
    num_warps = 4 if block_m * head_size_pad <= 64 * 128 else 8
    # decode: two tiles in flight (int32 offsets leave the registers); heads past 256 stay at 2 stages
    # (fp32 at head 512: 3 stages of 32-key tiles need ~290 KB of shared memory, over sm90's 227 KB).
    # Speculative decode's 32-row tiles keep 2: 3 need 78 KB of shared memory, two programs per SM, not three.
    num_stages = 3 if (short or block_m == 16) and head_size_pad <= 256 else 2
    if interpreter_on():
        num_warps = 1
    return Tiles(block_m, block_q, tile_n, num_warps, num_stages=num_stages)


def batch_tiles(max_query_len: int, num_q_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                target: TargetProps, *, fixed: bool = False) -> Tiles:
    """:func:`pick_tiles` for a batch's attention shape, fitted to ``target``."""
    return fitted(pick_tiles(max_query_len, num_q_heads // num_kv_heads, head_size, fixed=fixed), target,
                  head_size, dtype)


def persistent_tiles(tiles: Tiles, target: TargetProps, head_size: int) -> Tiles:
    """``tiles`` for the persistent kernel: no wider or deeper than the target's compiler keeps
    without spills (``persistent_tile_n``, ``persistent_stages``; 0: any), on the warps it needs
    past head 128 (``wide_persistent_warps``)."""
    if target.persistent_tile_n and tiles.tile_n > target.persistent_tile_n:
        tiles = replace(tiles, tile_n=target.persistent_tile_n)
    if target.persistent_stages and tiles.num_stages > target.persistent_stages:
        tiles = replace(tiles, num_stages=target.persistent_stages)
    if target.wide_persistent_warps and head_size > 128 and tiles.block_m < 64:
        tiles = replace(tiles, num_warps=target.wide_persistent_warps)
    return tiles
