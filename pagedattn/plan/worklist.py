"""The persistent kernel's work lists: which (sequence, Q block, KV head, split) items a batch
is cut into, and the rows the reduce kernel merges.

A plan builds its list once (:func:`persistent_work_list`) and re-builds it in place every
engine step (``AttentionPlan.update``), so the list is made in plain Python with byte copies
and a few torch ops (see :func:`persistent_work_list`). The split counts follow the path rule
(``rule.py``) per Q block.
"""

from __future__ import annotations

import torch

from pagedattn.ops.common.tiles import Tiles
from pagedattn.plan.rule import (
    FILL_MAX_SPLITS,
    LONG_SEGMENT_TOKENS,
    MANY_WAVES_SEGMENT_TOKENS,
    MIN_SEGMENT_TOKENS,
    PERSISTENT_UNCAPPED_PROGRAMS_PER_SM,
    RESIDENT_PROGRAMS_PER_SM,
    SPLIT_KV_MAX_QUERY_LEN,
    UNEQUAL_RATIO,
    min_segment_tokens,
    split_costs_more,
)

PERSISTENT_MAX_SPLITS = 64
# The persistent grid: 3 waves of resident decode programs (9 per SM); programs past the work
# list exit at once. With more items than resident programs, the hardware starts a new program
# as one finishes, which balances items of unequal length; a one-wave grid striding several
# items per program left the longest programs running alone (H200, 2 x 16384 + 126 x 512:
# 364 us on 396 programs, 118 us on 1188).
PERSISTENT_PROGRAMS_PER_SM = 9
UNEQUAL_WAVES = 3  # an unequal batch's list is cut for this many waves (rule.UNEQUAL_RATIO)
# A plan made for one unequal batch caps the persistent kernel at 168 registers per thread, so
# that 3 of its 4-warp programs fit an SM's 64K registers (uncapped: 194, 2 per SM; no spills at
# 168). H200: 2 x 16384 + 126 x 512 119 -> 113 us, 1 x 65536 + 255 x 128 143 -> 128. Plans for
# CUDA graphs keep 2 per SM: uniform 32 x 4096 lost 135 -> 149 us with the cap.
UNEQUAL_MAX_REGISTERS = 168
# Every other persistent plan states the ISA's limit (unless the target's decode tiles carry a
# budget of their own): ptxas must not pick its own. ptxas 13.0 (the one torch ships, which
# torch's inductor puts in TRITON_PTXAS_PATH when it first compiles a kernel in the process, as
# vLLM's torch.compile does) left to itself holds the kernel at 168 registers with 2 spilled;
# given this limit it takes 180-200 and spills nothing, as Triton's bundled ptxas 12.8 does
# either way. H200, graph plans, 64 x 2048: 159.7 against 134.5 us (16 x 4096: 80.5 against
# 76.3); the kernel ran that much slower inside vLLM than in the bench.
PERSISTENT_MAX_REGISTERS = 255
SCHEDULES = ("auto", "static", "atomic")
# "auto": the atomic counter when the work list has at least this many items per program.
# On the H200 with the one-wave grid, static striding beat the counter at 0.08, 0.97 and 1.29
# items per program (10.4 vs 15.1, 51.4 vs 54.7, 169.7 vs 183.1 us); the counter is kept for
# lists of several items per program (mixed batches), where striding can leave programs idle.
ATOMIC_MIN_ITEMS_PER_PROGRAM = 2.0


def persistent_work_list(qsl, lens, *, tiles: Tiles, num_kv_heads: int, num_programs: int, max_splits: int,
                         sliding_window: int | None = None, resident: int | None = None):
    """(items [n, 5] int32, reduce rows [m, 2] int32) for the persistent kernel.

    Every Q block is one item per KV head, or several (its key range cut in equal segments)
    when its queries are short, the unsplit items would not fill one wave of ``num_programs``
    programs and the contexts are long enough to pay for the reduce (``split_costs_more``).
    The split-KV rule (rule.py's docstring), with that wave: a Q block
    gets its share of the programs, ``floor(visible * num_programs / total visible)`` items per
    KV head (at least one, at most FILL_MAX_SPLITS), so the list holds at most one item per
    program of the wave; if that leaves items over LONG_SEGMENT_TOKENS keys,
    MANY_WAVES_SEGMENT_TOKENS-key items instead; never segments under MIN_SEGMENT_TOKENS, or
    under SHORT_SEGMENT_TOKENS where the items cut that fine hold at most one program per SM
    (``rule.min_segment_tokens``).

    An unequal batch (its longest visible length over UNEQUAL_RATIO x the mean per short Q
    block) is cut whatever the unsplit item count, for UNEQUAL_WAVES waves and up to
    ``max_splits`` items per block: the long sequences become many items of about the even
    share and the short ones stay whole, and the grid's later programs take them as earlier
    ones finish (H200, on a grid of 3 waves: 2 x 16384 + 126 x 512 119 us, 1.4x its bytes floor,
    where the one-wave cut left each long piece at 2048 keys beside 512-key items: 364 us).

    Items are block-major, then KV head, then split: (seq, q block, head, split, splits); when
    every sequence is one unsplit Q block, the longest sequences go first (``_longest_first``). Reduce
    rows are every token of a split Q block, with its block's split count.

    This runs every engine step (``plan.update()`` before a graph replay), so it works per
    sequence in plain Python and leaves the per-item work to byte copies and a few torch ops:
    a sequence's Q blocks share its split count (they see the same keys), each block's items
    are a memoized template for its split count, and only the sequence and Q block columns are
    written into the joined templates. On a 2-core CPU host: 35-130 us for 1-256 decode
    sequences of equal length (the ~40 small torch ops of a vectorized form took 240-330 us);
    an unequal batch of 256 (100-8000 keys and one of 32768: 4672 items, each sequence's split
    count computed) about 200 us.
    """
    qsl = _int_list(qsl)
    blocks, splits, order = work_list_layout(qsl, lens, tiles=tiles, num_kv_heads=num_kv_heads,
                                             num_programs=num_programs, max_splits=max_splits,
                                             sliding_window=sliding_window, resident=resident)
    return _work_items(blocks, splits, num_kv_heads, order), _reduce_rows(qsl, splits)


def work_list_layout(qsl, lens, *, tiles: Tiles, num_kv_heads: int, num_programs: int, max_splits: int,
                     sliding_window: int | None = None,
                     resident: int | None = None) -> tuple[list[int], list[int] | None, list[int] | None]:
    """(Q blocks per sequence, split count per sequence or None, the sequences' order in the
    list or None for their own) of :func:`persistent_work_list`: everything the list depends on
    besides ``qsl``, decided without building it."""
    qsl, lens = _int_list(qsl), _int_list(lens)
    q_lens = [b - a for a, b in zip(qsl, qsl[1:])]
    if len(lens) < len(q_lens):
        raise ValueError(f"{len(lens)} sequence lengths for {len(q_lens)} sequences")
    blocks = [-(-q // tiles.block_q) if q > 0 else 0 for q in q_lens]  # Q blocks per sequence
    visible = [v if v > 0 else 0 for v in lens[: len(q_lens)]]  # the keys each sequence's queries see
    if sliding_window:  # a query sees at most the window and the queries before it
        visible = [v if v < sliding_window + q else sliding_window + q - 1 for v, q in zip(visible, q_lens)]
    # None: a full grid of equal items without splitting: no partials to write and merge
    splits = _splits_per_seq(q_lens, blocks, visible, num_kv_heads=num_kv_heads, num_programs=num_programs,
                             max_splits=max_splits, resident=resident,
                             full=sum(blocks) * num_kv_heads >= num_programs)
    return blocks, splits, _longest_first(blocks, visible, splits)


def _longest_first(blocks, visible, splits) -> list[int] | None:
    """The sequences in the order their items go into the list: most visible keys first (ties in
    sequence order), when every sequence is one Q block, none is split and their lengths differ;
    None keeps the sequences' own order.

    Programs take items in list order (the hardware starts the grid's programs about in index
    order, and the atomic counter hands items out in it), so a long item listed late runs on
    after the others have finished; longest first is the classic cure for that tail. On the decode
    steps that vLLM's scheduler makes for 96 requests of 64-4096 prompt and 16-512 output tokens
    (64 sequences of 90-4300 keys, the longest under UNEQUAL_RATIO x the mean, so one item per
    sequence and head), scheduling the items greedily on 264 resident programs, each taking time in
    proportion to its 64-key tiles, ends the last program at 1.25x the bound (the keys spread
    evenly, or the longest item) in sequence order, 1.05x longest first (docs/vllm.md, "Where the
    time goes, per kernel": the decode kernel read 70% of the H200's peak there, FA3's 76%). On
    the H200 one such step (64 sequences of 90-4300 keys in no order, graph replays) took 206.3 us
    in sequence order and 156.7 us longest first, where FA3 takes 173.0. Split
    lists (unequal batches, or too few items for the grid) keep their order: their pieces are about
    equal, and pieces whose rounding moves with each step's extra key would reorder the list, and
    upload it again, at every step. On a 2-core host: 4 us for 64 equal decodes, 9 unequal."""
    n = len(blocks)
    if splits is not None or n < 2 or min(blocks) != 1 or max(blocks) != 1 or min(visible) == max(visible):
        return None
    return sorted(range(n), key=visible.__getitem__, reverse=True)  # reverse sorts keep ties in order


def _int_list(x) -> list[int]:
    """``x`` as a list of Python ints (numpy ints converted: no int32 overflow in the split
    arithmetic); lists of ints (what ``update()`` passes) as they are."""
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return x if isinstance(x, list) and all(type(v) is int for v in x) else [int(v) for v in x]


def _int32_tensor(values) -> torch.Tensor:
    """A 1-D int32 tensor from a list of ints or native int32 bytes, converted in C: on the host
    ``torch.tensor`` on a list costs ~50 ns per int, ``array`` ~15 ns and bytes one copy."""
    from array import array

    if not values:
        return torch.zeros(0, dtype=torch.int32)
    buf = bytearray(values) if isinstance(values, bytes) else array("i", values)  # "i": 4 bytes
    return torch.frombuffer(buf, dtype=torch.int32)  # shares (and keeps alive) buf, a private copy


def _splits_per_seq(q_lens, blocks, visible, *, num_kv_heads, num_programs, max_splits,
                    full: bool, resident: int | None = None) -> list[int] | None:
    """Each sequence's split count by persistent_work_list's rule (the same for all its Q
    blocks: they see the same ``visible`` keys); 1 for long queries and empty sequences. None when
    the unsplit items fill the grid (``full``) and the batch is not unequal. Comparisons rather
    than min()/max(): 4x faster."""
    if all(q == 1 for q in q_lens):  # a decode batch: every sequence one short Q block
        short, keys, short_blocks, longest = None, sum(visible), len(visible), max(visible + [0])
    else:
        short = [0 < q <= SPLIT_KV_MAX_QUERY_LEN for q in q_lens]
        keys = sum(v * nb for v, nb, sh in zip(visible, blocks, short) if sh)
        short_blocks = sum(nb for nb, sh in zip(blocks, short) if sh)
        longest = max([v for v, sh in zip(visible, short) if sh] + [0])
    unequal = longest > MIN_SEGMENT_TOKENS and longest * short_blocks > UNEQUAL_RATIO * keys
    if not unequal and (full or split_costs_more(short_blocks * num_kv_heads, longest, num_programs,
                                                  PERSISTENT_UNCAPPED_PROGRAMS_PER_SM)):
        return None
    total = max(keys * num_kv_heads, 1)
    # a batch of about equal lengths: at most one item per program the kernel holds at once
    target, cap = (UNEQUAL_WAVES * num_programs, max_splits) if unequal else (resident or num_programs, FILL_MAX_SPLITS)
    # Up to `small` keys the rule gives 1 (a share under 2 items, no long-segment cut): most of
    # an unequal batch, decided by one comparison
    small = min(LONG_SEGMENT_TOKENS, (2 * total - 1) // target)
    # the wave's SMs: num_programs is RESIDENT_PROGRAMS_PER_SM a SM
    segment = min_segment_tokens(short_blocks * num_kv_heads, longest, num_programs // RESIDENT_PROGRAMS_PER_SM)

    def rule(v: int) -> int:
        n = v * target // total  # the block's share of the items, 1..cap
        n = 1 if n < 1 else cap if n > cap else n
        if v > n * LONG_SEGMENT_TOKENS:  # segments over LONG_SEGMENT_TOKENS keys: many waves
            n = -(-v // MANY_WAVES_SEGMENT_TOKENS)
        by_length = -(-v // segment)  # no segment under `segment` keys
        n = by_length if n > by_length else n
        n = 1 if n < 1 else n
        return max_splits if n > max_splits else n

    if short is None:
        return [1 if v <= small else rule(v) for v in visible]
    return [rule(v) if sh and v > small else 1 for v, sh in zip(visible, short)]


def _per_block(per_seq, blocks) -> list:
    """A per-sequence list with each value repeated once per Q block of its sequence."""
    return [v for v, nb in zip(per_seq, blocks) for _ in range(nb)]


_BLOCK_ITEMS: dict[tuple[int, int], bytes] = {}


def _block_items(num_kv_heads: int, n: int) -> bytes:
    """The items of one Q block cut in ``n`` splits, its sequence and Q block left 0: rows
    (0, 0, head, split, n) for every head, then split, as int32 bytes. Memoized: an engine
    sees a few (heads, n) pairs, n <= max_splits; a Q block's items are then a byte copy."""
    data = _BLOCK_ITEMS.get((num_kv_heads, n))
    if data is None:
        from array import array

        data = array("i", [v for h in range(num_kv_heads) for i in range(n) for v in (0, 0, h, i, n)]).tobytes()
        if len(_BLOCK_ITEMS) < 4096:
            _BLOCK_ITEMS[num_kv_heads, n] = data
    return data


def _work_items(blocks, splits, num_kv_heads, order=None) -> torch.Tensor:
    """[n, 5] int32 items from the Q blocks and split counts (None: one each) per sequence, the
    sequences in ``order`` (None: their own; given only for unsplit one-block sequences): the blocks'
    templates joined as bytes, then the sequence and Q block columns written per block (one
    broadcast when every block has the same number of items)."""
    one_each = bool(blocks) and min(blocks) == max(blocks) == 1  # decode: one Q block per sequence
    if splits is None:
        data, per_block = _block_items(num_kv_heads, 1) * sum(blocks), num_kv_heads
    else:
        block_splits = splits if one_each else _per_block(splits, blocks)
        templates = {n: _block_items(num_kv_heads, n) for n in set(block_splits)}
        data = b"".join(map(templates.__getitem__, block_splits))
        per_block = num_kv_heads * next(iter(templates)) if len(templates) == 1 else 0
    if not data:
        return torch.zeros(0, 5, dtype=torch.int32)
    items = _int32_tensor(data).view(-1, 5)
    # [1 or 2, Q blocks]
    cols = _block_columns(blocks, one_each) if order is None else _int32_tensor(order).view(1, -1)
    if per_block:
        items.view(-1, per_block, 5)[:, :, : len(cols)] = cols.t().unsqueeze(1)
    else:
        counts = _int32_tensor(block_splits) * num_kv_heads
        for k, col in enumerate(cols):  # per column: 1-D repeats are the fast ones (2-7x)
            items[:, k] = col.repeat_interleave(counts)
    return items


_TORCH_COLUMNS_MIN_BLOCKS = 128  # the break-even of spec-decode batches (1-2 Q blocks per sequence)


def _block_columns(blocks, one_each: bool) -> torch.Tensor:
    """[1 or 2, Q blocks] int32: each Q block's sequence and, unless every sequence has one Q
    block (0, already in the templates), its index in the sequence. Python lists below
    _TORCH_COLUMNS_MIN_BLOCKS blocks (~0.25 us per sequence), else a few torch ops (~30 us)."""
    if one_each:
        return torch.arange(len(blocks), dtype=torch.int32).view(1, -1)
    if sum(blocks) < _TORCH_COLUMNS_MIN_BLOCKS:
        q_blocks = [qb for nb in blocks for qb in range(nb)]
        return _int32_tensor(_per_block(range(len(blocks)), blocks) + q_blocks).view(2, -1)
    per_seq = _int32_tensor(blocks)
    seqs = torch.repeat_interleave(per_seq).to(torch.int32)
    first = torch.cumsum(per_seq, 0, dtype=torch.int32) - per_seq  # each sequence's first Q block
    return torch.stack([seqs, torch.arange(len(seqs), dtype=torch.int32) - first[seqs]])


def _reduce_rows(qsl, splits) -> torch.Tensor:
    """[m, 2] int32 reduce rows: (token, splits) for every token of a split sequence (its Q
    blocks cover its tokens in order; only short sequences are split)."""
    rows = []
    for s, n in enumerate(splits or ()):
        if n > 1:
            for t in range(qsl[s], qsl[s + 1]):
                rows += (t, n)
    return _int32_tensor(rows).view(-1, 2)
