"""Persistent paged attention: a fixed grid whose programs take work items from a list.

The planner writes the items (sequence, Q block, KV head, split, number of splits) and their
count into device buffers, so a CUDA graph captured once replays for any batch up to the
captured maximum: the grid never changes, and programs past the list exit at once (on the H200
a graph of batch 1 ran the same with 1188 programs as with its 32 items' 32). Items of a Q
block with one split write the output directly; the others write partials that
``persistent_reduce_kernel`` merges, again from a device-side list of rows.

Scheduling, read from ``work_counts[2]`` at run time (so ``plan.update()`` can switch it between
replays of one captured graph): 0 strides statically (program p takes items p, p + P, ...); 1
takes the next item from a global atomic counter (zero at plan creation; the reduce kernel
resets it after each launch).

The work list is not trusted either: an item's rows are masked to tokens in [0, num_tokens)
(``q_block_rows``); an item whose sequence, KV head or split lies outside [0, num_seqs),
[0, num_kv_heads) or [0, max_splits) does nothing; the reduce kernel skips listed rows outside
[0, num_tokens) and reads at most max_splits partials of a row.
"""

from typing import NamedTuple

import triton
import triton.language as tl

from pagedattn.ops.common.bundles import SIZES, Sizes
from pagedattn.ops.common.program import QBlock, attend_segment, store_partial, store_rows
from pagedattn.ops.merge.partials import merge_row

ITEM_FIELDS = tl.constexpr(5)  # seq, q_block_local, kv_head, split, num_splits


class WorkList(NamedTuple):
    """The plan's work list: items [max_items, 5] int32, counts [3] int32 (items, reduce rows,
    schedule: 1 atomic), the atomic counter [1] int32 (0 at launch), reduce rows [max_rows, 2]
    int32 (token, num_splits)."""

    items: object
    counts: object
    counter: object
    reduce_rows: object


@triton.jit
def _item_fields(work, item):
    """Item ``item``'s fields (seq, Q block, KV head, split, splits), read without knowing whether
    the list holds it: the items buffer has ``num_programs`` rows past its capacity
    (``plan.workspace.work_buffers``), so every index a program can reach is in bounds."""
    fields = work.items + item.to(tl.int64) * ITEM_FIELDS
    return tl.load(fields), tl.load(fields + 1), tl.load(fields + 2), tl.load(fields + 3), tl.load(fields + 4)


@triton.jit
def _run_item(seq, q_block, kv_head, split, num_splits, dst, part, queries, kv, mods, n, num_kv_heads, max_splits,
              CFG: tl.constexpr):
    if (seq >= 0) & (seq < n.num_seqs) & (kv_head >= 0) & (kv_head < num_kv_heads) & (split >= 0) & (split < max_splits):
        q_start = tl.load(queries.query_start_loc + seq)
        q_len = tl.load(queries.query_start_loc + seq + 1) - q_start
        blk = QBlock(seq, q_start, q_len, tl.load(queries.seq_lens + seq), q_block)
        out, lse, token, head, row_ok = attend_segment(queries, kv, mods, n, blk, kv_head, split, num_splits, 0,
                                                       CFG, HOIST_PAGE_WORK=True)
        if num_splits == 1:
            store_rows(dst, out, lse, token, head, row_ok, CFG)
        else:
            store_partial(part, out, lse, token, head, row_ok, split, CFG)


@triton.jit(do_not_specialize=SIZES)
def persistent_attention_kernel(work, dst, part, queries, kv, mods, num_seqs, num_tokens, num_blocks,
                                max_blocks_per_seq, num_prefix_ranges, sliding_window, num_kv_heads, max_splits,
                                CFG: tl.constexpr, USE_PDL: tl.constexpr):
    """Each program runs work items until the list is done (see the module docstring).

    A program reads its first item before the list's item count, not after it (the items buffer
    holds a grid's rows past its capacity, so the read is in bounds whatever the count). The
    compiled sm90 code still issues that read after the schedule flag, which decides whether the
    item is program p's or the counter's; reading it before the flag too was slower at batch 1
    (docs/perf-notes.md, "Persistent scheduling").
    """
    if USE_PDL:  # the reduce kernel may launch now; it waits for this grid in the kernel
        tl.extra.cuda.gdc_launch_dependents()
    n = Sizes(num_seqs, num_tokens, num_blocks, max_blocks_per_seq, num_prefix_ranges, sliding_window)
    atomic = tl.load(work.counts + 2) != 0
    item = tl.program_id(0)
    if atomic:
        item = tl.atomic_add(work.counter, 1)
    seq, q_block, kv_head, split, num_splits = _item_fields(work, item)
    num_items = tl.load(work.counts)
    while item < num_items:
        _run_item(seq, q_block, kv_head, split, num_splits, dst, part, queries, kv, mods, n, num_kv_heads, max_splits,
                  CFG)
        if atomic:
            item = tl.atomic_add(work.counter, 1)
        else:
            item += tl.num_programs(0)
        seq, q_block, kv_head, split, num_splits = _item_fields(work, item)


@triton.jit
def _reduce_row(work, r, max_rows):
    """Listed row ``r``'s (token, number of splits); (-1, 0) past the buffer's ``max_rows``."""
    ok = r < max_rows
    return (tl.load(work.reduce_rows + 2 * r, mask=ok, other=-1).to(tl.int64),
            tl.load(work.reduce_rows + 2 * r + 1, mask=ok, other=0))


@triton.jit(do_not_specialize=["num_tokens", "max_rows"])  # one variant whatever a plan's capacity
def persistent_reduce_kernel(work, dst, part, num_tokens, max_splits, max_rows, NUM_Q_HEADS: tl.constexpr,
                             HEAD_SIZE: tl.constexpr, HEAD_SIZE_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    """Merge the partials of every listed (token, head) row, a fixed grid striding the list.

    Before the first partial, a program needs the list's count and its row, then the partials.
    The list was written before the attention kernel started, so a program reads its count and
    its first row together, and before it waits for that kernel; and every listed split wrote
    its partial, so the outs are read with the lses (``ALL_WRITTEN``). Inside vLLM at batch 1
    the reduce had taken 3.6 us a layer against 2.4 for vLLM's own (H200, torch.profiler), with
    four dependent reads (count, row, lses, outs) where this leaves one after the wait.

    It also resets the atomic work counter: every program of the attention kernel has finished
    (same stream), so the next launch starts from 0 without a memset of its own (a memset node
    cost ~2 us of a ~10 us graph replay on the H200).
    """
    idx = tl.program_id(0)
    token, num_splits = _reduce_row(work, idx // NUM_Q_HEADS, max_rows)
    num_rows = tl.load(work.counts + 1) * NUM_Q_HEADS
    if USE_PDL:  # launched early (programmatic dependent launch): wait for the attention kernel
        tl.extra.cuda.gdc_wait()
    if tl.program_id(0) == 0:
        tl.store(work.counter, 0)
    while idx < num_rows:
        head = idx % NUM_Q_HEADS  # small: int32 products stay in range
        if (token >= 0) & (token < num_tokens):
            merge_row(dst.out, dst.lse, part.out, part.lse, token, head, tl.minimum(num_splits, max_splits),
                      dst.stride_o_t, dst.stride_o_h, dst.stride_lse_t, dst.stride_lse_h,
                      part.stride_po_t, part.stride_po_h, part.stride_po_s, part.stride_pl_t, part.stride_pl_h,
                      part.stride_pl_s, HEAD_SIZE, HEAD_SIZE_PAD, dst.lse is not None, ALL_WRITTEN=True)
        idx += tl.num_programs(0)
        token, num_splits = _reduce_row(work, idx // NUM_Q_HEADS, max_rows)
