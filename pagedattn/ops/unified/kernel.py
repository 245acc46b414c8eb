"""The unified ("2D") paged-attention kernel: one program per (Q block, KV head).

A Q block packs BLOCK_Q consecutive query tokens of one sequence times all NUM_QUERIES_PER_KV
query heads that share a KV head, so ``tl.dot`` sees BLOCK_M >= 16 rows even for decode.
Each program walks the keys of its sequence in tiles of TILE_N tokens through the block
table, keeps the online softmax in fp32 (base 2), and skips tiles that the causal, window
and prefix-range rules leave empty. The grid's first axis has ``num_tokens // BLOCK_Q +
num_seqs`` entries, enough for every sequence's blocks without a host sync; extra programs exit.
"""

import triton
import triton.language as tl

from pagedattn.ops.common.bundles import SIZES, Sizes
from pagedattn.ops.common.program import attend_segment, locate_q_block, store_rows


@triton.jit(do_not_specialize=SIZES + ["max_q_len_served"])
def unified_attention_kernel(dst, queries, kv, mods, num_seqs, num_tokens, num_blocks, max_blocks_per_seq,
                             num_prefix_ranges, sliding_window, max_q_len_served, CFG: tl.constexpr):
    """out = softmax(mods(scale * q k^T) + mask) v, over the pages of one sequence."""
    n = Sizes(num_seqs, num_tokens, num_blocks, max_blocks_per_seq, num_prefix_ranges, sliding_window)
    blk, valid = locate_q_block(queries, tl.program_id(0), n, max_q_len_served, CFG)
    if not valid:
        return
    out, lse, token, head, row_ok = attend_segment(queries, kv, mods, n, blk, tl.program_id(1), 0, 1, 0, CFG,
                                                   HOIST_PAGE_WORK=True)
    store_rows(dst, out, lse, token, head, row_ok, CFG)
