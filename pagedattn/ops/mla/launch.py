"""Launchers of the MLA kernels: tile and split choice, grids, keyword arguments; nothing else.

Split rule (``choose_mla_splits``): the unsplit grid has ``num_q_blocks * num_head_groups``
programs. One MLA program holds a ``[BLOCK_M, LATENT_DIM]`` fp32 accumulator and two
576-wide tiles, so about one fits an SM at a time. The keys are cut into
``floor(sms / programs)`` splits (the largest count that still runs in one wave; no split when
that is below 2), at most ``ceil(max_seq_len / MLA_MIN_SEGMENT_TOKENS)`` (each split writes a
``[heads, LATENT_DIM]`` fp32 partial, which must stay small beside the latent it read) and at
most ``MLA_MAX_SPLITS``. The constants are first guesses, not yet swept on a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from pagedattn.ops.mla.kernel import mla_decode_kernel, mla_merge_splits_kernel, write_mla_kv_kernel

MLA_MAX_QUERY_LEN = 8
MLA_PROGRAMS_PER_SM = 1
MLA_MIN_SEGMENT_TOKENS = 128
MLA_MAX_SPLITS = 64


@dataclass(frozen=True)
class MLATiles:
    block_h: int  # heads of one query token per program
    block_q: int  # query tokens of one sequence per program
    tile_n: int  # keys per step of the inner loop
    num_warps: int
    num_stages: int = 2

    @property
    def block_m(self) -> int:
        return self.block_h * self.block_q


def _is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pick_mla_tiles(num_heads: int, max_query_len: int) -> MLATiles:
    """Up to 64 rows (heads first, then query tokens of the same sequence); at least 16 for tl.dot.

    128 heads of a decode token: 2 programs of 64 heads per (sequence, split), so each latent
    page is read twice, the second time from L2. The interpreter gets 16 rows.
    """
    max_m = 16 if _is_interpreter() else 64
    block_h = min(triton.next_power_of_2(max(num_heads, 1)), max_m)
    block_q = min(triton.next_power_of_2(max(max_query_len, 1)), max_m // block_h)
    block_q = max(block_q, 16 // block_h)
    if _is_interpreter():
        return MLATiles(block_h, block_q, tile_n=32, num_warps=1, num_stages=1)
    num_warps = 8 if block_h * block_q >= 64 else 4
    return MLATiles(block_h, block_q, tile_n=32, num_warps=num_warps, num_stages=2)


def mla_grid_q_blocks(num_tokens: int, num_seqs: int, tiles: MLATiles) -> int:
    """Q blocks in the grid: enough for any split of num_tokens among num_seqs (no host sync).

    One token a block needs no slack; otherwise each sequence may end in a partial block.
    """
    if tiles.block_q == 1:
        return num_tokens
    return num_tokens // tiles.block_q + num_seqs


def choose_mla_splits(num_seqs: int, num_heads: int, max_query_len: int, max_seq_len: int, tiles: MLATiles,
                      sms: int) -> int:
    """The module docstring's rule; 1 means no split (the kernel writes the output directly)."""
    q_blocks = num_seqs * -(-max(max_query_len, 1) // tiles.block_q)
    programs = max(1, q_blocks * -(-num_heads // tiles.block_h))
    by_fill = MLA_PROGRAMS_PER_SM * sms // programs
    if by_fill < 2 or max_seq_len <= MLA_MIN_SEGMENT_TOKENS:
        return 1
    by_length = -(-max_seq_len // MLA_MIN_SEGMENT_TOKENS)
    return max(1, min(by_fill, by_length, MLA_MAX_SPLITS))


def launch_mla_decode(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    kv_scale: torch.Tensor | None,
    tiles: MLATiles,
    num_splits: int,
    partial_out: torch.Tensor | None = None,
    partial_lse: torch.Tensor | None = None,
) -> None:
    """One split: the kernel writes out/lse. Several: partials, then the ordered merge.

    ``partial_out`` ``[num_tokens, num_heads, num_splits, latent_dim]`` fp32 and ``partial_lse``
    ``[num_tokens, num_heads, num_splits]`` fp32 are needed when ``num_splits > 1``.
    """
    num_tokens, num_heads, latent_dim = q_nope.shape
    rope_dim = q_pe.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    if num_splits > 1:
        dst, dst_lse = partial_out, partial_lse
        o_strides = partial_out.stride()[:3]
        l_strides = partial_lse.stride()
    else:
        dst, dst_lse = out, lse
        o_strides = (out.stride(0), out.stride(1), 0)
        l_strides = (lse.stride(0), lse.stride(1), 0) if lse is not None else (0, 0, 0)
    grid = (mla_grid_q_blocks(num_tokens, num_seqs, tiles) * num_splits * -(-num_heads // tiles.block_h),)
    mla_decode_kernel[grid](
        out_ptr=dst,
        lse_ptr=dst_lse,
        q_nope_ptr=q_nope,
        q_pe_ptr=q_pe,
        kv_cache_ptr=kv_cache,
        block_table_ptr=block_table,
        seq_lens_ptr=seq_lens,
        query_start_loc_ptr=query_start_loc,
        kv_scale_ptr=kv_scale,
        stride_qn_t=q_nope.stride(0), stride_qn_h=q_nope.stride(1),
        stride_qp_t=q_pe.stride(0), stride_qp_h=q_pe.stride(1),
        stride_o_t=o_strides[0], stride_o_h=o_strides[1], stride_o_s=o_strides[2],
        stride_lse_t=l_strides[0], stride_lse_h=l_strides[1], stride_lse_s=l_strides[2],
        stride_c_b=kv_cache.stride(0), stride_c_s=kv_cache.stride(1),
        stride_bt_s=block_table.stride(0),
        scale=scale,
        num_heads=num_heads,
        num_seqs=num_seqs,
        num_tokens=num_tokens,
        num_blocks=kv_cache.shape[0],
        max_blocks_per_seq=block_table.shape[1],
        num_splits=num_splits,
        LATENT_DIM=latent_dim,
        LATENT_PAD=max(16, triton.next_power_of_2(latent_dim)),
        ROPE_DIM=rope_dim,
        ROPE_PAD=max(16, triton.next_power_of_2(rope_dim)),
        PAGE_SIZE=kv_cache.shape[1],
        BLOCK_H=tiles.block_h,
        BLOCK_Q=tiles.block_q,
        BLOCK_M=tiles.block_m,
        TILE_N=tiles.tile_n,
        DOT_PRECISION="ieee" if q_nope.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if num_splits == 1:
        return
    mla_merge_splits_kernel[(num_tokens, num_heads)](
        out_ptr=out,
        lse_ptr=lse,
        partial_out_ptr=partial_out,
        partial_lse_ptr=partial_lse,
        stride_o_t=out.stride(0), stride_o_h=out.stride(1),
        stride_lse_t=lse.stride(0) if lse is not None else 0,
        stride_lse_h=lse.stride(1) if lse is not None else 0,
        stride_po_t=partial_out.stride(0), stride_po_h=partial_out.stride(1), stride_po_s=partial_out.stride(2),
        stride_pl_t=partial_lse.stride(0), stride_pl_h=partial_lse.stride(1), stride_pl_s=partial_lse.stride(2),
        num_splits=num_splits,
        LATENT_DIM=latent_dim,
        LATENT_PAD=triton.next_power_of_2(latent_dim),
        num_warps=1 if _is_interpreter() else (4 if latent_dim >= 256 else 2),
    )


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
    write_mla_kv_kernel[(num_tokens,)](
        c_kv_ptr=c_kv,
        k_pe_ptr=k_pe,
        kv_cache_ptr=kv_cache,
        slot_mapping_ptr=slot_mapping,
        kv_scale_ptr=kv_scale,
        stride_ckv_t=c_kv.stride(0),
        stride_kpe_t=k_pe.stride(0),
        stride_c_b=kv_cache.stride(0), stride_c_s=kv_cache.stride(1),
        num_slots=kv_cache.shape[0] * kv_cache.shape[1],
        LATENT_DIM=latent_dim,
        LATENT_PAD=triton.next_power_of_2(latent_dim),
        ROPE_DIM=rope_dim,
        ROPE_PAD=triton.next_power_of_2(rope_dim),
        PAGE_SIZE=kv_cache.shape[1],
        num_warps=1 if _is_interpreter() else 4,
    )
