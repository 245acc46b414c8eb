"""Large-tile attention for long queries (prefill, extend): one program per (Q tile, q head, sequence).

FlashAttention-2 structure: a BLOCK_M-row tile of one head's queries stays in registers while
BLOCK_N-key tiles stream past; the key range is cut into a mask-free middle (every key visible
to every row: no masking work) and masked edges (the causal diagonal, the window's far edge,
the sequence end). K/V come either from contiguous tensors (``varlen_attention``: sequence s
owns rows ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``) or from the paged cache (PAGED, through the
block table, with out-of-cache ids dropped as in the other paths). Sequences with fewer than
``min_q_len`` queries are left to the Q-block kernels.
"""

import triton
import triton.language as tl

from pagedattn.ops.common.attention_math import (
    causal_window_mask,
    finalize_softmax,
    online_softmax_step,
    online_softmax_step_finite,
    scores_log2,
    LOG2E,
)
from pagedattn.ops.common.offsets import needs_int64_offsets
from pagedattn.ops.common.program import (
    chunk_keys,
    chunk_pages,
    chunk_pages_in_cache,
    init_softmax_state,
    load_page_chunk,
    page_of_keys,
    page_of_tile_keys,
    prefix_visible,
    visible_kv_bounds,
)


# Block ids a paged program reads at once: about 2048 keys' pages (at most 256 ids). Each chunk
# is its own pipelined tile loop; 8192- and 32768-key chunks measured the same (experiment 20).
CHUNK_TARGET_KEYS = 2048


@triton.constexpr_function
def _pages_per_chunk(page_size, block_n):
    return chunk_pages(page_size, block_n, CHUNK_TARGET_KEYS)


@triton.constexpr_function
def _keys_per_chunk(paged, page_size, block_n):
    """Keys per block-table chunk; contiguous K/V: one chunk."""
    if not paged:
        return 2**30
    return chunk_keys(page_size, block_n, CHUNK_TARGET_KEYS)


@triton.jit
def _attend_tile(
    q, k, v, m_i, l_i, acc, q_pos, k_pos, key_ok, row_ok, slope, k_scale, v_scale, prefix_ranges_ptr,
    seq, stride_pr_s, stride_pr_r, num_prefix_ranges, scale, softcap, sliding_window,
    IS_CAUSAL: tl.constexpr, USE_SOFTCAP: tl.constexpr, ALIBI_MODE: tl.constexpr, RAW_SCORES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PREFIX: tl.constexpr, KV_FP8: tl.constexpr, MASKED: tl.constexpr, CHECK_KEYS: tl.constexpr,
):
    """One online-softmax step over a loaded K tile [HEAD_SIZE_PAD, BLOCK_N] and V tile.

    MASKED evaluates the visibility rules (and drops keys outside key_ok and rows outside row_ok);
    CHECK_KEYS alone drops keys outside key_ok; neither: every key is visible to every row.
    """
    if KV_FP8:
        k = (k.to(tl.float32) * k_scale).to(q.dtype)
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
    qk = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    if RAW_SCORES:  # scores c * qk, never formed (online_softmax_step): 64 fewer multiplies a tile (experiment 30)
        x = qk
        c = scale * LOG2E
    else:
        x = scores_log2(qk, scale, q_pos, k_pos, softcap, slope, USE_SOFTCAP, ALIBI_MODE)
        c = 1.0
    if MASKED:
        vis = causal_window_mask(q_pos, k_pos, sliding_window, IS_CAUSAL)
        if USE_PREFIX:
            vis = vis | prefix_visible(prefix_ranges_ptr, seq, stride_pr_s, stride_pr_r, num_prefix_ranges,
                                       q_pos, k_pos)
        vis = vis & key_ok[None, :] & row_ok[:, None]
        p, alpha, m_i, l_i = online_softmax_step(m_i, l_i, tl.where(vis, x, float("-inf")), c)
    elif CHECK_KEYS:
        p, alpha, m_i, l_i = online_softmax_step(m_i, l_i, tl.where(key_ok[None, :], x, float("-inf")), c)
    else:  # every key of the tile is visible to every row
        p, alpha, m_i, l_i = online_softmax_step_finite(m_i, l_i, x, c)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _tile_loop(
    q, m_i, l_i, acc, q_pos, row_ok, slope, k_scale, v_scale,
    k_ptr, v_ptr, pages, first_page, k_row_start, prefix_ranges_ptr,
    seq, kv_head, tile_lo, tile_hi, kv_lo, kv_hi, num_blocks,
    stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
    stride_pr_s, stride_pr_r, num_prefix_ranges, scale, softcap, sliding_window,
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_PAD: tl.constexpr, HEAD_SIZE_V: tl.constexpr, HEAD_SIZE_V_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, USE_SOFTCAP: tl.constexpr, ALIBI_MODE: tl.constexpr, RAW_SCORES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PREFIX: tl.constexpr, KV_FP8: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
    CHECK_PAGES: tl.constexpr, LARGE_CACHE: tl.constexpr,
):
    """Online softmax over the key tiles tile_lo, tile_lo + BLOCK_N, ... < tile_hi, loaded through
    per-key pointers (the contiguous TMA path is ``_tile_loop_tma``).

    MASKED=False is for tiles whose keys are all visible to all rows: no rule is evaluated.
    PAGED: key k's block id comes from ``pages`` (the chunk's ids from page ``first_page``);
    CHECK_PAGES masks keys whose id lies outside the cache (never dereferenced), and is off for
    chunks whose ids were all checked at once (``chunk_pages_in_cache``).
    LARGE_CACHE: K/V element offsets in int64 (a K or V tensor spans 2**31 elements or more);
    otherwise int32, 57 fewer instructions a tile at 128x128 and 7% faster (experiment 29).
    """
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    offs_dv = tl.arange(0, HEAD_SIZE_V_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    dim_ok = offs_d < HEAD_SIZE
    dim_v_ok = offs_dv < HEAD_SIZE_V
    OFF: tl.constexpr = tl.int64 if LARGE_CACHE else tl.int32
    # Tiles of whole pages (tile_lo is a multiple of BLOCK_N): a key's slot in its page is the same
    # in every tile (computed once here), and a tile's block ids are gathered once per page and
    # broadcast to the page's keys. Against per-key page and slot math: -21% at S=8192 (experiment 20).
    PAGE_ALIGNED: tl.constexpr = PAGED and BLOCK_N % PAGE_SIZE == 0
    slot_k = (offs_n % PAGE_SIZE).to(OFF) * stride_k_s + kv_head * stride_k_h
    slot_v = (offs_n % PAGE_SIZE).to(OFF) * stride_v_s + kv_head * stride_v_h
    for start in range(tile_lo, tile_hi, BLOCK_N):
        k_pos = start + offs_n
        key_ok = (k_pos >= kv_lo) & (k_pos < kv_hi)
        if PAGE_ALIGNED:
            page = page_of_tile_keys(pages, first_page, start, PAGE_SIZE, BLOCK_N)
            if CHECK_PAGES:
                key_ok = key_ok & (page >= 0) & (page < num_blocks)
            k_off = page.to(OFF) * stride_k_b + slot_k
            v_off = page.to(OFF) * stride_v_b + slot_v
        elif PAGED:
            page = page_of_keys(pages, first_page, k_pos, PAGE_SIZE).to(OFF)
            if CHECK_PAGES:
                key_ok = key_ok & (page >= 0) & (page < num_blocks)
            in_page = (k_pos % PAGE_SIZE).to(OFF)
            k_off = page * stride_k_b + in_page * stride_k_s + kv_head * stride_k_h
            v_off = page * stride_v_b + in_page * stride_v_s + kv_head * stride_v_h
        else:
            row = (k_row_start + k_pos).to(OFF)
            k_off = row * stride_k_s + kv_head * stride_k_h
            v_off = row * stride_v_s + kv_head * stride_v_h
        if MASKED or CHECK_PAGES:
            k = tl.load(k_ptr + k_off[None, :] + offs_d[:, None], mask=dim_ok[:, None] & key_ok[None, :], other=0.0)
            v = tl.load(v_ptr + v_off[:, None] + offs_dv[None, :], mask=key_ok[:, None] & dim_v_ok[None, :],
                        other=0.0)
        else:
            k = tl.load(k_ptr + k_off[None, :] + offs_d[:, None], mask=dim_ok[:, None], other=0.0)
            v = tl.load(v_ptr + v_off[:, None] + offs_dv[None, :], mask=dim_v_ok[None, :], other=0.0)
        m_i, l_i, acc = _attend_tile(
            q, k, v, m_i, l_i, acc, q_pos, k_pos, key_ok, row_ok, slope, k_scale, v_scale, prefix_ranges_ptr,
            seq, stride_pr_s, stride_pr_r, num_prefix_ranges, scale, softcap, sliding_window,
            IS_CAUSAL, USE_SOFTCAP, ALIBI_MODE, RAW_SCORES, DOT_PRECISION, USE_PREFIX, KV_FP8, MASKED, CHECK_PAGES,
        )
    return m_i, l_i, acc


@triton.jit
def _tile_loop_tma(
    q, m_i, l_i, acc, q_pos, row_ok, slope, k_scale, v_scale, k_desc, v_desc, k_row_start, prefix_ranges_ptr,
    seq, kv_head, tile_lo, tile_hi, kv_lo, kv_hi,
    stride_pr_s, stride_pr_r, num_prefix_ranges, scale, softcap, sliding_window,
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_V: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, USE_SOFTCAP: tl.constexpr, ALIBI_MODE: tl.constexpr, RAW_SCORES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PREFIX: tl.constexpr, KV_FP8: tl.constexpr, MASKED: tl.constexpr,
):
    """``_tile_loop`` for contiguous K/V through tensor descriptors (sm90 TMA: no per-thread
    address tensors; 244 instead of 255 registers + spill at 128x128 tiles, experiment 18)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(tile_lo, tile_hi, BLOCK_N):
        k_pos = start + offs_n
        key_ok = (k_pos >= kv_lo) & (k_pos < kv_hi)
        # rows past the tensor read as 0; rows of the next sequence are masked below
        k = k_desc.load([k_row_start + start, kv_head * HEAD_SIZE]).T
        v = v_desc.load([k_row_start + start, kv_head * HEAD_SIZE_V])
        if MASKED:  # another sequence's rows: whatever they hold must not reach acc
            v = tl.where(key_ok[:, None], v, 0.0)
        m_i, l_i, acc = _attend_tile(
            q, k, v, m_i, l_i, acc, q_pos, k_pos, key_ok, row_ok, slope, k_scale, v_scale, prefix_ranges_ptr,
            seq, stride_pr_s, stride_pr_r, num_prefix_ranges, scale, softcap, sliding_window,
            IS_CAUSAL, USE_SOFTCAP, ALIBI_MODE, RAW_SCORES, DOT_PRECISION, USE_PREFIX, KV_FP8, MASKED, False,
        )
    return m_i, l_i, acc


@triton.jit
def _key_tiles(
    q, m_i, l_i, acc, q_pos, row_ok, slope, k_scale, v_scale,
    k_ptr, v_ptr, k_desc, v_desc, block_row_ptr, k_row_start, prefix_ranges_ptr,
    seq, kv_head, start_lo, start_hi, kv_lo, kv_hi, num_blocks, max_blocks_per_seq,
    stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
    stride_pr_s, stride_pr_r, num_prefix_ranges, scale, softcap, sliding_window,
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_PAD: tl.constexpr, HEAD_SIZE_V: tl.constexpr, HEAD_SIZE_V_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, USE_SOFTCAP: tl.constexpr, ALIBI_MODE: tl.constexpr, RAW_SCORES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PREFIX: tl.constexpr, KV_FP8: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
    USE_TMA: tl.constexpr, LARGE_CACHE: tl.constexpr,
):
    """The key tiles from start_lo to start_hi, a block-table chunk at a time when PAGED.

    A mask-free chunk whose block ids all lie in the cache runs without per-key checks; one
    with an id outside it (a caller's bug or padding) runs the checked loop, which drops those
    keys. The per-key checks cost 21% at S=8192 (experiment 20).
    """
    CHUNK_PAGES: tl.constexpr = _pages_per_chunk(PAGE_SIZE, BLOCK_N)
    CHUNK_KEYS: tl.constexpr = _keys_per_chunk(PAGED, PAGE_SIZE, BLOCK_N)
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
            first_page, pages = load_page_chunk(block_row_ptr, chunk_lo, max_blocks_per_seq, PAGE_SIZE, CHUNK_PAGES)
        if SPLIT_CHECKS:
            clean_hi = tl.where(chunk_pages_in_cache(pages, first_page, chunk_hi, num_blocks, PAGE_SIZE),
                                chunk_hi, chunk_lo)
        for loop in tl.static_range(LOOPS):
            tile_lo = chunk_lo
            tile_hi = chunk_hi
            if SPLIT_CHECKS:
                if loop == 0:
                    tile_hi = clean_hi
                else:
                    tile_lo = clean_hi
            if USE_TMA:
                m_i, l_i, acc = _tile_loop_tma(
                    q, m_i, l_i, acc, q_pos, row_ok, slope, k_scale, v_scale, k_desc, v_desc, k_row_start,
                    prefix_ranges_ptr, seq, kv_head, tile_lo, tile_hi, kv_lo, kv_hi,
                    stride_pr_s, stride_pr_r, num_prefix_ranges, scale, softcap, sliding_window,
                    HEAD_SIZE, HEAD_SIZE_V, BLOCK_N, IS_CAUSAL, USE_SOFTCAP, ALIBI_MODE, RAW_SCORES, DOT_PRECISION,
                    USE_PREFIX, KV_FP8, MASKED,
                )
            else:
                m_i, l_i, acc = _tile_loop(
                    q, m_i, l_i, acc, q_pos, row_ok, slope, k_scale, v_scale, k_ptr, v_ptr, pages,
                    first_page, k_row_start, prefix_ranges_ptr, seq, kv_head, tile_lo, tile_hi, kv_lo, kv_hi,
                    num_blocks, stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
                    stride_pr_s, stride_pr_r, num_prefix_ranges, scale, softcap, sliding_window,
                    HEAD_SIZE, HEAD_SIZE_PAD, HEAD_SIZE_V, HEAD_SIZE_V_PAD, PAGE_SIZE, BLOCK_N, IS_CAUSAL,
                    USE_SOFTCAP, ALIBI_MODE, RAW_SCORES, DOT_PRECISION, USE_PREFIX, KV_FP8, PAGED, MASKED,
                    PAGED and (loop == 1 or not SPLIT_CHECKS), LARGE_CACHE,  # the checked loop
                )
    return m_i, l_i, acc


@triton.heuristics(
    {
        "USE_SINKS": lambda args: args["sinks_ptr"] is not None,
        "USE_PREFIX": lambda args: args["prefix_ranges_ptr"] is not None,
        "KV_FP8": lambda args: args["k_scale_ptr"] is not None,
        "RETURN_LSE": lambda args: args["lse_ptr"] is not None,
        "PAGED": lambda args: args["block_table_ptr"] is not None,
        "USE_TMA": lambda args: args["k_desc"] is not None,
        "POSITIVE_SCALE": lambda args: args["scale"] > 0,
        "LARGE_CACHE": lambda args: needs_int64_offsets(args["k_ptr"], args["v_ptr"]),
    }
)
@triton.jit(do_not_specialize=[
    "num_tokens", "num_blocks", "max_blocks_per_seq", "num_prefix_ranges", "sliding_window", "min_q_len",
])
def prefill_attention_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_size_v]
    lse_ptr,  # [num_tokens, num_q_heads] fp32 or None
    q_ptr,  # [num_tokens, num_q_heads, head_size]
    k_ptr,  # paged: [num_blocks, block_size, num_kv_heads, head_size]; else [total_k, num_kv_heads, head_size]
    v_ptr,
    k_desc,  # contiguous K/V only: TensorDescriptor over [total_k, num_kv_heads * head_size], or None
    v_desc,
    block_table_ptr,  # [num_seqs, max_blocks_per_seq] int32, or None (contiguous K/V)
    kv_lens_ptr,  # paged: seq_lens [num_seqs]; contiguous: cu_seqlens_k [num_seqs + 1]
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    sinks_ptr, alibi_slopes_ptr, prefix_ranges_ptr, k_scale_ptr, v_scale_ptr,
    stride_q_t, stride_q_h,
    stride_o_t, stride_o_h,
    stride_lse_t, stride_lse_h,
    stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h,
    stride_bt_s,
    stride_pr_s, stride_pr_r,
    scale,
    softcap,
    sliding_window,
    num_tokens,
    num_blocks,
    max_blocks_per_seq,
    num_prefix_ranges,
    min_q_len,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,  # values may be narrower or wider than queries/keys (MLA prefill: 192 / 128)
    HEAD_SIZE_V_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    ALIBI_MODE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_PREFIX: tl.constexpr,
    KV_FP8: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    PAGED: tl.constexpr,
    USE_TMA: tl.constexpr,
    LARGE_CACHE: tl.constexpr,
    POSITIVE_SCALE: tl.constexpr,
):
    """out = softmax(mods(scale * q k^T) + mask) v for one BLOCK_M tile of one query head."""
    # Programs start in launch order, x fastest: every head's and sequence's heaviest Q tile (the
    # last rows under the causal mask), then every next one. Longest first across the whole grid
    # leaves the lightest tiles for the last wave (docs/perf-notes.md, experiment 25).
    head = tl.program_id(0)
    seq = tl.program_id(1)
    m_block = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if (q_len < min_q_len) | (m_block * BLOCK_M >= q_len):
        return
    if PAGED:
        kv_len = tl.load(kv_lens_ptr + seq)
        k_row_start = 0
    else:
        k_row_start = tl.load(kv_lens_ptr + seq)
        kv_len = tl.load(kv_lens_ptr + seq + 1) - k_row_start
    context_len = kv_len - q_len
    kv_head = head // NUM_QUERIES_PER_KV

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    token = (q_start + offs_m).to(tl.int64)
    row_ok = (offs_m < q_len) & (token >= 0) & (token < num_tokens)
    q_pos = context_len + offs_m
    dim_ok = offs_d < HEAD_SIZE
    q = tl.load(q_ptr + token[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    kv_lo, kv_hi = visible_kv_bounds(
        prefix_ranges_ptr, seq, stride_pr_s, stride_pr_r, num_prefix_ranges,
        kv_len, q_len, context_len, m_block, sliding_window, BLOCK_M, IS_CAUSAL, USE_PREFIX,
    )
    # Mask-free middle [full_lo, full_hi): whole tiles that every row of this tile sees.
    p_first = context_len + m_block * BLOCK_M
    p_last = tl.minimum(p_first + BLOCK_M, context_len + q_len) - 1
    free_lo = kv_lo
    free_hi = kv_hi
    if IS_CAUSAL:
        free_hi = tl.minimum(free_hi, p_first + 1)
    if sliding_window > 0:
        free_lo = tl.maximum(free_lo, p_last - sliding_window + 1)
        if not IS_CAUSAL:
            free_hi = tl.minimum(free_hi, p_first + sliding_window)
    free_lo = tl.maximum(free_lo, 0)
    full_lo = tl.cdiv(free_lo, BLOCK_N) * BLOCK_N
    full_hi = tl.maximum((free_hi // BLOCK_N) * BLOCK_N, full_lo)
    first_tile = (kv_lo // BLOCK_N) * BLOCK_N
    full_lo = tl.maximum(tl.minimum(full_lo, kv_hi), first_tile)
    full_hi = tl.maximum(tl.minimum(full_hi, kv_hi), full_lo)

    slope = 0.0
    if ALIBI_MODE != 0:
        slope = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(alibi_slopes_ptr + head)
    k_scale = 1.0
    v_scale = 1.0
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    heads = tl.zeros([BLOCK_M], dtype=tl.int32) + head
    m_i, l_i, acc = init_softmax_state(sinks_ptr, heads, row_ok, True, BLOCK_M, HEAD_SIZE_V_PAD, USE_SINKS)
    if PAGED:
        block_row = block_table_ptr + seq.to(tl.int64) * stride_bt_s
    else:
        block_row = block_table_ptr
    # Raw q.k into the softmax (scaled inside its multiply-add) on 64-row tiles only: 1.5-3% faster
    # there, 1-2% slower on 128-row tiles (session 7 runs B-C, experiment 30)
    RAW_SCORES: tl.constexpr = POSITIVE_SCALE and not USE_SOFTCAP and ALIBI_MODE == 0 and BLOCK_M <= 64

    m_i, l_i, acc = _key_tiles(
        q, m_i, l_i, acc, q_pos, row_ok, slope, k_scale, v_scale, k_ptr, v_ptr, k_desc, v_desc, block_row, k_row_start,
        prefix_ranges_ptr, seq, kv_head, first_tile, full_lo, kv_lo, kv_hi, num_blocks, max_blocks_per_seq,
        stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
        stride_pr_s, stride_pr_r, num_prefix_ranges, scale, softcap, sliding_window,
        HEAD_SIZE, HEAD_SIZE_PAD, HEAD_SIZE_V, HEAD_SIZE_V_PAD, PAGE_SIZE, BLOCK_N, IS_CAUSAL, USE_SOFTCAP, ALIBI_MODE,
        RAW_SCORES, DOT_PRECISION, USE_PREFIX, KV_FP8, PAGED, True, USE_TMA, LARGE_CACHE,
    )
    m_i, l_i, acc = _key_tiles(
        q, m_i, l_i, acc, q_pos, row_ok, slope, k_scale, v_scale, k_ptr, v_ptr, k_desc, v_desc, block_row, k_row_start,
        prefix_ranges_ptr, seq, kv_head, full_lo, full_hi, kv_lo, kv_hi, num_blocks, max_blocks_per_seq,
        stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
        stride_pr_s, stride_pr_r, num_prefix_ranges, scale, softcap, sliding_window,
        HEAD_SIZE, HEAD_SIZE_PAD, HEAD_SIZE_V, HEAD_SIZE_V_PAD, PAGE_SIZE, BLOCK_N, IS_CAUSAL, USE_SOFTCAP, ALIBI_MODE,
        RAW_SCORES, DOT_PRECISION, USE_PREFIX, KV_FP8, PAGED, False, USE_TMA, LARGE_CACHE,
    )
    m_i, l_i, acc = _key_tiles(
        q, m_i, l_i, acc, q_pos, row_ok, slope, k_scale, v_scale, k_ptr, v_ptr, k_desc, v_desc, block_row, k_row_start,
        prefix_ranges_ptr, seq, kv_head, full_hi, kv_hi, kv_lo, kv_hi, num_blocks, max_blocks_per_seq,
        stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
        stride_pr_s, stride_pr_r, num_prefix_ranges, scale, softcap, sliding_window,
        HEAD_SIZE, HEAD_SIZE_PAD, HEAD_SIZE_V, HEAD_SIZE_V_PAD, PAGE_SIZE, BLOCK_N, IS_CAUSAL, USE_SOFTCAP, ALIBI_MODE,
        RAW_SCORES, DOT_PRECISION, USE_PREFIX, KV_FP8, PAGED, True, USE_TMA, LARGE_CACHE,
    )
    out, lse = finalize_softmax(acc, m_i, l_i)
    offs_dv = tl.arange(0, HEAD_SIZE_V_PAD)
    tl.store(out_ptr + token[:, None] * stride_o_t + head * stride_o_h + offs_dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv < HEAD_SIZE_V)[None, :])
    if RETURN_LSE:
        tl.store(lse_ptr + token * stride_lse_t + head * stride_lse_h, lse, mask=row_ok)
