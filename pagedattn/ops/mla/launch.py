"""Launchers of the MLA kernels: config and split choice, grids, keyword arguments; nothing else.

Config (``MLAConfig``, default from ``pick_mla_config``): a program owns ``block_m = block_h *
block_q`` rows (heads of query tokens of one sequence) and ``latent / value_split`` output
columns, and streams ``tile_n`` keys a step through ``num_stages`` shared-memory buffers. The
budget on Hopper-class GPUs, from compiling the kernel for sm_90a (ptxas register and spill
counts, Triton's shared-memory figure; docs/perf-notes.md):

* the fp32 accumulator takes ``block_m * latent / value_split / (32 * num_warps)`` registers a
  thread; at 128 (64 rows x 512 columns on 8 warps, or x 256 on 4) the rest still fits in the
  255-register limit without spills inside the loop, except 64-key tiles on 4 warps;
* shared memory holds the queries (``block_m * 576 * 2`` bytes) and ``num_stages`` latent tiles
  (``tile_n * 576 * 2`` bytes each): 64 rows + 2 x 64 keys (or 4 x 32) = 216 KB of the 227 KB;
* ``tl.dot`` lays its warps along M when a second dot consumes its result, so ``block_m`` below
  ``16 * num_warps`` (below 64 per warp group on Hopper) computes the scores redundantly.

Split rule (``choose_mla_splits``): the unsplit grid has ``q_blocks * head_groups *
value_split`` programs, and about ``mla_programs_per_sm(config)`` of them fit an SM at once
(one for the large configs). The keys are cut into ``floor(fill * sms / programs)`` splits
(no split when that is below 2), at most ``ceil(max_seq_len / MLA_MIN_SEGMENT_TOKENS)`` (each
split writes a ``[heads, latent]`` fp32 partial per row block, 128 KB for 64 heads: segments
shorter than ~128 keys write more than they read) and at most ``MLA_MAX_SPLITS``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from pagedattn.ops.common.bundles import dot_precision
from pagedattn.ops.common.host_math import next_power_of_2
from pagedattn.ops.common.offsets import needs_int64_offsets
from pagedattn.ops.common.pdl import use_pdl
from pagedattn.ops.mla.kernel import mla_decode_kernel, write_mla_kv_kernel
from pagedattn.ops.split_kv.launch import launch_merge_splits
from pagedattn.ops.common.device import interpreter_on
from pagedattn.ops.common.launching import launch

MLA_MAX_QUERY_LEN = 8
MLA_FILL_PER_SM = 1  # resident programs per SM the split rule aims for (times mla_programs_per_sm)
MLA_MIN_SEGMENT_TOKENS = 128
MLA_MAX_SPLITS = 64
SMEM_BYTES = 227 * 1024  # per block on sm_90 (opt-in maximum); the budget the configs are sized for
ROW_WIDTH_BYTES = 576 * 2  # DeepSeek's latent + rope row at 16 bits: the sizing unit below


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


@dataclass(frozen=True)
class MLAConfig:
    """Tiling of one MLA decode launch (internal; tests and sweeps pass one to ``_mla_decode``).

    ``num_splits`` None means the split rule decides; an explicit ``num_splits`` argument of
    ``mla_decode`` overrides both.
    """

    block_h: int  # heads of one query token per program
    block_q: int = 1  # query tokens of one sequence per program
    tile_n: int = 32  # keys per step of the inner loop
    value_split: int = 1  # programs sharing one row block, each with latent / value_split output columns
    num_warps: int = 4
    num_stages: int = 3
    num_splits: int | None = None

    @property
    def block_m(self) -> int:
        return self.block_h * self.block_q

    @property
    def label(self) -> str:
        text = f"h{self.block_h}q{self.block_q}-n{self.tile_n}-v{self.value_split}-w{self.num_warps}-s{self.num_stages}"
        return text + (f"-k{self.num_splits}" if self.num_splits else "")

    def acc_registers(self, latent_pad: int = 512) -> int:
        """fp32 accumulator registers a thread holds."""
        return self.block_m * (latent_pad // self.value_split) // (32 * self.num_warps)

    def smem_bytes(self, row_bytes: int = ROW_WIDTH_BYTES) -> int:
        """Shared memory the kernel needs (queries + pipelined latent tiles), within a few KB."""
        return (self.block_m + self.num_stages * self.tile_n) * row_bytes

    def problems(self, latent_pad: int = 512, row_bytes: int = ROW_WIDTH_BYTES) -> list[str]:
        """Why this config cannot run (or would spill heavily) on a Hopper-class GPU; [] if fine."""
        out = []
        if self.value_split not in (1, 2, 4):
            out.append(f"value_split {self.value_split} not in (1, 2, 4)")
        elif latent_pad // self.value_split < 16:
            out.append(f"value_split {self.value_split} leaves fewer than 16 columns")
        if self.block_m < 16 or self.tile_n < 16:
            out.append("tl.dot needs block_m and tile_n >= 16")
        if self.acc_registers(latent_pad) > 128:
            out.append(f"accumulator needs {self.acc_registers(latent_pad)} registers a thread (> 128)")
        if self.smem_bytes(row_bytes) > SMEM_BYTES:
            out.append(f"needs {self.smem_bytes(row_bytes) // 1024} KB of shared memory (> {SMEM_BYTES // 1024})")
        return out




def pick_mla_config(num_heads: int, max_query_len: int, row_bytes: int = ROW_WIDTH_BYTES,
                    fp8_cache: bool = False, num_seqs: int | None = None, sms: int | None = None,
                    max_shared: int = SMEM_BYTES, max_rows: int = 64) -> MLAConfig:
    """The default config: rows from heads first, then query tokens; 64 rows where they exist.

    64 rows (Hopper's warp-group MMA): the whole 512-column accumulator on 8 warps (128
    registers a thread; the two warp groups split the columns and both compute the scores), 64-key
    tiles, 2 stages (216 KB). For 128 heads of a decode token that is 2 head groups: 2 programs
    read each latent tile, the second from L2. In the static model of docs/perf-notes.md
    this beats 2 value parts on 4 warps (4 readers per tile, 32-key tiles),
    which an fp8 cache gets instead (its in-register up-conversion spills at 64-key tiles).
    Fewer rows (16 or 32: few heads, one token) take the mma.sync path, where the queries also
    sit in registers, so the value split keeps the accumulator at <= 64 registers. Wider rows
    (``row_bytes``: fp32 queries) drop stages, then keys per tile, until shared memory fits.
    The interpreter gets 16 rows, one warp, one stage.

    ``max_shared`` and ``max_rows`` (the target's; the defaults are the H200's): rows are capped
    at ``max_rows``, and where the config needs more shared memory than ``max_shared`` after
    dropping stages and keys, its rows halve (down to 16). Neither changes anything on sm90.

    A grid of fewer than a quarter program per SM unsplit (``num_seqs`` and ``sms`` given: small
    batches, which split the keys) takes the 4-warp value-split config instead: in the H200
    sweep it ran B=1 L=32768 in 58 us against 96 us for the 8-warp one,
    which in turn was 19% faster at B=32 (64 head groups on 132 SMs). Batches between were not
    measured; the quarter is the middle of that range.
    """
    max_m = 16 if interpreter_on() else max_rows
    block_h = min(next_power_of_2(max(num_heads, 1)), max_m)
    block_q = min(next_power_of_2(max(max_query_len, 1)), max_m // block_h)
    block_q = max(block_q, 16 // block_h)
    if interpreter_on():
        return MLAConfig(block_h, block_q, tile_n=32, value_split=1, num_warps=1, num_stages=1)
    head_groups = -(-max(num_heads, 1) // block_h)
    small_grid = num_seqs is not None and sms is not None and 4 * num_seqs * head_groups < sms
    if block_h * block_q >= 64 and not fp8_cache and not small_grid:
        config = MLAConfig(block_h, block_q, tile_n=64, value_split=1, num_warps=8, num_stages=2)
    else:
        acc_limit = 128 if block_h * block_q >= 64 else 64
        value_split = 1
        while value_split < 4 and MLAConfig(block_h, block_q, 32, value_split, 4).acc_registers() > acc_limit:
            value_split *= 2
        config = MLAConfig(block_h, block_q, tile_n=32, value_split=value_split, num_warps=4, num_stages=4)
    while config.smem_bytes(row_bytes) > max_shared and (config.num_stages > 2 or config.tile_n > 16
                                                         or config.block_m > 16):
        if config.num_stages > 2:
            config = replace(config, num_stages=config.num_stages - 1)
        elif config.tile_n > 16:
            config = replace(config, tile_n=config.tile_n // 2)
        elif config.block_h > 1 and config.block_h * config.block_q > 16:
            config = replace(config, block_h=config.block_h // 2)
        else:
            config = replace(config, block_q=max(1, config.block_q // 2))
    return config


def mla_programs_per_sm(config: MLAConfig) -> int:
    """Programs of this config resident on one SM at a time (by shared memory; 1 to 4)."""
    return max(1, min(4, SMEM_BYTES // max(config.smem_bytes(), 1)))


def mla_grid_q_blocks(num_tokens: int, num_seqs: int, config: MLAConfig) -> int:
    """Q blocks in the grid: enough for any split of num_tokens among num_seqs (no host sync).

    One token a block needs no slack; otherwise each sequence may end in a partial block.
    """
    if config.block_q == 1:
        return num_tokens
    return num_tokens // config.block_q + num_seqs


def choose_mla_splits(num_seqs: int, num_heads: int, max_query_len: int, max_seq_len: int, config: MLAConfig,
                      sms: int) -> int:
    """The module docstring's rule; 1 means no split (the kernel writes the output directly)."""
    q_blocks = num_seqs * -(-max(max_query_len, 1) // config.block_q)
    programs = max(1, q_blocks * -(-num_heads // config.block_h) * config.value_split)
    by_fill = MLA_FILL_PER_SM * mla_programs_per_sm(config) * sms // programs
    if by_fill < 2 or max_seq_len <= MLA_MIN_SEGMENT_TOKENS:
        return 1
    by_length = -(-max_seq_len // MLA_MIN_SEGMENT_TOKENS)
    return max(1, min(by_fill, by_length, MLA_MAX_SPLITS))


def resolve_mla_config(config: MLAConfig | None, num_heads: int, max_query_len: int,
                       row_bytes: int = ROW_WIDTH_BYTES, fp8_cache: bool = False, num_seqs: int | None = None,
                       sms: int | None = None, max_shared: int = SMEM_BYTES, max_rows: int = 64) -> MLAConfig:
    """``config`` or the default; its block_q is raised to 16 // block_h so that block_m >= 16."""
    config = config or pick_mla_config(num_heads, max_query_len, row_bytes, fp8_cache, num_seqs, sms,
                                       max_shared=max_shared, max_rows=max_rows)
    if config.block_m < 16:
        config = replace(config, block_q=-(-16 // config.block_h))
    return config


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
    config: MLAConfig,
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
    latent_pad = max(16, next_power_of_2(latent_dim))
    if config.value_split not in (1, 2, 4) or latent_pad // config.value_split < 16:
        raise ValueError(f"MLAConfig.value_split {config.value_split} does not divide latent dim {latent_dim} "
                         "into parts of >= 16 columns")
    if num_splits > 1:
        dst, dst_lse = partial_out, partial_lse
        o_strides = partial_out.stride()[:3]
        l_strides = partial_lse.stride()
    else:
        dst, dst_lse = out, lse
        o_strides = (out.stride(0), out.stride(1), 0)
        l_strides = (lse.stride(0), lse.stride(1), 0) if lse is not None else (0, 0, 0)
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
           st=MLAStrides(q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), *o_strides, *l_strides,
                         kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0)),
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
    launch(write_mla_kv_kernel, (num_tokens,),
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
        LATENT_PAD=next_power_of_2(latent_dim),
        ROPE_DIM=rope_dim,
        ROPE_PAD=next_power_of_2(rope_dim),
        PAGE_SIZE=kv_cache.shape[1],
        num_warps=1 if interpreter_on() else 4,
    )
