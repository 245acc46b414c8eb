"""The path rule: which path runs a batch and in how many splits, for a plan and for a call
without one (:func:`choose_path`).

The rule (``path="auto"``):

* If some sequence has at least ``PREFILL_MIN_QUERY_LEN`` queries, those sequences run the
  large-tile prefill kernel and the others the unified kernel, in one call ("prefill").
* Long queries (``max_query_len > SPLIT_KV_MAX_QUERY_LEN``) take the unified ("2D") path: the
  Q blocks of the prefill/extend tokens already give the GPU enough programs.
* A decode batch of unequal lengths (one or a few long contexts among short ones: the uniform
  rule below would leave a long sequence in pieces over twice the even share of the keys) runs
  the persistent kernel with a work list made for it: the long sequences cut into items of about
  the even share for ``UNEQUAL_WAVES`` waves, the short ones whole, one launch of
  ``PERSISTENT_PROGRAMS_PER_SM`` programs per SM (``worklist.persistent_work_list``).
* Otherwise count the 2D grid, ``programs_2d = num_q_blocks * num_kv_heads``. If it reaches
  ``RESIDENT_PROGRAMS_PER_SM * num_sms`` (one full wave of decode programs) 2D runs.
  If not, split each sequence's keys into ``num_splits = min(FILL_MAX_SPLITS,
  (RESIDENT_PROGRAMS_PER_SM * num_sms) // programs_2d)`` segments: at most one wave, and a
  sequence cut in at most 32 pieces (the merge and each program's fixed start cost grow with the
  pieces). If that leaves segments longer than ``LONG_SEGMENT_TOKENS`` in a wave filled to
  less than ``FULL_WAVE_FILL`` (or in one split), cut ``MANY_WAVES_SEGMENT_TOKENS``-key segments
  instead (many waves of long programs). Short
  contexts do not split unless the 2D grid leaves most SMs idle: splitting needs
  ``programs_2d * RESIDENT_PROGRAMS_PER_SM * SPLIT_COST_TOKENS < num_sms * (max_seq_len -
  SPLIT_COST_TOKENS)`` (on 132 SMs: no split at 256 keys; at 512 keys up to 44 programs, at 1024
  up to 132). At most
  ``ceil(max_seq_len / MIN_SEGMENT_TOKENS)`` splits (a segment streams enough keys to amortize
  writing and merging its partial), or of SHORT_SEGMENT_TOKENS where segments that short still
  leave at most one program per SM (latency-bound calls, ``min_segment_tokens``), and
  ``MAX_SPLITS``; one split means 2D, except that a pure
  decode batch whose programs read at least ``LONG_DECODE_TOKENS`` keys runs the same items in
  the persistent kernel (that constant's comment says why). The persistent path's work list
  (``worklist.persistent_work_list``) applies the same rule per Q block. The constants come
  from H200 split-count sweeps (docs/perf-notes.md, "Decode tiles and splits"):
  a grid of 1.3-1.5 waves of long programs lost 15-25% to one of 0.65-1 wave; batch 1 preferred
  32 splits to 40-49 by 8%; 2.5+ waves of 2048-key segments beat an under-filled single wave of
  8192-key ones by 14%; below ``SPLIT_COST_TOKENS``' bound the 2D kernel won by 4-36% (B=16 at
  256 keys 11.2 against 14.8 us, B=24 at 512 keys 18.5 against 25.0).

A call without a plan knows only the batch's maxima: it takes the same rule up to the split
count (every sequence counted at ``max_query_len``); the persistent kernel's two cases need the
per-sequence lengths and a work list, which only a plan has.
"""

from __future__ import annotations

from typing import NamedTuple

from pagedattn.ops.common.host_math import cdiv
from pagedattn.ops.common.tiles import Tiles

SPLIT_KV_MAX_QUERY_LEN = 8
RESIDENT_PROGRAMS_PER_SM = 3  # decode tiles (16 x 64 keys, 4 warps, 3 stages): 146 regs, 72 KB smem
# Head 256 takes 16 x 32 tiles: the split-KV kernel compiles to 205 registers on sm90 (the 2D one
# to 188), 2 programs an SM, so a split count sized for 3 runs 1.45 waves (Gemma's shape, 32
# sequences x 4 KV heads: 3 splits, 384 programs for 264 slots), the regime where a persistent
# list cut for 3 per SM lost 15% to one cut for the 2 it holds (``planner._plan_persistent``)
WIDE_HEAD_RESIDENT_PROGRAMS_PER_SM = 2
FILL_MAX_SPLITS = 32  # the one-wave split count is capped here
LONG_SEGMENT_TOKENS = 4096
MANY_WAVES_SEGMENT_TOKENS = 2048
# A one-wave split count that fills this share of the wave keeps its long segments: H200, 8 KV
# heads, B=8 L=32768 6 splits 259.5 against 16 splits 274.7 us, B=16 L=16384 3 against 8 260.5 /
# 275.3, B=4 L=65536 12 against 32 260.4 / 274.7, B=16 L=32768 505 / 519, B=24 L=32768 (2 splits)
# 761.8 / 760.7; an under-filled wave (B=8 L=32768 at 4 splits, 0.65 of it: 299) still loses.
FULL_WAVE_FILL = 0.9
MIN_SEGMENT_TOKENS = 128
# Segments down to SHORT_SEGMENT_TOKENS (one 64-key decode tile) while the split grid, cut that
# fine, still holds at most one program per SM: such a call is latency-bound (each program's
# chain of block-table and page loads), and a program that streams one tile ends sooner than one
# that streams two. H200, 8 KV heads, head 128, B=1: L=512 8.26 -> 7.50 us (split-KV), 8.8 -> 8.2
# (a CUDA-graph plan); L=640 8.38 -> 7.62 and 9.16 -> 8.38; L=1024 8.80 -> 8.34 and 9.58 -> 9.44.
# Past one program per SM it loses (B=4 L=1024: 14.7 -> 15.4).
SHORT_SEGMENT_TOKENS = 64
# What splitting costs beyond the 2D kernel (the merge launch, the partials' round trip, ~5 us on
# the H200), in keys one 2D program streams in that time: B=1 decodes ran 8.3 us at 256 keys and
# 12.7 at 512 on the 2D kernel, 8.5 at 512 keys in 4 splits.
SPLIT_COST_TOKENS = 256
MAX_SPLITS = 128
INVARIANT_SEGMENT_TOKENS = 1024
# A decode batch is "unequal" when its longest visible length exceeds UNEQUAL_RATIO x the mean
# (per Q block). Its list is cut for UNEQUAL_WAVES waves of items of about equal keys (long
# sequences into up to max_splits pieces, short ones whole), whatever the unsplit item count
# (worklist.py).
UNEQUAL_RATIO = 2
# A decode batch of about equal lengths for which the split rule picks 2D (one split) runs the
# persistent kernel on the same items, without the register cap, when its programs are long (at
# least this many visible keys) and persistent_takes_fewer_waves says so. Uncapped, the
# persistent kernel holds 2 programs per SM (194 registers), the 2D kernel 3 (150): with the SMs
# saturated a program at 2 per SM streams 1.5x the bytes per second of one at 3 per SM, so the
# persistent kernel wins where its whole waves are fewer than 1.5x the 2D kernel's. H200, 2D ->
# persistent: 32 x 4096 143 -> 135 us, 64 x 2048 154 -> 136, 64 x 8192 576 -> 489, 128 x 4096
# 519 -> 501, 128 x 8192 1006 -> 957; the rule keeps 2D at 48 x 16384 (722 against 771) and
# 96 x 4096 (369 against 372). With the cap (3 per SM) the lists of 32 and 128 x 4096 took 154
# and 528. Short programs lose (128 x 512: 76 -> 82 us).
LONG_DECODE_TOKENS = 2048
PERSISTENT_UNCAPPED_PROGRAMS_PER_SM = 2
PREFILL_MIN_QUERY_LEN = 128
PATHS = ("auto", "unified", "split_kv", "persistent", "prefill")


class PathChoice(NamedTuple):
    """What the rule decided for a batch."""

    path: str
    num_splits: int  # the split-KV path's; 1 on the unified path
    segment_size: int = 0  # > 0: keys per split at fixed positions
    # persistent path: whether a plan for this batch alone may cap the kernel's registers (an
    # unequal batch); a long equal decode keeps the compiler's choice
    cap_registers: bool = True


def resident_programs_per_sm(head_size: int) -> int:
    """Decode programs (2D and split-KV kernels) one SM holds at this head size."""
    return RESIDENT_PROGRAMS_PER_SM if head_size <= 128 else WIDE_HEAD_RESIDENT_PROGRAMS_PER_SM


def choose_path(path: str, num_splits: int | None, *, max_query_len: int, max_seq_len: int, num_kv_heads: int,
                tiles: Tiles, sms: int, sliding_window: int | None, num_seqs: int = 0,
                q_lens: list[int] | None = None, seq_lens: list[int] | None = None,
                head_size: int = 128) -> PathChoice:
    """The module docstring's rule, for ``path`` (``"auto"``, or a path asked for: its split
    count) and ``num_splits`` (None: the rule's; else forced).

    ``q_lens`` and ``seq_lens`` are a plan's per-sequence host lengths; a call without a plan
    passes ``num_seqs`` instead and gets the rule from the maxima alone (every sequence counted at
    ``max_query_len``, no persistent path). ``head_size`` sets the programs an SM holds
    (:func:`resident_programs_per_sm`).
    """
    lengths = q_lens is not None
    resident = resident_programs_per_sm(head_size)
    segment = 0
    if num_splits is not None:
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        splits = num_splits
    else:
        if lengths:
            num_q_blocks = sum(-(-n // tiles.block_q) for n in q_lens)
        else:
            num_q_blocks = num_seqs * cdiv(max_query_len, tiles.block_q)
        splits = choose_num_splits(num_q_blocks, num_kv_heads, max_query_len, max_seq_len, sms, sliding_window,
                                   programs_per_sm=resident)
        if lengths and path in ("auto", "split_kv") and max_query_len <= SPLIT_KV_MAX_QUERY_LEN:
            segment = balanced_segment(q_lens, seq_lens, block_q=tiles.block_q, tile_n=tiles.tile_n,
                                       num_kv_heads=num_kv_heads, splits=splits, sms=sms,
                                       sliding_window=sliding_window, programs_per_sm=resident)
            if segment and path == "auto":
                # unequal lengths: a compact work list of about equal items (the persistent
                # kernel) instead of a grid of every sequence x split, whose slots past the
                # short sequences' keys are programs that only exit (67k of them at
                # 1 x 65536 + 255 x 128 on the H200: 341 us, 3.9x its bytes floor)
                return PathChoice("persistent", splits, segment)
            if segment:
                splits = -(-max_seq_len // segment)
    if path == "auto":
        path = auto_path(max_query_len, splits)
        visible = min(max_seq_len, sliding_window) if sliding_window else max_seq_len
        if (lengths and path == "unified" and num_splits is None and max_query_len == 1
                and visible >= LONG_DECODE_TOKENS
                and persistent_takes_fewer_waves(num_q_blocks * num_kv_heads, sms, programs_per_sm=resident)):
            # long decodes in fewer waves of 2 programs per SM: uncapped
            return PathChoice("persistent", splits, segment, cap_registers=False)
    return PathChoice(path, 1 if path == "unified" else splits, segment)


def invariant_choice(path: str, segment_size: int, tiles: Tiles, max_seq_len: int) -> PathChoice:
    """``batch_invariant=True``: the split-KV path with ``segment_size`` keys per split at fixed
    positions. Raises ValueError for a segment that is not whole tiles, or a path that cannot
    be batch-invariant."""
    if segment_size < tiles.tile_n or segment_size % tiles.tile_n:
        raise ValueError(f"segment_size must be a positive multiple of {tiles.tile_n}, got {segment_size}")
    if path in ("unified", "persistent"):
        raise ValueError(f"batch_invariant=True runs the split_kv path; path={path!r} conflicts")
    return PathChoice("split_kv", max(1, -(-max_seq_len // segment_size)), segment_size)


def auto_path(max_query_len: int, num_splits: int) -> str:
    """The module docstring's rule, once the split count is known."""
    if max_query_len >= PREFILL_MIN_QUERY_LEN:
        return "prefill"
    return "split_kv" if num_splits > 1 else "unified"


def choose_num_splits(num_q_blocks: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, sms: int,
                      sliding_window: int | None = None, programs_per_sm: int = RESIDENT_PROGRAMS_PER_SM) -> int:
    """The module docstring's rule; 1 means the unified path. A wave is ``programs_per_sm`` x
    ``sms`` programs.

    With a sliding window a query sees at most ``sliding_window + max_query_len - 1`` keys, and
    that length (not the sequence's) decides how many segments are worth it.
    """
    if sliding_window:
        max_seq_len = min(max_seq_len, sliding_window + max_query_len - 1)
    if max_query_len > SPLIT_KV_MAX_QUERY_LEN or max_seq_len <= MIN_SEGMENT_TOKENS:
        return 1
    programs_2d = max(1, num_q_blocks * num_kv_heads)
    wave = programs_per_sm * sms
    if programs_2d >= wave:
        return 1
    # short contexts: the idle SMs' share of the keys does not pay for the merge. The bound was
    # measured on the 2D kernel at 3 programs an SM and reads a wave of that size, whatever the
    # head size sets for ``wave`` above
    if split_costs_more(programs_2d, max_seq_len, RESIDENT_PROGRAMS_PER_SM * sms, RESIDENT_PROGRAMS_PER_SM):
        return 1
    splits = max(1, min(FILL_MAX_SPLITS, wave // programs_2d))
    full_wave = splits > 1 and programs_2d * splits >= FULL_WAVE_FILL * wave
    if -(-max_seq_len // splits) > LONG_SEGMENT_TOKENS and not full_wave:
        splits = -(-max_seq_len // MANY_WAVES_SEGMENT_TOKENS)
    by_length = -(-max_seq_len // min_segment_tokens(programs_2d, max_seq_len, sms))
    return max(1, min(splits, by_length, MAX_SPLITS))


def min_segment_tokens(programs: int, longest: int, sms: int) -> int:
    """The fewest keys a split may stream: SHORT_SEGMENT_TOKENS when ``programs`` unsplit
    programs cut into segments that short (of their ``longest`` visible keys) fit ``sms`` SMs at
    one program each, else MIN_SEGMENT_TOKENS."""
    fine = programs * -(-longest // SHORT_SEGMENT_TOKENS) <= sms
    return SHORT_SEGMENT_TOKENS if fine else MIN_SEGMENT_TOKENS


def balanced_segment(q_lens, lens, *, block_q: int, tile_n: int, num_kv_heads: int, splits: int, sms: int,
                     sliding_window: int | None, programs_per_sm: int = RESIDENT_PROGRAMS_PER_SM) -> int:
    """Keys per split at fixed positions for a decode batch of unequal lengths, or 0 (keep the
    uniform rule).

    The uniform rule cuts every sequence into the same number of pieces of its own length, so
    one long context among many short ones stays one long program (or a few) while the short ones
    finish early: 2 x 16384 among 126 x 512 ran at 4.4x its bytes floor on the H200. Cutting at
    fixed positions every ``segment`` keys instead gives each sequence pieces in proportion to its
    length: ``segment`` is the keys one resident program would stream if the batch's keys were
    shared evenly (at least MIN_SEGMENT_TOKENS, whole tiles). Used when the uniform rule's
    longest piece exceeds twice that share; the grid then also holds empty programs for the
    positions past the short sequences, which exit after their metadata loads. Under
    ``path="auto"`` a nonzero result sends the batch to the persistent kernel's compact work
    list instead (see :func:`choose_path`); ``path="split_kv"`` keeps this cut.
    """
    visible = [max(v, 0) for v in lens]
    if sliding_window:
        visible = [min(v, sliding_window + q - 1) for v, q in zip(visible, q_lens)]
    blocks = sum(-(-q // block_q) for q in q_lens if q > 0)
    work = sum(v * -(-q // block_q) for v, q in zip(visible, q_lens) if q > 0) * num_kv_heads
    longest = max([v for v, q in zip(visible, q_lens) if q > 0] + [0])
    if work == 0 or longest <= MIN_SEGMENT_TOKENS or longest * blocks * num_kv_heads <= UNEQUAL_RATIO * work:
        return 0  # equal lengths: the uniform rule's cut (one split of a short context included)
    share = work / (programs_per_sm * sms)
    segment = max(MIN_SEGMENT_TOKENS, -(-int(share) // tile_n) * tile_n)
    if longest / splits <= 2 * segment:
        return 0
    while -(-longest // segment) > MAX_SPLITS:
        segment *= 2
    return segment


def persistent_takes_fewer_waves(programs: int, sms: int, programs_per_sm: int = RESIDENT_PROGRAMS_PER_SM) -> bool:
    """Whether ``programs`` equal decode programs finish sooner in the uncapped persistent kernel
    (2 per SM) than in the 2D kernel (``programs_per_sm``, 3 up to head 128): a wave's time grows
    with the programs sharing an SM, so each kernel's time is its waves x its programs per SM; the
    persistent kernel must win by at least half of one of its waves (closer calls keep 2D)."""
    persistent = cdiv(programs, PERSISTENT_UNCAPPED_PROGRAMS_PER_SM * sms) * PERSISTENT_UNCAPPED_PROGRAMS_PER_SM
    two_d = cdiv(programs, programs_per_sm * sms) * programs_per_sm
    return persistent <= two_d - PERSISTENT_UNCAPPED_PROGRAMS_PER_SM / 2


def split_costs_more(programs: int, visible: int, wave: int, programs_per_sm: int) -> bool:
    """The split rule's short-context bound: whether ``programs`` unsplit programs of ``visible``
    keys, on a kernel holding ``programs_per_sm`` per SM, leave too few SMs idle for splitting to
    pay (``programs x programs_per_sm x SPLIT_COST_TOKENS >= SMs x (visible - SPLIT_COST_TOKENS)``;
    ``wave`` = RESIDENT_PROGRAMS_PER_SM x SMs). The 2D kernel holds 3 per SM (``choose_num_splits``);
    the persistent kernel 2 (graph plans keep the compiler's 194 registers), so its list leaves
    more short contexts whole. H200 graph replays, one item per block against the cut list:
    16 x 512 18.4 against 23.6 us, 24 x 512 20.2 against 30.4, 16 x 256 12.4 against 15.0; the cut
    list won at 8 x 512 (13.7 against 15.2) and 8 x 1024 (22.0 against 25.8)."""
    return (programs * programs_per_sm * RESIDENT_PROGRAMS_PER_SM * SPLIT_COST_TOKENS
            >= wave * (visible - SPLIT_COST_TOKENS))
