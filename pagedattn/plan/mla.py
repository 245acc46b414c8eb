"""MLA decode planning: the config (``pick_mla_config``) and the split count
(``choose_mla_splits``) of a launch, from the shapes alone; the budget they keep is in
:mod:`pagedattn.ops.mla.config`.

Split rule (``choose_mla_splits``): the unsplit grid has ``q_blocks * head_groups *
value_split`` programs, and about ``mla_programs_per_sm(config)`` of them fit an SM at once
(one for the large configs). The keys are cut into ``floor(fill * sms / programs)`` splits
(no split when that is below 2), at most ``ceil(max_seq_len / MLA_MIN_SEGMENT_TOKENS)`` (each
split writes a ``[heads, latent]`` fp32 partial per row block, 128 KB for 64 heads: segments
shorter than ~128 keys write more than they read) and at most ``MLA_MAX_SPLITS``.
"""

from __future__ import annotations

from dataclasses import replace

from pagedattn.ops.common.device import interpreter_on
from pagedattn.ops.common.host_math import next_power_of_2
from pagedattn.ops.mla.config import ROW_WIDTH_BYTES, SMEM_BYTES, MLAConfig

MLA_FILL_PER_SM = 1  # resident programs per SM the split rule aims for (times mla_programs_per_sm)
MLA_MIN_SEGMENT_TOKENS = 128
MLA_MAX_SPLITS = 64


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
