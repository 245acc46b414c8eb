"""Launchers of the MLA kernels: grids, keyword arguments; nothing else. The config type is
in ``config.py``; the planner chooses the config and the split count
(:mod:`pagedattn.plan.mla`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedattn.ops.common.bundles import dot_precision
from pagedattn.ops.common.host_math import next_power_of_2
from pagedattn.ops.common.offsets import needs_int64_offsets
from pagedattn.ops.common.pdl import use_pdl
from pagedattn.ops.mla.config import MLAConfig
from pagedattn.ops.mla.kernel import mla_decode_kernel, write_mla_kv_kernel
from pagedattn.ops.split_kv.launch import launch_merge_splits
from pagedattn.ops.common.device import interpreter_on
from pagedattn.ops.common.launching import launch

MLA_MAX_QUERY_LEN = 8  # the longest query mla_decode serves (decode and speculative steps)


class MLAInputs(NamedTuple):
    """The tensors of one ``mla_decode`` call, as both MLA launchers take them (shapes in
    ``pagedattn.mla.mla_decode``)."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


class MLAStrides(NamedTuple):
    """The strides of the MLA decode kernel's tensors, in its parameter order."""

    stride_qn_t: int
    stride_qn_h: int
    stride_qp_t: int
    stride_qp_h: int
    stride_o_t: int
    stride_o_h: int
    stride_o_s: int  # 0 when the kernel writes the final output (one split)
    stride_lse_t: int
    stride_lse_h: int
    stride_lse_s: int
    stride_c_b: int
    stride_c_s: int
    stride_bt_s: int


class MLAWriteStrides(NamedTuple):
    """The strides of the latent-cache write: the new rows by token, the cache by block and slot."""

    stride_ckv_t: int
    stride_kpe_t: int
    stride_c_b: int
    stride_c_s: int


class MLAWriteConstants(NamedTuple):
    """The compile-time shape of a latent-cache write (the kernel's constexpr CFG)."""

    LATENT_DIM: int
    LATENT_PAD: int
    ROPE_DIM: int
    ROPE_PAD: int
    PAGE_SIZE: int


class MLAConstants(NamedTuple):
    """The compile-time shape of an MLA decode launch (the kernel's constexpr CFG)."""

    LATENT_DIM: int
    LATENT_PAD: int
    ROPE_DIM: int
    ROPE_PAD: int
    PAGE_SIZE: int
    BLOCK_H: int
    BLOCK_Q: int
    BLOCK_M: int
    TILE_N: int
    VALUE_SPLIT: int
    LARGE_CACHE: bool
    DOT_PRECISION: str | None
    USE_PDL: bool


def mla_grid_q_blocks(num_tokens: int, num_seqs: int, config: MLAConfig) -> int:
    """Q blocks in the grid: enough for any split of num_tokens among num_seqs (no host sync).

    One token a block needs no slack; otherwise each sequence may end in a partial block.
    """
    if config.block_q == 1:
        return num_tokens
    return num_tokens // config.block_q + num_seqs


def mla_strides(q_nope, q_pe, kv_cache, block_table, o_strides, l_strides) -> MLAStrides:
    """The decode kernels' strides (``o_strides`` / ``l_strides`` from ``split_destination``)."""
    return MLAStrides(q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), *o_strides, *l_strides,
                      kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0))


def split_destination(out, lse, partial_out, partial_lse, num_splits: int):
    """Where a decode kernel writes: ``(out, lse, out strides, lse strides)``, the strides by
    token, head and split. One split writes the final out / lse (split stride 0); several write
    the fp32 partials ``[num_tokens, num_heads, num_splits, latent]`` / ``[.., num_splits]`` that
    ``launch_merge_splits`` merges."""
    if num_splits > 1:
        return partial_out, partial_lse, partial_out.stride()[:3], partial_lse.stride()
    l_strides = (lse.stride(0), lse.stride(1), 0) if lse is not None else (0, 0, 0)
    return out, lse, (out.stride(0), out.stride(1), 0), l_strides


def launch_mla_decode(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    x: MLAInputs,
    *,
    scale: float,
    kv_scale: torch.Tensor | None,
    config: MLAConfig,
    num_splits: int,
    partial_out: torch.Tensor | None = None,
    partial_lse: torch.Tensor | None = None,
) -> None:
    """One split: the kernel writes out/lse. Several: partials, then the ordered merge.

    ``partial_out`` ``[num_tokens, num_heads, num_splits, latent_dim]`` fp32 and ``partial_lse``
    ``[num_tokens, num_heads, num_splits]`` fp32 are needed when ``num_splits > 1``.
    """
    q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc = x
    num_tokens, num_heads, latent_dim = q_nope.shape
    rope_dim = q_pe.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    latent_pad = max(16, next_power_of_2(latent_dim))
    if config.value_split not in (1, 2, 4) or latent_pad // config.value_split < 16:
        raise ValueError(f"MLAConfig.value_split {config.value_split} does not divide latent dim {latent_dim} "
                         "into parts of >= 16 columns")
    dst, dst_lse, o_strides, l_strides = split_destination(out, lse, partial_out, partial_lse, num_splits)
    head_groups = -(-num_heads // config.block_h)
    grid = (mla_grid_q_blocks(num_tokens, num_seqs, config) * num_splits * head_groups * config.value_split,)
    pdl = num_splits > 1 and use_pdl(q_nope.device)
    cfg = MLAConstants(LATENT_DIM=latent_dim, LATENT_PAD=latent_pad, ROPE_DIM=rope_dim,
                       ROPE_PAD=max(16, next_power_of_2(rope_dim)), PAGE_SIZE=kv_cache.shape[1],
                       BLOCK_H=config.block_h, BLOCK_Q=config.block_q, BLOCK_M=config.block_m, TILE_N=config.tile_n,
                       VALUE_SPLIT=config.value_split, LARGE_CACHE=needs_int64_offsets(kv_cache),
                       DOT_PRECISION=dot_precision(q_nope.dtype), USE_PDL=pdl)
    launch(mla_decode_kernel, grid,
           out_ptr=dst, lse_ptr=dst_lse, q_nope_ptr=q_nope, q_pe_ptr=q_pe, kv_cache_ptr=kv_cache,
           block_table_ptr=block_table, seq_lens_ptr=seq_lens, query_start_loc_ptr=query_start_loc,
           kv_scale_ptr=kv_scale,
           st=mla_strides(q_nope, q_pe, kv_cache, block_table, o_strides, l_strides),
           scale=scale, num_heads=num_heads, num_seqs=num_seqs, num_tokens=num_tokens, num_blocks=kv_cache.shape[0],
           max_blocks_per_seq=block_table.shape[1], num_splits=num_splits, CFG=cfg,
           num_warps=config.num_warps, num_stages=config.num_stages)
    if num_splits == 1:
        return
    launch_merge_splits(out, lse, partial_out, partial_lse, num_splits, pdl=pdl,
                        num_warps=1 if interpreter_on() else (4 if latent_dim >= 256 else 2))


def launch_write_mla_kv(
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None,
) -> None:
    num_tokens, latent_dim = c_kv.shape
    rope_dim = k_pe.shape[1]
    if num_tokens == 0:
        return
    st = MLAWriteStrides(c_kv.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1))
    cfg = MLAWriteConstants(LATENT_DIM=latent_dim, LATENT_PAD=next_power_of_2(latent_dim), ROPE_DIM=rope_dim,
                            ROPE_PAD=next_power_of_2(rope_dim), PAGE_SIZE=kv_cache.shape[1])
    launch(write_mla_kv_kernel, (num_tokens,), c_kv_ptr=c_kv, k_pe_ptr=k_pe, kv_cache_ptr=kv_cache,
           slot_mapping_ptr=slot_mapping, kv_scale_ptr=kv_scale, st=st,
           num_slots=kv_cache.shape[0] * kv_cache.shape[1], CFG=cfg, num_warps=1 if interpreter_on() else 4)
