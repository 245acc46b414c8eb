"""Large-tile attention for long queries (prefill, extend): one program per (Q tile, q head, sequence).

FlashAttention-2 structure: a BLOCK_M-row tile of one head's queries stays in registers while
TILE_N-key tiles stream past; the key range is cut into a mask-free middle (every key visible
to every row: no masking work) and masked edges (the causal diagonal, the window's far edge,
the sequence end). K/V come either from contiguous tensors (``varlen_attention``: sequence s
owns rows ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``; ``kv.block_table`` is None) or from the paged
cache (through the block table, with out-of-cache ids dropped as in the other paths).
Sequences with fewer than ``min_q_len`` queries are left to the Q-block kernels.
"""

import triton
import triton.language as tl

from pagedattn.ops.common.attention_math import finalize_softmax
from pagedattn.ops.common.bundles import SIZES, Sizes
from pagedattn.ops.common.program import (
    QBlock,
    QTile,
    attend_tile,
    chunk_keys,
    chunk_pages,
    chunk_pages_in_cache,
    init_softmax_state,
    kv_scales,
    load_page_chunk,
    page_of_keys,
    page_of_tile_keys,
    visible_kv_bounds,
)


# Block ids a paged program reads at once: about 2048 keys' pages (at most 256 ids). Each chunk
# is its own pipelined tile loop; 8192- and 32768-key chunks measured the same on the H200.
CHUNK_TARGET_KEYS = 2048


@triton.constexpr_function
def _pages_per_chunk(page_size, tile_n):
    return chunk_pages(page_size, tile_n, CHUNK_TARGET_KEYS)


@triton.constexpr_function
def _keys_per_chunk(paged, page_size, tile_n):
    """Keys per block-table chunk; contiguous K/V: one chunk."""
    if not paged:
        return 2**30
    return chunk_keys(page_size, tile_n, CHUNK_TARGET_KEYS)


@triton.jit
def _tile_loop(qt, m_i, l_i, acc, kv, pages, first_page, k_row_start, tile_lo, tile_hi, kv_lo, kv_hi, mods, n,
               CFG: tl.constexpr, MASKED: tl.constexpr, CHECK_PAGES: tl.constexpr):
    """Online softmax over the key tiles tile_lo, tile_lo + TILE_N, ... < tile_hi, loaded through
    per-key pointers (the contiguous TMA path is ``_tile_loop_tma``).

    MASKED=False is for tiles whose keys are all visible to all rows: no rule is evaluated.
    Paged K/V: key k's block id comes from ``pages`` (the chunk's ids from page ``first_page``);
    CHECK_PAGES masks keys whose id lies outside the cache (never dereferenced), and is off for
    chunks whose ids were all checked at once (``chunk_pages_in_cache``).
    LARGE_CACHE: K/V element offsets in int64 (a K or V tensor spans 2**31 elements or more);
    otherwise int32, 57 fewer instructions a tile at 128x128 and 7% faster on the H200.
    """
    PAGE_SIZE: tl.constexpr = CFG.PAGE_SIZE
    TILE_N: tl.constexpr = CFG.TILE_N
    PAGED: tl.constexpr = kv.block_table is not None
    offs_d = tl.arange(0, CFG.HEAD_SIZE_PAD)
    offs_dv = tl.arange(0, CFG.HEAD_SIZE_V_PAD)
    offs_n = tl.arange(0, TILE_N)
    dim_ok = offs_d < CFG.HEAD_SIZE
    dim_v_ok = offs_dv < CFG.HEAD_SIZE_V
    OFF: tl.constexpr = tl.int64 if CFG.LARGE_CACHE else tl.int32
    # Tiles of whole pages (tile_lo is a multiple of TILE_N): a key's slot in its page is the same
    # in every tile (computed once here), and a tile's block ids are gathered once per page and
    # broadcast to the page's keys. Against per-key page and slot math: -21% at S=8192 on the H200.
    PAGE_ALIGNED: tl.constexpr = PAGED and TILE_N % PAGE_SIZE == 0
    slot_k = (offs_n % PAGE_SIZE).to(OFF) * kv.stride_k_s + qt.kv_head * kv.stride_k_h
    slot_v = (offs_n % PAGE_SIZE).to(OFF) * kv.stride_v_s + qt.kv_head * kv.stride_v_h
    for start in range(tile_lo, tile_hi, TILE_N):
        k_pos = start + offs_n
        key_ok = (k_pos >= kv_lo) & (k_pos < kv_hi)
        if PAGE_ALIGNED:
            page = page_of_tile_keys(pages, first_page, start, PAGE_SIZE, TILE_N)
            if CHECK_PAGES:
                key_ok = key_ok & (page >= 0) & (page < n.num_blocks)
            k_off = page.to(OFF) * kv.stride_k_b + slot_k
            v_off = page.to(OFF) * kv.stride_v_b + slot_v
        elif PAGED:
            page = page_of_keys(pages, first_page, k_pos, PAGE_SIZE).to(OFF)
            if CHECK_PAGES:
                key_ok = key_ok & (page >= 0) & (page < n.num_blocks)
            in_page = (k_pos % PAGE_SIZE).to(OFF)
            k_off = page * kv.stride_k_b + in_page * kv.stride_k_s + qt.kv_head * kv.stride_k_h
            v_off = page * kv.stride_v_b + in_page * kv.stride_v_s + qt.kv_head * kv.stride_v_h
        else:
            row = (k_row_start + k_pos).to(OFF)
            k_off = row * kv.stride_k_s + qt.kv_head * kv.stride_k_h
            v_off = row * kv.stride_v_s + qt.kv_head * kv.stride_v_h
        if MASKED or CHECK_PAGES:
            k = tl.load(kv.k_cache + k_off[None, :] + offs_d[:, None], mask=dim_ok[:, None] & key_ok[None, :],
                        other=0.0)
            v = tl.load(kv.v_cache + v_off[:, None] + offs_dv[None, :], mask=key_ok[:, None] & dim_v_ok[None, :],
                        other=0.0)
        else:
            k = tl.load(kv.k_cache + k_off[None, :] + offs_d[:, None], mask=dim_ok[:, None], other=0.0)
            v = tl.load(kv.v_cache + v_off[:, None] + offs_dv[None, :], mask=dim_v_ok[None, :], other=0.0)
        m_i, l_i, acc = attend_tile(qt, k, v, m_i, l_i, acc, k_pos, key_ok, mods, n, CFG, RAW_OK=CFG.BLOCK_M <= 64,
                                    MASKED=MASKED, CHECK_KEYS=CHECK_PAGES)
    return m_i, l_i, acc


@triton.jit
def _tile_loop_tma(qt, m_i, l_i, acc, k_desc, v_desc, k_row_start, tile_lo, tile_hi, kv_lo, kv_hi, mods, n,
                   CFG: tl.constexpr, MASKED: tl.constexpr):
    """``_tile_loop`` for contiguous K/V through tensor descriptors (sm90 TMA: no per-thread
    address tensors; 244 instead of 255 registers + spill at 128x128 tiles)."""
    offs_n = tl.arange(0, CFG.TILE_N)
    for start in range(tile_lo, tile_hi, CFG.TILE_N):
        k_pos = start + offs_n
        key_ok = (k_pos >= kv_lo) & (k_pos < kv_hi)
        # rows past the tensor read as 0; rows of the next sequence are masked below
        k = k_desc.load([k_row_start + start, qt.kv_head * CFG.HEAD_SIZE]).T
        v = v_desc.load([k_row_start + start, qt.kv_head * CFG.HEAD_SIZE_V])
        if MASKED:  # another sequence's rows: whatever they hold must not reach acc
            v = tl.where(key_ok[:, None], v, 0.0)
        m_i, l_i, acc = attend_tile(qt, k, v, m_i, l_i, acc, k_pos, key_ok, mods, n, CFG, RAW_OK=CFG.BLOCK_M <= 64,
                                    MASKED=MASKED, CHECK_KEYS=False)
    return m_i, l_i, acc


@triton.jit
def _key_tiles(qt, m_i, l_i, acc, kv, k_desc, v_desc, block_row_ptr, k_row_start, start_lo, start_hi, kv_lo, kv_hi,
               mods, n, CFG: tl.constexpr, MASKED: tl.constexpr):
    """The key tiles from start_lo to start_hi, a block-table chunk at a time for paged K/V.

    A mask-free chunk whose block ids all lie in the cache runs without per-key checks; one
    with an id outside it (a caller's bug or padding) runs the checked loop, which drops those
    keys. The per-key checks cost 21% at S=8192 on the H200.
    """
    PAGED: tl.constexpr = kv.block_table is not None
    CHUNK_PAGES: tl.constexpr = _pages_per_chunk(CFG.PAGE_SIZE, CFG.TILE_N)
    CHUNK_KEYS: tl.constexpr = _keys_per_chunk(PAGED, CFG.PAGE_SIZE, CFG.TILE_N)
    # A mask-free paged chunk runs two tile loops in sequence, one of them empty: unchecked tiles
    # [chunk_lo, clean_hi), checked ones [clean_hi, chunk_hi). In sequence rather than as two
    # branches of an if: the compiler shares pipeline buffers between loops in sequence but not
    # between branches (128x128 tiles would need 416 KB of shared memory).
    SPLIT_CHECKS: tl.constexpr = PAGED and not MASKED
    LOOPS: tl.constexpr = 2 if SPLIT_CHECKS else 1
    for chunk_lo in range(start_lo, start_hi, CHUNK_KEYS):  # one chunk for contiguous K/V
        chunk_hi = tl.minimum(chunk_lo + CHUNK_KEYS, start_hi)
        first_page = 0
        pages = 0
        clean_hi = chunk_hi
        if PAGED:
            first_page, pages = load_page_chunk(block_row_ptr, chunk_lo, n.max_blocks_per_seq, CFG.PAGE_SIZE,
                                                CHUNK_PAGES)
        if SPLIT_CHECKS:
            clean_hi = tl.where(chunk_pages_in_cache(pages, first_page, chunk_hi, n.num_blocks, CFG.PAGE_SIZE),
                                chunk_hi, chunk_lo)
        for loop in tl.static_range(LOOPS):
            tile_lo = chunk_lo
            tile_hi = chunk_hi
            if SPLIT_CHECKS:
                if loop == 0:
                    tile_hi = clean_hi
                else:
                    tile_lo = clean_hi
            if k_desc is not None:
                m_i, l_i, acc = _tile_loop_tma(qt, m_i, l_i, acc, k_desc, v_desc, k_row_start, tile_lo, tile_hi,
                                               kv_lo, kv_hi, mods, n, CFG, MASKED)
            else:  # the checked loop: paged, and the second loop or the only one
                m_i, l_i, acc = _tile_loop(qt, m_i, l_i, acc, kv, pages, first_page, k_row_start, tile_lo, tile_hi,
                                           kv_lo, kv_hi, mods, n, CFG, MASKED, PAGED and (loop == 1 or not SPLIT_CHECKS))
    return m_i, l_i, acc


@triton.jit(do_not_specialize=SIZES + ["min_q_len", "first_seq"])
def prefill_attention_kernel(dst, queries, kv, k_desc, v_desc, mods, num_seqs, num_tokens, num_blocks,
                             max_blocks_per_seq, num_prefix_ranges, sliding_window, min_q_len, first_seq,
                             CFG: tl.constexpr):
    """out = softmax(mods(scale * q k^T) + mask) v for one BLOCK_M tile of one query head.

    ``queries.seq_lens`` holds the KV lengths of paged K/V, cu_seqlens_k for contiguous K/V;
    ``k_desc`` / ``v_desc``: tensor descriptors over contiguous K/V, or None. The grid's
    sequences are ``first_seq, first_seq + 1, ...``: an offset rather than views of the metadata,
    whose addresses would change the kernel's pointer-alignment specialization with the offset
    (a new compile, 3-5 s, for many mixed engine steps).
    """
    # Programs start in launch order, x fastest: every head's and sequence's heaviest Q tile (the
    # last rows under the causal mask), then every next one. Longest first across the whole grid
    # leaves the lightest tiles for the last wave (docs/perf-notes.md).
    BLOCK_M: tl.constexpr = CFG.BLOCK_M
    TILE_N: tl.constexpr = CFG.TILE_N
    n = Sizes(num_seqs, num_tokens, num_blocks, max_blocks_per_seq, num_prefix_ranges, sliding_window)
    head = tl.program_id(0)
    seq = tl.program_id(1) + first_seq
    if seq >= num_seqs:
        return
    m_block = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(queries.query_start_loc + seq)
    q_len = tl.load(queries.query_start_loc + seq + 1) - q_start
    if (q_len < min_q_len) | (m_block * BLOCK_M >= q_len):
        return
    if kv.block_table is not None:
        kv_len = tl.load(queries.seq_lens + seq)
        k_row_start = 0
    else:
        k_row_start = tl.load(queries.seq_lens + seq)
        kv_len = tl.load(queries.seq_lens + seq + 1) - k_row_start
    context_len = kv_len - q_len
    kv_head = head // CFG.NUM_QUERIES_PER_KV

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, CFG.HEAD_SIZE_PAD)
    token = (q_start + offs_m).to(tl.int64)
    row_ok = (offs_m < q_len) & (token >= 0) & (token < num_tokens)
    q_pos = context_len + offs_m
    dim_ok = offs_d < CFG.HEAD_SIZE
    q = tl.load(queries.q + token[:, None] * queries.stride_q_t + head * queries.stride_q_h + offs_d[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    kv_lo, kv_hi = visible_kv_bounds(QBlock(seq, q_start, q_len, kv_len, m_block), mods, n, CFG)
    # Mask-free middle [full_lo, full_hi): whole tiles that every row of this tile sees.
    p_first = context_len + m_block * BLOCK_M
    p_last = tl.minimum(p_first + BLOCK_M, context_len + q_len) - 1
    free_lo = kv_lo
    free_hi = kv_hi
    if CFG.IS_CAUSAL:
        free_hi = tl.minimum(free_hi, p_first + 1)
    if sliding_window > 0:
        free_lo = tl.maximum(free_lo, p_last - sliding_window + 1)
        if not CFG.IS_CAUSAL:
            free_hi = tl.minimum(free_hi, p_first + sliding_window)
    free_lo = tl.maximum(free_lo, 0)
    full_lo = tl.cdiv(free_lo, TILE_N) * TILE_N
    full_hi = tl.maximum((free_hi // TILE_N) * TILE_N, full_lo)
    first_tile = (kv_lo // TILE_N) * TILE_N
    full_lo = tl.maximum(tl.minimum(full_lo, kv_hi), first_tile)
    full_hi = tl.maximum(tl.minimum(full_hi, kv_hi), full_lo)

    slope = 0.0
    if CFG.ALIBI_MODE != 0:
        slope = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(mods.alibi_slopes + head)
    k_scale, v_scale = kv_scales(mods)
    heads = tl.zeros([BLOCK_M], dtype=tl.int32) + head
    m_i, l_i, acc = init_softmax_state(mods, heads, row_ok, True, BLOCK_M, CFG.HEAD_SIZE_V_PAD)
    block_row = kv.block_table
    if kv.block_table is not None:
        block_row = kv.block_table + seq.to(tl.int64) * kv.stride_bt_s
    qt = QTile(q, q_pos, row_ok, slope, k_scale, v_scale, seq, kv_head)
    # the masked head, the mask-free middle, the masked tail
    m_i, l_i, acc = _key_tiles(qt, m_i, l_i, acc, kv, k_desc, v_desc, block_row, k_row_start, first_tile, full_lo,
                               kv_lo, kv_hi, mods, n, CFG, MASKED=True)
    m_i, l_i, acc = _key_tiles(qt, m_i, l_i, acc, kv, k_desc, v_desc, block_row, k_row_start, full_lo, full_hi,
                               kv_lo, kv_hi, mods, n, CFG, MASKED=False)
    m_i, l_i, acc = _key_tiles(qt, m_i, l_i, acc, kv, k_desc, v_desc, block_row, k_row_start, full_hi, kv_hi,
                               kv_lo, kv_hi, mods, n, CFG, MASKED=True)
    out, lse = finalize_softmax(acc, m_i, l_i)
    offs_dv = tl.arange(0, CFG.HEAD_SIZE_V_PAD)
    tl.store(dst.out + token[:, None] * dst.stride_o_t + head * dst.stride_o_h + offs_dv[None, :],
             out.to(dst.out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv < CFG.HEAD_SIZE_V)[None, :])
    if dst.lse is not None:
        tl.store(dst.lse + token * dst.stride_lse_t + head * dst.stride_lse_h, lse, mask=row_ok)
