"""The work of one program of the paged-attention kernels, in pieces shared by every path.

A program owns one Q block (BLOCK_Q query tokens of one sequence x the NUM_QUERIES_PER_KV
query heads of one KV head, BLOCK_M rows in all) and a range of that sequence's keys. The 2D
kernel gives it every visible key; the split-KV kernel one segment; the persistent kernel takes
(Q block, segment) items from a work list. The large-tile prefill kernel shares the visibility
rules, the score modifiers and the block-table reads.

Arguments are the bundles of ``pagedattn.ops.common.bundles``: ``queries``, ``kv``, ``mods``,
``n`` (the sizes), ``CFG`` (the constexpr config). The score modifiers are applied in two places
only, ``modified_scores`` and ``visible``: a new modifier is a field of ``ScoreMods`` and a few lines
there (docs/architecture.md).
"""

from typing import NamedTuple

import triton
import triton.language as tl

from pagedattn.ops.common.attention_math import (
    LOG2E,
    causal_window_mask,
    finalize_softmax,
    nonfinite_to_nan,
    online_softmax_step,
    online_softmax_step_finite,
    scores_log2,
)


SEARCH_BLOCK = tl.constexpr(256)  # sequences compared per step of find_q_block


class QBlock(NamedTuple):
    """A Q block's sequence (its index, first token, query count, KV length) and its index
    among the sequence's blocks (built in the kernels)."""

    seq: object
    q_start: object
    q_len: object
    seq_len: object
    q_block_local: object


class QTile(NamedTuple):
    """A program's queries and what stays fixed per row while its keys stream past (built in
    the kernels)."""

    q: object  # [BLOCK_M, HEAD_SIZE_PAD]
    q_pos: object  # [BLOCK_M] absolute positions
    row_ok: object  # [BLOCK_M]
    slope: object  # [BLOCK_M] ALiBi slopes (0.0 without)
    k_scale: object  # an fp8 cache's dequantization factors (1.0 without)
    v_scale: object
    seq: object
    kv_head: object


@triton.jit
def find_q_block(query_start_loc_ptr, seq_lens_ptr, q_block_idx, num_seqs,
                 BLOCK_Q: tl.constexpr, SEQ_ROOM: tl.constexpr):
    """(seq, q_start, q_len, seq_len, q_block_local, found) of global Q block ``q_block_idx``.

    Sequence s owns the Q blocks from ``start(s) = query_start_loc[s] // BLOCK_Q`` on, plus s
    with SEQ_ROOM (room for one partial block per sequence); start is non-decreasing in s, so the
    owner is the last sequence with ``start(s) <= q_block_idx``. Each step compares SEARCH_BLOCK
    sequences and loads their metadata (query start and end, length) with the same vector loads:
    up to 256 sequences, one memory round trip gives a program everything it needs before its
    block-table and K/V loads, where a binary search waited on log2(num_seqs) dependent loads and
    then on the metadata. ``found`` is False only if ``query_start_loc[0] > q_block_idx`` (corrupt
    metadata); the values always come from one sequence's entries.
    """
    offs = tl.arange(0, SEARCH_BLOCK)
    seq = tl.full([], -1, tl.int32)
    q_start = tl.full([], 0, tl.int32)
    q_end = q_start
    seq_len = q_start
    for s0 in range(0, num_seqs, SEARCH_BLOCK):
        s = s0 + offs
        ok = s < num_seqs
        starts = tl.load(query_start_loc_ptr + s, mask=ok, other=0)
        ends = tl.load(query_start_loc_ptr + s + 1, mask=ok, other=0)
        lens = tl.load(seq_lens_ptr + s, mask=ok, other=0)
        first = starts // BLOCK_Q
        if SEQ_ROOM:
            first += s
        last = tl.max(tl.where(ok & (first <= q_block_idx), s, -1), axis=0)
        pick = s == last
        has = last >= 0
        seq = tl.where(has, last, seq)
        q_start = tl.where(has, tl.sum(tl.where(pick, starts, 0), axis=0), q_start)
        q_end = tl.where(has, tl.sum(tl.where(pick, ends, 0), axis=0), q_end)
        seq_len = tl.where(has, tl.sum(tl.where(pick, lens, 0), axis=0), seq_len)
    found = seq >= 0
    seq = tl.maximum(seq, 0)
    q_block_local = q_block_idx - q_start // BLOCK_Q
    if SEQ_ROOM:
        q_block_local -= seq
    return seq, q_start, q_end - q_start, seq_len, q_block_local, found


@triton.jit
def locate_q_block(queries, q_block_idx, n, max_q_len_served, CFG: tl.constexpr):
    """(QBlock, valid) of global Q block ``q_block_idx``.

    Sequences with more than ``max_q_len_served`` queries are not valid here: the large-tile
    prefill kernel serves them in the same call.

    The metadata is not trusted: rows are later masked to tokens in [0, num_tokens) and keys to
    pages inside the block table and the cache (see ``q_block_rows`` and ``attend_kv_range``).
    """
    seq, q_start, q_len, seq_len, q_block_local, found = find_q_block(
        queries.query_start_loc, queries.seq_lens, q_block_idx, n.num_seqs, CFG.BLOCK_Q, True
    )
    valid = found & (q_block_local >= 0) & (q_block_local * CFG.BLOCK_Q < q_len) & (q_len <= max_q_len_served)
    return QBlock(seq, q_start, q_len, seq_len, q_block_local), valid


@triton.jit
def q_block_rows(blk, context_len, kv_head, num_tokens, CFG: tl.constexpr):
    """Per row of the block: (token index int64, q head int64, row valid, absolute position).

    A row is valid only inside its sequence and inside [0, num_tokens), whatever
    query_start_loc says.
    """
    offs_m = tl.arange(0, CFG.BLOCK_M)
    q_tok = blk.q_block_local * CFG.BLOCK_Q + offs_m // CFG.NUM_QUERIES_PER_KV  # within the sequence
    head = kv_head * CFG.NUM_QUERIES_PER_KV + offs_m % CFG.NUM_QUERIES_PER_KV
    token = (blk.q_start + q_tok).to(tl.int64)
    row_ok = ((offs_m < CFG.BLOCK_Q * CFG.NUM_QUERIES_PER_KV) & (q_tok < blk.q_len) & (token >= 0)
              & (token < num_tokens))
    return token, head.to(tl.int64), row_ok, context_len + q_tok


@triton.jit
def prefix_visible(mods, seq, num_prefix_ranges, q_pos, k_pos):
    """[M, N]: the pair (p, k) lies inside one bidirectional prefix range of sequence ``seq``."""
    vis = (q_pos[:, None] < 0) & (k_pos[None, :] < 0)  # all False (keys are >= 0), [M, N]
    base = mods.prefix_ranges + seq * mods.stride_pr_s
    for r in range(num_prefix_ranges):
        start = tl.load(base + r * mods.stride_pr_r)
        end = tl.load(base + r * mods.stride_pr_r + 1)
        in_q = (q_pos >= start) & (q_pos < end)
        in_k = (k_pos >= start) & (k_pos < end)
        vis = vis | (in_q[:, None] & in_k[None, :])
    return vis


@triton.jit
def visible_kv_bounds(blk, mods, n, CFG: tl.constexpr):
    """[kv_lo, kv_hi): the keys that any row of the Q block can see."""
    context_len = blk.seq_len - blk.q_len
    p_first = context_len + blk.q_block_local * CFG.BLOCK_Q
    p_last = tl.minimum(p_first + CFG.BLOCK_Q, context_len + blk.q_len) - 1
    kv_lo = blk.seq_len * 0
    kv_hi = blk.seq_len
    if CFG.IS_CAUSAL:
        kv_hi = tl.minimum(kv_hi, p_last + 1)
    if n.sliding_window > 0:
        kv_lo = tl.maximum(kv_lo, p_first - n.sliding_window + 1)
        if not CFG.IS_CAUSAL:
            kv_hi = tl.minimum(kv_hi, p_last + n.sliding_window)
    if mods.prefix_ranges is not None:  # widen to every range that holds a query position of the block
        base = mods.prefix_ranges + blk.seq * mods.stride_pr_s
        for r in range(n.num_prefix_ranges):
            start = tl.load(base + r * mods.stride_pr_r)
            end = tl.load(base + r * mods.stride_pr_r + 1)
            hit = (start < end) & (start <= p_last) & (end > p_first)
            kv_lo = tl.where(hit, tl.minimum(kv_lo, start), kv_lo)
            kv_hi = tl.where(hit, tl.maximum(kv_hi, end), kv_hi)
        kv_lo = tl.maximum(kv_lo, 0)
        kv_hi = tl.minimum(kv_hi, blk.seq_len)
    return kv_lo, kv_hi


@triton.jit
def visible(qt, k_pos, key_ok, mods, n, CFG: tl.constexpr):
    """[M, N] visibility: the causal, window and prefix-range rules, keys in key_ok, rows in qt.row_ok."""
    vis = causal_window_mask(qt.q_pos, k_pos, n.sliding_window, CFG.IS_CAUSAL)
    if mods.prefix_ranges is not None:
        vis = vis | prefix_visible(mods, qt.seq, n.num_prefix_ranges, qt.q_pos, k_pos)
    return vis & key_ok[None, :] & qt.row_ok[:, None]


@triton.jit
def modified_scores(qk, qt, k_pos, mods, CFG: tl.constexpr, RAW_OK: tl.constexpr):
    """(x, c): the base-2 scores of the raw dot products ``qk`` are ``c * x``.

    With RAW_OK (the caller folds c into the softmax's multiply-add) and no modifier that
    changes the scores, x is qk itself; otherwise the scale, softcap and ALiBi are applied here
    and c is 1.
    """
    if RAW_OK and CFG.POSITIVE_SCALE and mods.softcap is None and CFG.ALIBI_MODE == 0:
        return nonfinite_to_nan(qk), mods.scale * LOG2E  # an inf key's -inf score must not read as masked
    x = scores_log2(qk, mods.scale, qt.q_pos, k_pos, mods.softcap, qt.slope, mods.softcap is not None, CFG.ALIBI_MODE)
    return x, 1.0


@triton.jit
def attend_tile(qt, k, v, m_i, l_i, acc, k_pos, key_ok, mods, n, CFG: tl.constexpr, RAW_OK: tl.constexpr,
                MASKED: tl.constexpr, CHECK_KEYS: tl.constexpr):
    """One online-softmax step over a loaded K tile [HEAD_SIZE_PAD, TILE_N] and V tile.

    MASKED evaluates the visibility rules (and drops keys outside key_ok and rows outside
    qt.row_ok); CHECK_KEYS alone drops keys outside key_ok; neither: every key is visible to
    every row.
    """
    if mods.k_scale is not None:
        k = (k.to(tl.float32) * qt.k_scale).to(qt.q.dtype)
        v = (v.to(tl.float32) * qt.v_scale).to(qt.q.dtype)
    qk = tl.dot(qt.q, k, input_precision=CFG.DOT_PRECISION)  # [BLOCK_M, TILE_N]
    x, c = modified_scores(qk, qt, k_pos, mods, CFG, RAW_OK)
    if MASKED:
        p, alpha, m_i, l_i = online_softmax_step(m_i, l_i, tl.where(visible(qt, k_pos, key_ok, mods, n, CFG), x,
                                                                     float("-inf")), c)
    elif CHECK_KEYS:
        p, alpha, m_i, l_i = online_softmax_step(m_i, l_i, tl.where(key_ok[None, :], x, float("-inf")), c)
    else:  # every key of the tile is visible to every row
        p, alpha, m_i, l_i = online_softmax_step_finite(m_i, l_i, x, c)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=CFG.DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def kv_scales(mods):
    """(k_scale, v_scale): an fp8 cache's dequantization factors, else 1.0."""
    k_scale = 1.0
    v_scale = 1.0
    if mods.k_scale is not None:
        k_scale = tl.load(mods.k_scale)
        v_scale = tl.load(mods.v_scale)
    return k_scale, v_scale


@triton.jit
def load_q_block(queries, token, head, row_ok, CFG: tl.constexpr):
    offs_d = tl.arange(0, CFG.HEAD_SIZE_PAD)
    mask = row_ok[:, None] & (offs_d < CFG.HEAD_SIZE)[None, :]
    ptrs = queries.q + token[:, None] * queries.stride_q_t + head[:, None] * queries.stride_q_h + offs_d[None, :]
    return tl.load(ptrs, mask=mask, other=0.0)  # [BLOCK_M, HEAD_SIZE_PAD]


@triton.jit
def init_softmax_state(mods, head, row_ok, with_sink, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """(m_i, l_i, acc [BLOCK_M, WIDTH]) in base 2; the sink logit enters as a key of weight
    e^sink and no value.

    ``with_sink`` is False for programs that must not count the sink (all split-KV segments but
    the first), so the merged result counts it exactly once.
    """
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if mods.sinks is not None:
        sink = tl.load(mods.sinks + head, mask=row_ok, other=float("-inf")).to(tl.float32)
        m_i = tl.where(with_sink, sink * LOG2E, m_i)
    l_i = tl.where(m_i > float("-inf"), 1.0, 0.0)
    acc = tl.zeros([BLOCK_M, WIDTH], dtype=tl.float32)
    return m_i, l_i, acc


# Keys whose block ids a decode program reads at once (at 16-token pages the 256-id cap: 4032
# keys). Each chunk restarts the tile loop's pipeline behind a dependent load of its ids: on the
# H200, 4032-key chunks against 960-key ones ran B=1 L=32768 42.7 -> 41.5 us, B=32 L=32768
# 1021 -> 1005, B=32 L=4096 134.0 -> 132.2 (2048-key chunks gained nothing), other decode
# points within 0.6%.
DECODE_CHUNK_TARGET_KEYS = tl.constexpr(4096)


@triton.constexpr_function
def chunk_pages(page_size, tile_n, target_keys):
    """Block-table ids a program reads at once (a power of 2): about ``target_keys`` keys' pages,
    always more than one tile's, at most 256 unless a tile needs more."""
    tile_pages = -(-tile_n // page_size) + 1
    want = 1 << (max(-(-target_keys // page_size), tile_pages, 2) - 1).bit_length()
    return min(want, max(256, 1 << (tile_pages - 1).bit_length()))


@triton.constexpr_function
def chunk_keys(page_size, tile_n, target_keys):
    """Keys per chunk: whole tiles whose pages always fit in ``chunk_pages`` ids, wherever the chunk starts."""
    return max((chunk_pages(page_size, tile_n, target_keys) - 1) * page_size // tile_n, 1) * tile_n


@triton.jit
def load_page_chunk(block_row_ptr, chunk_lo, max_blocks_per_seq, PAGE_SIZE: tl.constexpr, CHUNK_PAGES: tl.constexpr):
    """(first page index, the CHUNK_PAGES block ids from there; -1 past the table's row).

    Reading the ids once per chunk, outside the tile loop, keeps the K/V addresses of a tile
    free of a load in the same iteration, so the compiler's pipeliner can issue K/V loads
    stages ahead as it does for contiguous K/V.
    """
    first_page = chunk_lo // PAGE_SIZE
    idx = first_page + tl.arange(0, CHUNK_PAGES)
    pages = tl.load(block_row_ptr + idx, mask=(idx >= 0) & (idx < max_blocks_per_seq), other=-1)
    return first_page, pages


@triton.jit
def chunk_pages_in_cache(pages, first_page, chunk_hi, num_blocks, PAGE_SIZE: tl.constexpr):
    """Whether every block id that keys [first_page * PAGE_SIZE, chunk_hi) use lies in
    [0, num_blocks) (a scalar): then their tiles may skip the per-key page checks."""
    used = tl.arange(0, pages.shape[0]) <= (chunk_hi - 1) // PAGE_SIZE - first_page
    bad = used & ((pages < 0) | (pages >= num_blocks))
    return tl.max(bad.to(tl.int32), 0) == 0


@triton.jit
def chunk_ids(pages, idx):
    """``pages[idx]``, with ``idx`` wrapped into the chunk (its length is a power of 2).

    The loop pipeliner issues the gathers of the next num_stages - 1 tiles before the loop's
    test, so past a chunk's last tile they index one or two pages past the chunk (their keys'
    loads are predicated off; the gather is not). A gather reads its source through a shared
    memory scratch, and where that scratch ends the kernel's allocation (the unified kernel at
    head 256 on sm90: 73728 + 1024 of 74752 bytes) the read past it is an illegal address on
    the H200 (compute-sanitizer: invalid __shared__ read in this gather). Wrapped, such a lane
    reads a real id of the chunk, and its key stays masked. One AND, not a min and a max: the
    clamp cost the portable MLA decode kernel 3% at B=128 L=32768 on the H200 (5660 -> 5827 µs)
    and the unified kernel 3 registers; the AND leaves the unified kernel at head 128 with 149
    registers (151 with no bound at all, 154 with the clamp) on sm90."""
    return tl.gather(pages, idx & (pages.shape[0] - 1), 0)


@triton.jit
def page_of_keys(pages, first_page, k_pos, PAGE_SIZE: tl.constexpr):
    """The block id of each key position (int32), gathered from a chunk's ids in registers."""
    return chunk_ids(pages, k_pos // PAGE_SIZE - first_page)


@triton.jit
def page_of_tile_keys(pages, first_page, start, PAGE_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """``page_of_keys`` for the TILE_N keys from ``start``, when the tile holds whole pages
    (``start`` a page boundary, TILE_N a multiple of PAGE_SIZE): one gather per page, broadcast
    to its keys (6% faster than one per key in the paged prefill kernel on the H200, S=8192)."""
    TILE_PAGES: tl.constexpr = TILE_N // PAGE_SIZE
    ids = chunk_ids(pages, start // PAGE_SIZE - first_page + tl.arange(0, TILE_PAGES))
    return tl.reshape(tl.broadcast_to(ids[:, None], (TILE_PAGES, PAGE_SIZE)), (TILE_N,))


@triton.jit
def attend_kv_range(qt, m_i, l_i, acc, kv, block_row_ptr, mods, n, tile_lo, kv_lo, kv_hi,
                    CFG: tl.constexpr, HOIST_PAGE_WORK: tl.constexpr):
    """Online softmax over keys [max(tile_lo, kv_lo), kv_hi) in TILE_N steps from ``tile_lo``.

    Each key is found through the block table: position k lives in physical block
    ``block_row[k // PAGE_SIZE]`` at slot ``k % PAGE_SIZE``. The table is read a chunk of
    CHUNK_PAGES ids at a time, outside the tile loop (see ``load_page_chunk``). A key whose page
    lies past the table's row or whose block id lies outside [0, num_blocks) is masked, never
    dereferenced. Offsets are int32 unless LARGE_CACHE (a cache spanning 2**31 elements or more):
    64-bit per-key offsets cost about 35 registers per thread at 16x64 tiles, a third of the
    programs an SM can hold (docs/perf-notes.md).
    """
    PAGE_SIZE: tl.constexpr = CFG.PAGE_SIZE
    TILE_N: tl.constexpr = CFG.TILE_N
    offs_d = tl.arange(0, CFG.HEAD_SIZE_PAD)
    offs_n = tl.arange(0, TILE_N)
    dim_ok = offs_d < CFG.HEAD_SIZE
    CHUNK_PAGES: tl.constexpr = chunk_pages(PAGE_SIZE, TILE_N, DECODE_CHUNK_TARGET_KEYS)
    CHUNK_KEYS: tl.constexpr = chunk_keys(PAGE_SIZE, TILE_N, DECODE_CHUNK_TARGET_KEYS)
    # HOIST_PAGE_WORK (the 2D and persistent kernels): a chunk's block ids are checked once, and
    # a key's slot in its page and its page's place among the tile's pages are computed once, not
    # per tile. Tiles advance by whole pages (TILE_N a multiple of the page), so both are the
    # same in every tile, from the first tile's phase in its page. On the H200 decode grid: up to
    # 6% faster in the 2D kernel (148 registers against 160), up to 6% slower in split-KV (168 +
    # a spill against 146); so the split-KV kernel keeps the per-key form.
    HOIST: tl.constexpr = HOIST_PAGE_WORK and TILE_N % PAGE_SIZE == 0
    if HOIST:
        phase = tile_lo % PAGE_SIZE
        rel_page = (phase + offs_n) // PAGE_SIZE
        slot = (phase + offs_n) % PAGE_SIZE
        if CFG.LARGE_CACHE:
            slot = slot.to(tl.int64)
        slot_k = slot * kv.stride_k_s + qt.kv_head * kv.stride_k_h
        slot_v = slot * kv.stride_v_s + qt.kv_head * kv.stride_v_h
    for chunk_lo in range(tile_lo, kv_hi, CHUNK_KEYS):
        first_page, pages = load_page_chunk(block_row_ptr, chunk_lo, n.max_blocks_per_seq, PAGE_SIZE, CHUNK_PAGES)
        chunk_hi = tl.minimum(chunk_lo + CHUNK_KEYS, kv_hi)
        if HOIST:
            clean = chunk_pages_in_cache(pages, first_page, chunk_hi, n.num_blocks, PAGE_SIZE)
        for start in range(chunk_lo, chunk_hi, TILE_N):
            k_pos = start + offs_n  # [TILE_N]
            # Keys whose block id lies outside the cache are masked, never dereferenced (with
            # HOIST, checked per key only in a chunk that holds such an id). (Clamping the id and
            # zeroing V instead measured 1.7x slower: the select between V's load and the dot
            # costs the async-copy pipeline.)
            if HOIST:
                page = chunk_ids(pages, (start - phase) // PAGE_SIZE - first_page + rel_page)
                k_ok = (k_pos >= kv_lo) & (k_pos < kv_hi) & (clean | ((page >= 0) & (page < n.num_blocks)))
                if CFG.LARGE_CACHE:  # offsets of 2**31 elements or more; otherwise int32 saves registers
                    page = page.to(tl.int64)
                k_off = page * kv.stride_k_b + slot_k
                v_off = page * kv.stride_v_b + slot_v
            else:
                page = page_of_keys(pages, first_page, k_pos, PAGE_SIZE)
                k_ok = (k_pos >= kv_lo) & (k_pos < kv_hi) & (page >= 0) & (page < n.num_blocks)
                in_page = k_pos % PAGE_SIZE
                if CFG.LARGE_CACHE:
                    page = page.to(tl.int64)
                    in_page = in_page.to(tl.int64)
                k_off = page * kv.stride_k_b + in_page * kv.stride_k_s + qt.kv_head * kv.stride_k_h
                v_off = page * kv.stride_v_b + in_page * kv.stride_v_s + qt.kv_head * kv.stride_v_h
            k = tl.load(kv.k_cache + k_off[None, :] + offs_d[:, None], mask=dim_ok[:, None] & k_ok[None, :],
                        other=0.0)  # [HEAD_SIZE_PAD, TILE_N]
            v = tl.load(kv.v_cache + v_off[:, None] + offs_d[None, :], mask=k_ok[:, None] & dim_ok[None, :],
                        other=0.0)  # [TILE_N, HEAD_SIZE_PAD]
            m_i, l_i, acc = attend_tile(qt, k, v, m_i, l_i, acc, k_pos, k_ok, mods, n, CFG, RAW_OK=False,
                                        MASKED=True, CHECK_KEYS=False)
    return m_i, l_i, acc


@triton.jit
def attend_segment(queries, kv, mods, n, blk, kv_head, split, num_splits, segment_size,
                   CFG: tl.constexpr, HOIST_PAGE_WORK: tl.constexpr):
    """Attention of one Q block over segment ``split`` of ``num_splits`` of its visible keys.

    Returns (out, lse, token, head, row_ok): out [BLOCK_M, HEAD_SIZE_PAD] normalized fp32, lse
    [BLOCK_M] natural log. ``segment_size == 0`` cuts the visible range into ``num_splits``
    equal tile-aligned pieces (one piece: the whole range, the 2D kernel); ``segment_size > 0``
    gives split i the absolute positions [i * segment_size, (i + 1) * segment_size), the same
    cut whatever else is in the batch (batch-invariant mode). The sink joins split 0 only.
    The Q block ``blk`` comes from the caller (``locate_q_block``, or the persistent kernel's
    work item).
    """
    TILE_N: tl.constexpr = CFG.TILE_N
    BLOCK_M: tl.constexpr = CFG.BLOCK_M
    context_len = blk.seq_len - blk.q_len  # negative for cross attention with more queries than keys
    token, head, row_ok, q_pos = q_block_rows(blk, context_len, kv_head, n.num_tokens, CFG)
    kv_lo, kv_hi = visible_kv_bounds(blk, mods, n, CFG)
    first_tile = (kv_lo // TILE_N) * TILE_N
    if segment_size > 0:
        seg_start = split * segment_size
        seg_end = seg_start + segment_size
        tile_lo = tl.maximum(seg_start, first_tile)
    else:
        tiles = tl.cdiv(tl.cdiv(kv_hi - first_tile, TILE_N), num_splits)
        seg_start = first_tile + split * tiles * TILE_N
        seg_end = seg_start + tiles * TILE_N
        tile_lo = seg_start
    seg_end = tl.minimum(seg_end, kv_hi)

    q = load_q_block(queries, token, head, row_ok, CFG)
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if CFG.ALIBI_MODE != 0:
        slope = tl.load(mods.alibi_slopes + head, mask=row_ok, other=0.0)
    k_scale, v_scale = kv_scales(mods)
    qt = QTile(q, q_pos, row_ok, slope, k_scale, v_scale, blk.seq, kv_head)
    m_i, l_i, acc = init_softmax_state(mods, head, row_ok, split == 0, BLOCK_M, CFG.HEAD_SIZE_PAD)
    block_row_ptr = kv.block_table + blk.seq.to(tl.int64) * kv.stride_bt_s
    m_i, l_i, acc = attend_kv_range(qt, m_i, l_i, acc, kv, block_row_ptr, mods, n, tile_lo, kv_lo, seg_end, CFG,
                                    HOIST_PAGE_WORK)
    out, lse = finalize_softmax(acc, m_i, l_i)
    return out, lse, token, head, row_ok


@triton.jit
def store_rows(dst, out, lse, token, head, row_ok, CFG: tl.constexpr):
    """Store a Q block's final rows (out in dst.out's dtype; lse when dst.lse is given)."""
    offs_d = tl.arange(0, CFG.HEAD_SIZE_PAD)
    tl.store(dst.out + token[:, None] * dst.stride_o_t + head[:, None] * dst.stride_o_h + offs_d[None, :],
             out.to(dst.out.dtype.element_ty), mask=row_ok[:, None] & (offs_d < CFG.HEAD_SIZE)[None, :])
    if dst.lse is not None:
        tl.store(dst.lse + token * dst.stride_lse_t + head * dst.stride_lse_h, lse, mask=row_ok)


@triton.jit
def store_partial(part, out, lse, token, head, row_ok, split, CFG: tl.constexpr):
    """Store a Q block's partial rows for split ``split`` (fp32 out, lse)."""
    offs_d = tl.arange(0, CFG.HEAD_SIZE_PAD)
    row = token * part.stride_po_t + head * part.stride_po_h + split * part.stride_po_s
    tl.store(part.out + row[:, None] + offs_d[None, :], out, mask=row_ok[:, None] & (offs_d < CFG.HEAD_SIZE)[None, :])
    tl.store(part.lse + token * part.stride_pl_t + head * part.stride_pl_h + split * part.stride_pl_s, lse,
             mask=row_ok)
