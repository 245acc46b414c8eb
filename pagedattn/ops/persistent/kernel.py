"""Persistent paged attention: a fixed grid whose programs take work items from a list.

The planner writes the items (sequence, Q block, KV head, split, number of splits) and their
count into device buffers, so a CUDA graph captured once replays for any batch up to the
captured maximum: the grid never changes, and no program exists only to exit. Items of a Q
block with one split write the output directly; the others write partials that
``persistent_reduce_kernel`` merges, again from a device-side list of rows.

Scheduling, read from ``work_counts[2]`` at run time (so ``plan.update()`` can switch it between
replays of one captured graph): 0 strides statically (program p takes items p, p + P, ...); 1
takes the next item from a global atomic counter (zero at plan creation; the reduce kernel
resets it after each launch).
"""

import triton
import triton.language as tl

from pagedattn.ops.merge.partials import merge_row
from pagedattn.ops.common.program import attend_segment, store_partial, store_rows

ITEM_FIELDS = tl.constexpr(5)  # seq, q_block_local, kv_head, split, num_splits


@triton.jit
def _run_item(
    item, work_items_ptr, out_ptr, lse_ptr, partial_out_ptr, partial_lse_ptr,
    stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
    stride_po_t, stride_po_h, stride_po_s, stride_pl_t, stride_pl_h,
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    sinks_ptr, alibi_slopes_ptr, prefix_ranges_ptr, k_scale_ptr, v_scale_ptr,
    stride_q_t, stride_q_h, stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
    stride_bt_s, stride_pr_s, stride_pr_r,
    scale, softcap, sliding_window, num_tokens, num_blocks, max_blocks_per_seq, num_prefix_ranges,
    NUM_QUERIES_PER_KV: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_SIZE_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, USE_SOFTCAP: tl.constexpr, ALIBI_MODE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_SINKS: tl.constexpr, USE_PREFIX: tl.constexpr, KV_FP8: tl.constexpr,
    LARGE_CACHE: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    fields = work_items_ptr + item.to(tl.int64) * ITEM_FIELDS
    seq = tl.load(fields)
    q_block_local = tl.load(fields + 1)
    kv_head = tl.load(fields + 2)
    split = tl.load(fields + 3)
    num_splits = tl.load(fields + 4)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    out, lse, token, head, row_ok = attend_segment(
        q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr,
        sinks_ptr, alibi_slopes_ptr, prefix_ranges_ptr, k_scale_ptr, v_scale_ptr,
        seq, q_start, q_len, seq_len, q_block_local, kv_head, split, num_splits, 0,
        stride_q_t, stride_q_h, stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
        stride_bt_s, stride_pr_s, stride_pr_r,
        scale, softcap, sliding_window, num_tokens, num_blocks, max_blocks_per_seq, num_prefix_ranges,
        NUM_QUERIES_PER_KV, HEAD_SIZE, HEAD_SIZE_PAD, PAGE_SIZE, BLOCK_Q, BLOCK_M, TILE_N,
        IS_CAUSAL, USE_SOFTCAP, ALIBI_MODE, DOT_PRECISION, USE_SINKS, USE_PREFIX, KV_FP8, LARGE_CACHE,
        True,  # PAGE_WORK_HOISTED (experiment 24)
    )
    if num_splits == 1:
        store_rows(out_ptr, lse_ptr, out, lse, token, head, row_ok, stride_o_t, stride_o_h,
                   stride_lse_t, stride_lse_h, HEAD_SIZE, HEAD_SIZE_PAD, RETURN_LSE)
    else:
        store_partial(partial_out_ptr, partial_lse_ptr, out, lse, token, head, row_ok, split,
                      stride_po_t, stride_po_h, stride_po_s, stride_pl_t, stride_pl_h, HEAD_SIZE, HEAD_SIZE_PAD)


@triton.heuristics(
    {
        "USE_SINKS": lambda args: args["sinks_ptr"] is not None,
        "USE_PREFIX": lambda args: args["prefix_ranges_ptr"] is not None,
        "KV_FP8": lambda args: args["k_scale_ptr"] is not None,
        "RETURN_LSE": lambda args: args["lse_ptr"] is not None,
    }
)
@triton.jit(do_not_specialize=[
    "num_seqs", "num_tokens", "num_blocks", "max_blocks_per_seq", "num_prefix_ranges", "sliding_window",
])
def persistent_attention_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_size]
    lse_ptr,  # [num_tokens, num_q_heads] fp32 or None
    partial_out_ptr,  # [max_num_tokens, num_q_heads, max_splits, head_size] fp32
    partial_lse_ptr,  # [max_num_tokens, num_q_heads, max_splits] fp32
    work_items_ptr,  # [max_items, 5] int32
    work_counts_ptr,  # [3] int32: items, reduce rows, schedule (1: atomic)
    work_counter_ptr,  # [1] int32, 0 at launch (atomic schedule; reset by the reduce kernel)
    stride_o_t, stride_o_h,
    stride_lse_t, stride_lse_h,
    stride_po_t, stride_po_h, stride_po_s,
    stride_pl_t, stride_pl_h,
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    sinks_ptr, alibi_slopes_ptr, prefix_ranges_ptr, k_scale_ptr, v_scale_ptr,
    stride_q_t, stride_q_h,
    stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h,
    stride_bt_s,
    stride_pr_s, stride_pr_r,
    scale,
    softcap,
    sliding_window,
    num_seqs,
    num_tokens,
    num_blocks,
    max_blocks_per_seq,
    num_prefix_ranges,
    max_q_len_served,  # unused: the work list names the Q blocks
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    ALIBI_MODE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_PREFIX: tl.constexpr,
    KV_FP8: tl.constexpr,
    LARGE_CACHE: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Each program runs work items until the list is done (see the module docstring)."""
    if USE_PDL:  # the reduce kernel may launch now; it waits for this grid in the kernel
        tl.extra.cuda.gdc_launch_dependents()
    num_items = tl.load(work_counts_ptr)
    atomic = tl.load(work_counts_ptr + 2) != 0
    if atomic:
        item = tl.atomic_add(work_counter_ptr, 1)
    else:
        item = tl.program_id(0)
    while item < num_items:
        _run_item(
            item, work_items_ptr, out_ptr, lse_ptr, partial_out_ptr, partial_lse_ptr,
            stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
            stride_po_t, stride_po_h, stride_po_s, stride_pl_t, stride_pl_h,
            q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
            sinks_ptr, alibi_slopes_ptr, prefix_ranges_ptr, k_scale_ptr, v_scale_ptr,
            stride_q_t, stride_q_h, stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
            stride_bt_s, stride_pr_s, stride_pr_r,
            scale, softcap, sliding_window, num_tokens, num_blocks, max_blocks_per_seq, num_prefix_ranges,
            NUM_QUERIES_PER_KV, HEAD_SIZE, HEAD_SIZE_PAD, PAGE_SIZE, BLOCK_Q, BLOCK_M, TILE_N,
            IS_CAUSAL, USE_SOFTCAP, ALIBI_MODE, DOT_PRECISION, USE_SINKS, USE_PREFIX, KV_FP8, LARGE_CACHE, RETURN_LSE,
        )
        if atomic:
            item = tl.atomic_add(work_counter_ptr, 1)
        else:
            item += tl.num_programs(0)


@triton.heuristics({"RETURN_LSE": lambda args: args["lse_ptr"] is not None})
@triton.jit
def persistent_reduce_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_size]
    lse_ptr,  # [num_tokens, num_q_heads] fp32 or None
    partial_out_ptr,  # [max_num_tokens, num_q_heads, max_splits, head_size] fp32
    partial_lse_ptr,  # [max_num_tokens, num_q_heads, max_splits] fp32
    reduce_rows_ptr,  # [max_num_tokens, 2] int32: token, num_splits
    work_counts_ptr,  # [3] int32: items, reduce rows, schedule
    work_counter_ptr,  # [1] int32: the attention kernel's atomic counter, reset to 0 here for the next launch
    stride_o_t, stride_o_h,
    stride_lse_t, stride_lse_h,
    stride_po_t, stride_po_h, stride_po_s,
    stride_pl_t, stride_pl_h,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Merge the partials of every listed (token, head) row, a fixed grid striding the list.

    It also resets the atomic work counter: every program of the attention kernel has finished
    (same stream), so the next launch starts from 0 without a memset of its own (a memset node
    cost ~2 us of a ~10 us replay in the waves run).
    """
    if USE_PDL:  # launched early (programmatic dependent launch): wait for the attention kernel
        tl.extra.cuda.gdc_wait()
    if tl.program_id(0) == 0:
        tl.store(work_counter_ptr, 0)
    num_rows = tl.load(work_counts_ptr + 1) * NUM_Q_HEADS
    for idx in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        r = idx // NUM_Q_HEADS
        head = idx % NUM_Q_HEADS  # small: int32 products stay in range
        token = tl.load(reduce_rows_ptr + 2 * r).to(tl.int64)
        num_splits = tl.load(reduce_rows_ptr + 2 * r + 1)
        merge_row(out_ptr, lse_ptr, partial_out_ptr, partial_lse_ptr, token, head, num_splits,
                  stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
                  stride_po_t, stride_po_h, stride_po_s, stride_pl_t, stride_pl_h, 1,
                  HEAD_SIZE, HEAD_SIZE_PAD, RETURN_LSE)
