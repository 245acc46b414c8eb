"""Tile choice for the large-tile prefill kernel: the H200 table and the short-prefill rule.

The table is the deterministic choice; ``pagedattn.ops.prefill.tuning`` may time other
candidates at run time (``PAGEDATTN_AUTOTUNE=1``) with this choice as its fallback.
"""

from __future__ import annotations

import torch

from pagedattn.ops.common.device import interpreter_on
from pagedattn.ops.common.host_math import cdiv, next_power_of_2
from pagedattn.ops.common.target import target_props
from pagedattn.ops.common.tiles import Tiles
from pagedattn.plan.tiles import fitted, num_sms

# short_prefill: up to this many waves of 128-row prefill programs, 64-row tiles at head 128
# (H200, paged, head 128: they won at 1, 2, 3.9 and 7.8 waves and lost 3% at 15.5)
SHORT_PREFILL_WAVES = 8


def pick_prefill_tiles(head_size: int, dtype: torch.dtype, *, short: bool = False) -> Tiles:
    """Tiles of the large-tile prefill kernel (block_m query rows x tile_n keys), from the H200
    sweeps (docs/perf-notes.md, "Prefill tiles and TMA"; one set for contiguous and paged K/V,
    tuned on contiguous: at head 128 paged K/V preferred the same tiles): 128 x 128 keys at 8
    warps for head 128, 128 x 64
    at 4 warps for head 64 and at 8 warps (2 stages: shared memory) for heads up to 256.

    ``short`` (see :func:`short_prefill`): 64-row tiles, two programs per SM, for heads of 65
    to 128: they halve the grain of the causal triangle's last wave (H200, paged, head 128:
    S=512 21 against 24 us, S=1024 39 against 45, S=2048 111 against 123, S=4096 374 against
    388). At head 64 the 128 x 64 tiles stayed faster (S=2048 70 against
    77 us) and at head 256 64-row tiles lost by 1.6x."""
    head_size_pad = max(16, next_power_of_2(head_size))
    if interpreter_on():
        return Tiles(32, 32, 32, 1, 1)
    if dtype == torch.float32:
        return Tiles(64, 64, 32, 4 if head_size_pad <= 64 else 8, 2)
    if short and head_size_pad == 128:
        return Tiles(64, 64, 64, 4, 3)
    if head_size_pad <= 64:
        return Tiles(128, 128, 64, 4, 3)
    if head_size_pad <= 128:
        return Tiles(128, 128, 128, 8, 3)
    return Tiles(128, 128, 64, 8, 2)


def short_prefill(max_query_len: int, num_seqs: int, num_q_heads: int, sms: int, *, diagonal: bool) -> bool:
    """Whether a prefill's time is set by the tail of its causal triangle: its 128-row grid
    (counted from the longest query, as the grid is) is at most SHORT_PREFILL_WAVES waves of one
    program per SM, and ``diagonal``: its keys are mostly its own queries (the caller's test,
    e.g. at most twice as many keys as queries), so the programs' work grows along the diagonal.
    An extend over a long context has programs of nearly equal work instead, where 128-row tiles
    win by reading each K/V tile for twice the rows.

    The callers count what they know without a sync: a plan the sequences its prefill grid covers,
    an eager call every sequence (the grid's exiting programs included), so the same mixed batch
    may take 64-row tiles through a plan and 128-row tiles eagerly (results then differ in the
    last bits). The rule ignores ``causal`` (the plan does not know it); it was measured causal."""
    programs = cdiv(max_query_len, 128) * num_q_heads * num_seqs
    return diagonal and programs <= SHORT_PREFILL_WAVES * sms


def prefill_tiles(max_query_len: int, max_seq_len: int, num_seqs: int, *, num_q_heads: int, head_size: int,
                  dtype: torch.dtype, device) -> Tiles:
    """The prefill kernel's tiles for a grid of ``num_seqs`` sequences of at most
    ``max_query_len`` queries and ``max_seq_len`` keys, fitted to ``device``'s target."""
    short = short_prefill(max_query_len, num_seqs, num_q_heads, num_sms(device),
                          diagonal=max_seq_len <= 2 * max_query_len)
    return fitted(pick_prefill_tiles(head_size, dtype, short=short), target_props(device), head_size, dtype)


def long_sequences(q_lens: list[int], min_q_len: int) -> tuple[int, int]:
    """[first, end): the smallest range of sequences that holds every one with >= min_q_len queries."""
    long = [i for i, n in enumerate(q_lens) if n >= min_q_len]
    return (long[0], long[-1] + 1) if long else (0, 0)
