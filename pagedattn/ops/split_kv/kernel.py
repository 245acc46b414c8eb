"""Split-KV ("3D", parallel tiled softmax) paged attention for decode and short queries.

Program (Q block, KV head, split) attends to one segment of the keys its Q block can see and
writes a partial (out, lse) pair; ``reduce_splits_kernel`` merges a row's partials:
``out = sum_i e^{lse_i - lse} out_i`` with ``lse = log sum_i e^{lse_i}``. The sink joins only
split 0, so the merge counts it once. How a segment is cut: ``attend_segment``.
"""

import triton
import triton.language as tl

from pagedattn.ops.common.bundles import SIZES, Sizes
from pagedattn.ops.common.program import attend_segment, locate_q_block, q_block_rows, store_partial
from pagedattn.ops.merge.partials import merge_row


@triton.jit(do_not_specialize=SIZES + ["max_q_len_served", "segment_size"])
def split_kv_attention_kernel(part, segment_size, queries, kv, mods, num_seqs, num_tokens, num_blocks,
                              max_blocks_per_seq, num_prefix_ranges, sliding_window, max_q_len_served,
                              CFG: tl.constexpr, USE_PDL: tl.constexpr):
    """Partial softmax(mods(scale * q k^T) + mask) v over one segment of a sequence's keys."""
    if USE_PDL:  # the merge kernel may launch now; it waits for this grid in the kernel
        tl.extra.cuda.gdc_launch_dependents()
    n = Sizes(num_seqs, num_tokens, num_blocks, max_blocks_per_seq, num_prefix_ranges, sliding_window)
    blk, valid = locate_q_block(queries, tl.program_id(0), n, max_q_len_served, CFG)
    if not valid:
        return
    split = tl.program_id(2)
    if segment_size > 0 and split > 0 and split * segment_size >= blk.seq_len:
        # a fixed-position segment past the sequence's keys (a short sequence beside long ones):
        # the merge reads only its lse, -inf, so nothing else is loaded or stored
        token, head, row_ok, _ = q_block_rows(blk, blk.seq_len - blk.q_len, tl.program_id(1), n.num_tokens, CFG)
        tl.store(part.lse + token * part.stride_pl_t + head * part.stride_pl_h + split * part.stride_pl_s,
                 tl.full([CFG.BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
        return
    out, lse, token, head, row_ok = attend_segment(queries, kv, mods, n, blk, tl.program_id(1), split,
                                                   tl.num_programs(2), segment_size, CFG,
                                                   HOIST_PAGE_WORK=False)
    store_partial(part, out, lse, token, head, row_ok, split, CFG)


@triton.jit(do_not_specialize=["num_splits"])
def reduce_splits_kernel(dst, part, num_splits, HEAD_SIZE: tl.constexpr, HEAD_SIZE_PAD: tl.constexpr,
                         USE_PDL: tl.constexpr, ALL_WRITTEN: tl.constexpr = False):
    """One (token, head) row: merge its partials in split order (deterministic). Also MLA's merge.

    The grid is (num_tokens, num_heads) of ``dst.out``: no row past num_tokens exists.
    ALL_WRITTEN: every split stored its out (``merge_partials``), as the segment kernel does when
    it cuts the range evenly (``segment_size == 0``); fixed-position segments past a short
    sequence's end store only their lse, so that cut merges with ALL_WRITTEN off.
    """
    if USE_PDL:  # launched early (programmatic dependent launch): wait for the split kernel
        tl.extra.cuda.gdc_wait()
    merge_row(dst.out, dst.lse, part.out, part.lse, tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64),
              num_splits, dst.stride_o_t, dst.stride_o_h, dst.stride_lse_t, dst.stride_lse_h,
              part.stride_po_t, part.stride_po_h, part.stride_po_s, part.stride_pl_t, part.stride_pl_h,
              part.stride_pl_s, HEAD_SIZE, HEAD_SIZE_PAD, dst.lse is not None, ALL_WRITTEN)
