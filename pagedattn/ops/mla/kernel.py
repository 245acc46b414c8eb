"""Multi-head latent attention (DeepSeek-V2/V3, "absorbed" form) over a paged latent cache.

Every query head attends to the same cached row ``[c_kv (LATENT_DIM) | k_pe (ROPE_DIM)]``:
``s = scale * (q_nope . c_kv + q_pe . k_pe)`` and ``out = softmax(s) c_kv``. Since the latent is
shared, a program packs BLOCK_H heads of BLOCK_Q query tokens of one sequence into the M
dimension of both dots (BLOCK_M = BLOCK_Q * BLOCK_H rows) and loads each latent tile
``[TILE_N, LATENT_DIM + ROPE_DIM]`` once per step, using it as K^T in the score dot and (its
value columns) as V in the output dot. A ``[BLOCK_M, 512]`` fp32 accumulator does not fit in
registers next to everything else, so VALUE_SPLIT programs share one row block, each keeping
``512 / VALUE_SPLIT`` output columns (the score is computed by each of them; the latent tile
comes from L2 for all but the first).

Programs are numbered value part fastest, then head group, then split, then Q block, so the
programs that read the same pages run side by side and all but the first find the pages in
L2. See https://arxiv.org/abs/2405.04434 (DeepSeek-V2, appendix on absorbing the
up-projections).
"""

import triton
import triton.language as tl

from pagedattn.ops.common.attention_math import (
    LOG2E,
    finalize_softmax,
    nonfinite_to_nan,
    online_softmax_step,
    online_softmax_step_finite,
    round_to_fp8e4m3,
)
from pagedattn.ops.common.program import (
    chunk_keys,
    chunk_pages,
    chunk_pages_in_cache,
    find_q_block,
    load_page_chunk,
    page_of_keys,
    page_of_tile_keys,
)

# Block ids a program reads at once: about 2048 keys' pages (128 ids at 16-token pages), so that a
# B=32 L=4096 segment (2048 keys) is one chunk. Each chunk is its own pair of pipelined tile loops.
CHUNK_TARGET_KEYS = 2048


@triton.constexpr_function
def _pages_per_chunk(page_size, tile_n):
    return chunk_pages(page_size, tile_n, CHUNK_TARGET_KEYS)


@triton.constexpr_function
def _keys_per_chunk(page_size, tile_n):
    """Keys per block-table chunk (whole tiles). Tiles of whole pages start on page boundaries
    (segments start at multiples of the tile), so then every id of the chunk is used."""
    if tile_n % page_size == 0:
        return chunk_pages(page_size, tile_n, CHUNK_TARGET_KEYS) * page_size
    return chunk_keys(page_size, tile_n, CHUNK_TARGET_KEYS)


@triton.jit
def _locate_q_block(query_start_loc_ptr, seq_lens_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """(seq, q_start, q_len, q_block_local, seq_len, valid) of global Q block ``q_block_idx``.

    ``find_q_block`` (shared with the paged kernels): sequence s owns the Q blocks from
    ``query_start_loc[s] // BLOCK_Q + s`` on, or from ``query_start_loc[s]`` when BLOCK_Q is 1
    (one block per token, no room needed for a partial block).
    """
    seq, q_start, q_len, seq_len, q_block_local, found = find_q_block(
        query_start_loc_ptr, seq_lens_ptr, q_block_idx, num_seqs, BLOCK_Q, BLOCK_Q > 1
    )
    valid = found & (q_block_local >= 0) & (q_block_local * BLOCK_Q < q_len)
    return seq, q_start, q_len, q_block_local, seq_len, valid


@triton.jit
def _load_tile(ptr, rows, rows_ok, col0, offs_c, DIM: tl.constexpr, EXACT: tl.constexpr):
    """[R, C] tile: row r reads ``ptr + rows[r] + col0 + offs_c``; masked rows read 0.

    With ``EXACT`` (the padded width equals DIM) the mask depends on the row only, so it is
    constant along a row and the load stays vectorized.
    """
    cols = col0 + offs_c
    if EXACT:
        mask = rows_ok[:, None]
    else:
        mask = rows_ok[:, None] & (cols < DIM)[None, :]
    return tl.load(ptr + rows[:, None] + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _load_rows(ptr, rows, rows_ok, col0, offs_c, DIM: tl.constexpr, EXACT: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """``_load_tile``, with the row mask only when CHECK_ROWS (without it every row is read)."""
    if CHECK_ROWS:
        return _load_tile(ptr, rows, rows_ok, col0, offs_c, DIM, EXACT)
    cols = col0 + offs_c
    if EXACT:
        return tl.load(ptr + rows[:, None] + cols[None, :])
    return tl.load(ptr + rows[:, None] + cols[None, :], mask=(cols < DIM)[None, :], other=0.0)


@triton.jit
def _load_q_chunks(q_nope_ptr, qn_rows, row_ok, value_part, offs_v, VALUE_BLOCK: tl.constexpr, CFG: tl.constexpr):
    """The program's VALUE_SPLIT column chunks of q_nope [BLOCK_M, VALUE_BLOCK], its own (columns
    from ``value_part * VALUE_BLOCK``) first, and the first columns of the others; the chunks
    past VALUE_SPLIT repeat the first (never read)."""
    EXACT: tl.constexpr = CFG.LATENT_PAD == CFG.LATENT_DIM
    q0 = _load_tile(q_nope_ptr, qn_rows, row_ok, value_part * VALUE_BLOCK, offs_v, CFG.LATENT_DIM, EXACT)
    q1 = q0
    q2 = q0
    q3 = q0
    col1 = value_part * VALUE_BLOCK
    col2 = col1
    col3 = col1
    if CFG.VALUE_SPLIT > 1:
        col1 = ((value_part + 1) % CFG.VALUE_SPLIT) * VALUE_BLOCK
        q1 = _load_tile(q_nope_ptr, qn_rows, row_ok, col1, offs_v, CFG.LATENT_DIM, EXACT)
    if CFG.VALUE_SPLIT > 2:
        col2 = ((value_part + 2) % CFG.VALUE_SPLIT) * VALUE_BLOCK
        col3 = ((value_part + 3) % CFG.VALUE_SPLIT) * VALUE_BLOCK
        q2 = _load_tile(q_nope_ptr, qn_rows, row_ok, col2, offs_v, CFG.LATENT_DIM, EXACT)
        q3 = _load_tile(q_nope_ptr, qn_rows, row_ok, col3, offs_v, CFG.LATENT_DIM, EXACT)
    return q0, q1, q2, q3, col1, col2, col3


@triton.jit
def _program_coords(num_heads, num_splits, VALUE_SPLIT: tl.constexpr, BLOCK_H: tl.constexpr):
    """(value part, head group, split, global Q block) of this program: value part fastest, then
    head group, then split, so the programs that read the same pages run side by side."""
    pid = tl.program_id(0)
    value_part = pid % VALUE_SPLIT
    rest = pid // VALUE_SPLIT
    num_head_groups = tl.cdiv(num_heads, BLOCK_H)
    head_group = rest % num_head_groups
    rest = rest // num_head_groups
    return value_part, head_group, rest % num_splits, rest // num_splits


@triton.jit
def _tile_rows(pages, first_page, start, k_pos, slot, seg_hi, num_blocks, st, CFG: tl.constexpr):
    """(cache row offset, key ok) of the tile's keys ``k_pos`` from ``start``.

    Keys past the segment or the table row (id -1), and bad block ids, are not ok: the checked
    loop masks them and never dereferences their rows. Tiles of whole pages (``slot``: each key's
    offset in its page, computed once) gather one id per page, broadcast to the page's keys.
    """
    if CFG.TILE_N % CFG.PAGE_SIZE == 0:
        page = page_of_tile_keys(pages, first_page, start, CFG.PAGE_SIZE, CFG.TILE_N)
        in_page = slot
    else:
        page = page_of_keys(pages, first_page, k_pos, CFG.PAGE_SIZE)
        in_page = k_pos % CFG.PAGE_SIZE
        if CFG.LARGE_CACHE:
            in_page = in_page.to(tl.int64)
        in_page = in_page * st.stride_c_s
    k_ok = (k_pos < seg_hi) & (page >= 0) & (page < num_blocks)
    if CFG.LARGE_CACHE:
        page = page.to(tl.int64)
    return page * st.stride_c_b + in_page, k_ok  # [TILE_N]; int64 for a large cache


@triton.jit
def _softmax_tile(m_i, l_i, x, k_pos, q_pos, seg_hi, row_ok, CHECKED: tl.constexpr, BLOCK_Q: tl.constexpr):
    """``online_softmax_step`` on the base-2 scores ``x`` [BLOCK_M, TILE_N] with only the masks
    the tile needs."""
    if CHECKED:
        # Keys with a bad block id read zeros and stay in the softmax (score 0) instead of
        # being dropped: only a corrupt sequence's output changes and it stays finite.
        vis = (k_pos[None, :] <= q_pos[:, None]) & (k_pos < seg_hi)[None, :] & row_ok[:, None]
        return online_softmax_step(m_i, l_i, tl.where(vis, x, float("-inf")), 1.0)
    elif BLOCK_Q > 1:  # whole tiles inside the segment: only the causal rule and the rows
        vis = (k_pos[None, :] <= q_pos[:, None]) & row_ok[:, None]
        return online_softmax_step(m_i, l_i, tl.where(vis, x, float("-inf")), 1.0)
    else:  # one query token: every key below seg_hi <= q_pos + 1 is visible to every row
        return online_softmax_step_finite(m_i, l_i, x, 1.0)


@triton.jit
def _store_split(out_ptr, lse_ptr, out, lse, token, head, split, row_ok, cols, value_part, st,
                 LATENT_DIM: tl.constexpr):
    """Store the program's output columns ``cols`` of its rows, and their lse from value part 0
    (every value part computes the same lse), at split ``split`` (0 when unsplit)."""
    split64 = split.to(tl.int64)
    o_rows = token * st.stride_o_t + head * st.stride_o_h + split64 * st.stride_o_s
    o_mask = row_ok[:, None] & (cols < LATENT_DIM)[None, :]
    tl.store(out_ptr + o_rows[:, None] + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=o_mask)
    if lse_ptr is not None:
        first_part = (head * 0 + value_part) == 0  # (interpreter: no scalar & vector)
        tl.store(lse_ptr + token * st.stride_lse_t + head * st.stride_lse_h + split64 * st.stride_lse_s, lse,
                 mask=row_ok & first_part)


@triton.jit
def _tile_scores(kv_cache_ptr, rope_ptr, row, k_ok, q0, q1, q2, q3, q_pe, col0, col1, col2, col3, offs_v, offs_r,
                 FP8: tl.constexpr, CHECK: tl.constexpr, CFG: tl.constexpr):
    """(scores [BLOCK_M, TILE_N], the tile's first latent chunk) of one key tile: the latent row's
    VALUE_SPLIT column chunks (``col0`` first, which is also V of the output dot) and the rope
    columns, each loaded and fed to its dot before the next is loaded. An fp8 chunk is converted
    to q's dtype, exactly (every e4m3 value is an fp16 / bf16 / fp32 value); its scale is applied
    to the scores by the caller."""
    LATENT_EXACT: tl.constexpr = CFG.LATENT_PAD == CFG.LATENT_DIM
    ROPE_EXACT: tl.constexpr = CFG.ROPE_PAD == CFG.ROPE_DIM
    kv0 = _load_rows(kv_cache_ptr, row, k_ok, col0, offs_v, CFG.LATENT_DIM, LATENT_EXACT, CHECK)
    k_pe = _load_rows(rope_ptr, row, k_ok, 0, offs_r, CFG.ROPE_DIM, ROPE_EXACT, CHECK)  # [TILE_N, ROPE_PAD]
    if FP8:
        kv0 = kv0.to(q0.dtype)
        k_pe = k_pe.to(q0.dtype)
    s = tl.dot(q0, tl.trans(kv0), input_precision=CFG.DOT_PRECISION)
    if CFG.VALUE_SPLIT > 1:
        kv1 = _load_rows(kv_cache_ptr, row, k_ok, col1, offs_v, CFG.LATENT_DIM, LATENT_EXACT, CHECK)
        if FP8:
            kv1 = kv1.to(q0.dtype)
        s = tl.dot(q1, tl.trans(kv1), acc=s, input_precision=CFG.DOT_PRECISION)
    if CFG.VALUE_SPLIT > 2:
        kv2 = _load_rows(kv_cache_ptr, row, k_ok, col2, offs_v, CFG.LATENT_DIM, LATENT_EXACT, CHECK)
        kv3 = _load_rows(kv_cache_ptr, row, k_ok, col3, offs_v, CFG.LATENT_DIM, LATENT_EXACT, CHECK)
        if FP8:
            kv2 = kv2.to(q0.dtype)
            kv3 = kv3.to(q0.dtype)
        s = tl.dot(q2, tl.trans(kv2), acc=s, input_precision=CFG.DOT_PRECISION)
        s = tl.dot(q3, tl.trans(kv3), acc=s, input_precision=CFG.DOT_PRECISION)
    s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=CFG.DOT_PRECISION)
    return nonfinite_to_nan(s), kv0  # an inf key's -inf score must not read as masked


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_blocks", "max_blocks_per_seq", "num_splits"])
def mla_decode_kernel(
    out_ptr,  # [num_tokens, num_heads, LATENT_DIM] (q's dtype), or partials [.., num_splits, LATENT_DIM] fp32
    lse_ptr,  # [num_tokens, num_heads] or partials [num_tokens, num_heads, num_splits] fp32, or None
    q_nope_ptr, q_pe_ptr,  # [num_tokens, num_heads, LATENT_DIM], [num_tokens, num_heads, ROPE_DIM]
    kv_cache_ptr,  # [num_blocks, block_size, LATENT_DIM + ROPE_DIM]
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr,  # [num_seqs, max_blocks_per_seq], [num_seqs], [num_seqs + 1]
    kv_scale_ptr,  # [1] fp32 for an fp8 cache, else None
    st,  # MLAStrides: the strides of all of the above
    scale, num_heads, num_seqs, num_tokens, num_blocks, max_blocks_per_seq, num_splits,
    CFG: tl.constexpr,  # MLAConstants
):
    """(out, lse) of softmax(scale * (q_nope c_kv^T + q_pe k_pe^T) + causal) c_kv over one key split.

    The program owns output columns ``[v * VALUE_BLOCK, (v + 1) * VALUE_BLOCK)`` of its rows
    (``VALUE_BLOCK = LATENT_PAD / VALUE_SPLIT``, v = its value part) and still computes the full
    576-wide scores. The latent row is loaded as VALUE_SPLIT column chunks, its own chunk first:
    every chunk feeds the score dot and the first is also V of the output dot, so nothing is
    loaded twice and no elementwise op sits between a bf16/fp16 load and its dot.

    The tensors are separate parameters in the order of the unbundled kernel, which ptxas compiles to
    the same code (bundles that group each tensor with its strides changed its spills); their strides
    travel as one bundle and the compile-time shape as the constexpr CFG (``pagedattn.ops.mla.launch``).

    Cache offsets are int32 unless LARGE_CACHE (2**31 elements or more): 64-bit row offsets
    cost registers that the accumulator needs.

    With one split, out/lse are the final output; with several, split ``i`` writes partial
    (out, lse) at ``stride_o_s * i`` for the ordered merge. For an fp8 cache the scale
    multiplies the scores and the output, not the loaded tile.
    """
    BLOCK_M: tl.constexpr = CFG.BLOCK_M
    FP8: tl.constexpr = kv_scale_ptr is not None
    VALUE_BLOCK: tl.constexpr = CFG.LATENT_PAD // CFG.VALUE_SPLIT
    ROPE_EXACT: tl.constexpr = CFG.ROPE_PAD == CFG.ROPE_DIM
    if CFG.USE_PDL:  # the merge kernel may launch now; it waits for this grid in the kernel
        tl.extra.cuda.gdc_launch_dependents()
    value_part, head_group, split, q_block = _program_coords(num_heads, num_splits, CFG.VALUE_SPLIT, CFG.BLOCK_H)
    seq, q_start, q_len, q_block_local, seq_len, valid = _locate_q_block(
        query_start_loc_ptr, seq_lens_ptr, q_block, num_seqs, CFG.BLOCK_Q
    )
    if not valid:
        return

    # rows: BLOCK_Q tokens x BLOCK_H heads, token-major
    offs_m = tl.arange(0, BLOCK_M)
    q_tok = q_block_local * CFG.BLOCK_Q + offs_m // CFG.BLOCK_H  # within the sequence
    head = (head_group * CFG.BLOCK_H + offs_m % CFG.BLOCK_H).to(tl.int64)
    token = (q_start + q_tok).to(tl.int64)
    row_ok = (q_tok < q_len) & (head < num_heads) & (token >= 0) & (token < num_tokens)
    q_pos = seq_len - q_len + q_tok

    # causal: the block's last row sees keys [0, kv_hi); this split takes whole tiles of them
    kv_hi = tl.maximum(seq_len - q_len + tl.minimum((q_block_local + 1) * CFG.BLOCK_Q, q_len), 0)
    tiles_per_split = tl.cdiv(tl.cdiv(kv_hi, CFG.TILE_N), num_splits)
    seg_lo = split * tiles_per_split * CFG.TILE_N
    seg_hi = tl.minimum(seg_lo + tiles_per_split * CFG.TILE_N, kv_hi)

    # column chunks of the latent, this program's value chunk first
    offs_v = tl.arange(0, VALUE_BLOCK)
    offs_r = tl.arange(0, CFG.ROPE_PAD)
    col0 = value_part * VALUE_BLOCK
    q0, q1, q2, q3, col1, col2, col3 = _load_q_chunks(q_nope_ptr, token * st.stride_qn_t + head * st.stride_qn_h,
                                                      row_ok, value_part, offs_v, VALUE_BLOCK, CFG)
    q_pe = _load_tile(q_pe_ptr, token * st.stride_qp_t + head * st.stride_qp_h, row_ok, 0, offs_r, CFG.ROPE_DIM, ROPE_EXACT)
    qk_scale = scale * LOG2E
    kv_scale = 1.0
    if FP8:
        kv_scale = tl.load(kv_scale_ptr)
        qk_scale = qk_scale * kv_scale

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, VALUE_BLOCK], dtype=tl.float32)
    block_row_ptr = block_table_ptr + seq.to(tl.int64) * st.stride_bt_s
    offs_n = tl.arange(0, CFG.TILE_N)
    rope_ptr = kv_cache_ptr + CFG.LATENT_DIM
    # The block table is read a chunk of ids at a time (``load_page_chunk``), outside the tile
    # loops: a tile's K/V addresses then depend on no load of the same step and the pipeliner
    # issues them num_stages - 1 tiles ahead. A chunk's ids are checked at once
    # (``chunk_pages_in_cache``): the whole tiles of a chunk whose ids all lie in [0, num_blocks)
    # run without per-key checks (loop 0); a chunk holding an id outside the cache or the table
    # row, and the segment's last partial tile, run the checked loop (loop 1). The two loops run
    # in sequence, one of them usually empty: as two branches of an if, each would get its own
    # shared-memory pipeline buffers (as measured on the prefill kernel).
    CHUNK_PAGES: tl.constexpr = _pages_per_chunk(CFG.PAGE_SIZE, CFG.TILE_N)
    CHUNK_KEYS: tl.constexpr = _keys_per_chunk(CFG.PAGE_SIZE, CFG.TILE_N)
    # Tiles of whole pages (TILE_N a multiple of the page; tiles start at multiples of TILE_N): a
    # key's slot in its page is the same in every tile, computed once here (``_tile_rows``).
    if CFG.LARGE_CACHE:
        slot = (offs_n % CFG.PAGE_SIZE).to(tl.int64) * st.stride_c_s
    else:
        slot = (offs_n % CFG.PAGE_SIZE) * st.stride_c_s
    for chunk_lo in range(seg_lo, seg_hi, CHUNK_KEYS):
        chunk_hi = tl.minimum(chunk_lo + CHUNK_KEYS, seg_hi)
        first_page, pages = load_page_chunk(block_row_ptr, chunk_lo, max_blocks_per_seq, CFG.PAGE_SIZE, CHUNK_PAGES)
        clean = chunk_pages_in_cache(pages, first_page, chunk_hi, num_blocks, CFG.PAGE_SIZE)
        full_hi = tl.where(clean, chunk_lo + (chunk_hi - chunk_lo) // CFG.TILE_N * CFG.TILE_N, chunk_lo)
        for loop in tl.static_range(2):
            if loop == 0:  # whole tiles, every id in the cache: no per-key check, no load mask
                tile_lo = chunk_lo
                tile_hi = full_hi
            else:  # checked: a chunk with a bad id, or the segment's last partial tile
                tile_lo = full_hi
                tile_hi = chunk_hi
            for start in range(tile_lo, tile_hi, CFG.TILE_N):
                k_pos = start + offs_n  # [TILE_N]
                row, k_ok = _tile_rows(pages, first_page, start, k_pos, slot, seg_hi, num_blocks, st, CFG)
                CHECK: tl.constexpr = loop == 1
                s, kv0 = _tile_scores(kv_cache_ptr, rope_ptr, row, k_ok, q0, q1, q2, q3, q_pe, col0, col1, col2,
                                      col3, offs_v, offs_r, FP8=FP8, CHECK=CHECK, CFG=CFG)
                p, alpha, m_i, l_i = _softmax_tile(m_i, l_i, s * qk_scale, k_pos, q_pos, seg_hi, row_ok,
                                                   CHECKED=CHECK, BLOCK_Q=CFG.BLOCK_Q)
                acc = tl.dot(p.to(kv0.dtype), kv0, acc=acc * alpha[:, None], input_precision=CFG.DOT_PRECISION)

    out, lse = finalize_softmax(acc, m_i, l_i)
    if FP8:
        out = out * kv_scale
    _store_split(out_ptr, lse_ptr, out, lse, token, head, split, row_ok, col0 + offs_v, value_part, st,
                 LATENT_DIM=CFG.LATENT_DIM)


@triton.jit
def _store_latent_part(src_ptr, dst_ptr, kv_scale_ptr, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                       CACHE_FP8: tl.constexpr):
    offs = tl.arange(0, DIM_PAD)
    ok = offs < DIM
    x = tl.load(src_ptr + offs, mask=ok, other=0.0)
    if CACHE_FP8:
        x = round_to_fp8e4m3(x.to(tl.float32) / tl.load(kv_scale_ptr))
    tl.store(dst_ptr + offs, x.to(dst_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["num_slots"])
def write_mla_kv_kernel(
    c_kv_ptr,  # [num_tokens, LATENT_DIM]
    k_pe_ptr,  # [num_tokens, ROPE_DIM]
    kv_cache_ptr,  # [num_blocks, block_size, LATENT_DIM + ROPE_DIM]
    slot_mapping_ptr,  # [num_tokens] int32 or int64; -1 = skip
    kv_scale_ptr,  # [1] fp32 for an fp8 cache, else None
    st,  # MLAWriteStrides (pagedattn.ops.mla.launch)
    num_slots,
    CFG: tl.constexpr,  # MLAWriteConstants
):
    """kv_cache[slot // PAGE_SIZE, slot % PAGE_SIZE] = [c_kv[t] | k_pe[t]] (divided by kv_scale for fp8).

    Slots outside [0, num_slots) (-1 marks padding) are skipped.
    """
    CACHE_FP8: tl.constexpr = kv_scale_ptr is not None
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    dst = kv_cache_ptr + (slot // CFG.PAGE_SIZE) * st.stride_c_b + (slot % CFG.PAGE_SIZE) * st.stride_c_s
    _store_latent_part(c_kv_ptr + token * st.stride_ckv_t, dst, kv_scale_ptr, CFG.LATENT_DIM, CFG.LATENT_PAD,
                       CACHE_FP8)
    _store_latent_part(k_pe_ptr + token * st.stride_kpe_t, dst + CFG.LATENT_DIM, kv_scale_ptr, CFG.ROPE_DIM,
                       CFG.ROPE_PAD, CACHE_FP8)
