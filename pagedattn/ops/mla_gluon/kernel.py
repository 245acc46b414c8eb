"""MLA decode for Hopper (sm90) in Gluon: 64 heads of one token per CTA, wgmma, cp.async page gathers.

The "sync" variant of ``pagedattn.ops.mla_gluon.launch`` (no warp specialization; the default is
``kernel_ws.mla_decode_gluon_ws_kernel``, which shares this module's constants and helpers: the
grid cell, split rule, page gathers, query copy, softmax step, shared buffers and stores).

The same computation as ``pagedattn.ops.mla.kernel.mla_decode_kernel`` for one query token a
sequence, 512 latent + 64 rope columns and a 16-bit cache: ``s = scale * (q_nope . c_kv + q_pe .
k_pe)``, ``out = softmax(s) c_kv``, over one KV split, with the same partial (out, lse) layout
for ``launch_merge_splits``.

One CTA (8 warps = two warpgroups) owns BLOCK_M = 64 query rows (heads ``64 * head_group ..``
of one token; rows past num_heads read zeros and are not stored) and one key split. Shared
memory holds the queries ``[64, 512] + [64, 64]``, a NUM_STAGES ring of latent tiles ``[TILE_N,
512] + [TILE_N, 64]`` and the weights P ``[64, TILE_N]``. A step:

* ``S = Q_nope K_nope^T + Q_rope K_rope^T`` (wgmma, A and B from shared memory) in an MMA layout
  of warps ``[4, 2]``: each warpgroup computes TILE_N / 2 of the key columns (no score is
  computed twice); the row max reduces across both warpgroups every step, the row sum is kept
  unreduced (``l_acc``, ``[64, TILE_N]``) and reduced once after the loop.
* the online softmax in base 2 (the row max kept in base-2 units; lse in natural log at the end);
* P (16-bit) to shared memory, then ``O += P V`` with V the tile's 512 latent columns, O in an
  MMA layout of warps ``[4, 2]``: each warpgroup holds ``[64, 256]`` fp32 (128 registers a thread).

Synchronization (no mbarriers, no warp specialization: all 256 threads copy and compute):

* cp.async groups: the prologue commits the queries with tile 0, then tiles 1 .. NUM_STAGES - 2,
  one group each; every step commits exactly one group (empty past the last tile). At step i,
  ``wait_group(NUM_STAGES - 2)`` leaves tile i's group complete (for this thread's copies).
* cp.async writes through the generic proxy and wgmma reads through the async proxy: each
  thread fences (``fence_async_shared``) after its copies landed and after its P store, then a CTA
  barrier makes every thread's writes visible before any wgmma reads them.
* the barrier at the top of step i also proves that every warp finished step i - 1 (both wgmma
  of a step are waited for before the step ends), so the ring slot read in step i - 1 and the P
  buffer may then be overwritten: step i refills slot (i - 1) % NUM_STAGES with tile
  i + NUM_STAGES - 1, and stores its own P after its scores.
* the compiler adds CTA barriers of its own (after the cp.async wait, before the score wgmma, and
  in the cross-warpgroup row max): about six a step in all.

Keys past the split's end or the sequence, and block ids outside ``[0, num_blocks)`` (-1 for
unused table entries), are never dereferenced: their cp.async copies are masked, which
zero-fills the shared rows (stale values there could be NaN, and 0 * NaN is NaN in P V). Keys
past the end get score -inf; a key of a bad block id inside the sequence keeps score 0 with a
zero value, as in the portable kernel (a corrupt sequence stays finite).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from pagedattn.ops.common.gluon_math import LOG2E, finalize_rows, max_combine, sum_combine

LATENT_DIM = gl.constexpr(512)
ROPE_DIM = gl.constexpr(64)
BLOCK_M = gl.constexpr(64)  # rows (heads) of a CTA: the M of one warpgroup's wgmma
NUM_WARPS = gl.constexpr(8)


@gluon.jit
def _tile_pages(bt_row_ptr, tile_start, seg_hi, max_blocks_per_seq, offs_n, PAGE_SIZE: gl.constexpr):
    """The block id of each key ``tile_start + offs_n`` (-1 past ``seg_hi``; the warp-specialized
    kernel's copy warps load them a tile ahead, so that the block table's latency is spent
    while the ring slot drains)."""
    page_idx = (tile_start + offs_n) // PAGE_SIZE
    in_seg = (tile_start + offs_n) < seg_hi
    return gl.load(bt_row_ptr + page_idx, mask=in_seg & (page_idx < max_blocks_per_seq), other=-1)


@gluon.jit
def _tile_rows(page, tile_start, seg_hi, num_blocks, stride_c_b, stride_c_s, offs_n, PAGE_SIZE: gl.constexpr):
    """(64-bit element offset of each key's cache row, whether it may be read): keys past
    ``seg_hi`` and block ids outside ``[0, num_blocks)`` are not (offset 0, copy masked)."""
    k_pos = tile_start + offs_n
    ok = (k_pos < seg_hi) & (page >= 0) & (page < num_blocks)
    row = page.to(gl.int64) * stride_c_b + (k_pos % PAGE_SIZE).to(gl.int64) * stride_c_s
    return gl.where(ok, row, 0), ok


@gluon.jit
def _gather_tile(kn_buf, kr_buf, kv_cache_ptr, page, tile_start, seg_hi, num_blocks, stride_c_b, stride_c_s, offs_n,
                 offs_cn, offs_cr, PAGE_SIZE: gl.constexpr):
    """cp.async of keys ``tile_start + offs_n`` (latent and rope columns, block ids ``page``)
    into one ring slot; rows past ``seg_hi`` or of a block id outside the cache are masked
    (zero-filled, never read)."""
    row, ok = _tile_rows(page, tile_start, seg_hi, num_blocks, stride_c_b, stride_c_s, offs_n, PAGE_SIZE)
    cp.async_copy_global_to_shared(kn_buf, kv_cache_ptr + row[:, None] + offs_cn[None, :], mask=ok[:, None])
    cp.async_copy_global_to_shared(kr_buf, kv_cache_ptr + LATENT_DIM + row[:, None] + offs_cr[None, :],
                                   mask=ok[:, None])


@gluon.jit
def _issue_tile(kn_buf, kr_buf, kv_cache_ptr, bt_row_ptr, tile_start, seg_hi, num_blocks, max_blocks_per_seq,
                stride_c_b, stride_c_s, offs_n, offs_cn, offs_cr, PAGE_SIZE: gl.constexpr):
    """The block ids of keys ``tile_start + offs_n``, then their gather into one ring slot."""
    page = _tile_pages(bt_row_ptr, tile_start, seg_hi, max_blocks_per_seq, offs_n, PAGE_SIZE)
    _gather_tile(kn_buf, kr_buf, kv_cache_ptr, page, tile_start, seg_hi, num_blocks, stride_c_b, stride_c_s, offs_n,
                 offs_cn, offs_cr, PAGE_SIZE)


@gluon.jit
def _issue_queries(q_n_smem, q_r_smem, q_nope_ptr, q_pe_ptr, token, head0, num_heads, stride_qn_t, stride_qn_h,
                   stride_qp_t, stride_qp_h, offs_cn, offs_cr, row_cp: gl.constexpr):
    """cp.async of the queries of heads ``head0 ..`` (latent and rope columns, the copy layout's
    rows ``row_cp``); rows past num_heads are masked (zero-filled)."""
    head = (head0 + gl.arange(0, BLOCK_M, layout=row_cp)).to(gl.int64)
    head_ok = (head < num_heads)[:, None]
    qn_rows = token * stride_qn_t + head * stride_qn_h
    qp_rows = token * stride_qp_t + head * stride_qp_h
    cp.async_copy_global_to_shared(q_n_smem, q_nope_ptr + qn_rows[:, None] + offs_cn[None, :], mask=head_ok)
    cp.async_copy_global_to_shared(q_r_smem, q_pe_ptr + qp_rows[:, None] + offs_cr[None, :], mask=head_ok)


@gluon.jit
def _softmax_step(s, tile_start, offs_sn, seg_hi, qk_scale, m_i, l_acc):
    """One tile of the online softmax in base 2 on the raw scores ``s`` [BLOCK_M, TILE_N] of the
    keys from ``tile_start``: keys past ``seg_hi`` are masked, an inf dot product becomes NaN
    (never read as a masked key). Returns (p, alpha, m_i, l_acc); the row sums stay unreduced in
    ``l_acc``."""
    s = s + s * 0.0
    k_pos = tile_start + offs_sn
    x = gl.where((k_pos < seg_hi)[None, :], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.reduce(x, 1, max_combine))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(x - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_acc * alpha[:, None] + p


@gluon.jit
def _store_rows(out_ptr, out, token, head0, split64, num_heads, stride_o_t, stride_o_h, stride_o_s,
                COL0: gl.constexpr, o_l: gl.constexpr):
    """Store ``out`` [64, W] (layout ``o_l``) as columns ``COL0 .. COL0 + W`` of heads ``head0 ..``
    at split ``split64`` (stride 0 when the kernel writes the final output)."""
    o_head = (head0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_l))).to(gl.int64)
    o_cols = COL0 + gl.arange(0, out.shape[1], layout=gl.SliceLayout(0, o_l))
    o_rows = token * stride_o_t + o_head * stride_o_h + split64 * stride_o_s
    gl.store(out_ptr + o_rows[:, None] + o_cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(o_head < num_heads)[:, None])


@gluon.jit
def _store_split(out_ptr, lse_ptr, out, lse, token, head0, split64, num_heads, stride_o_t, stride_o_h, stride_o_s,
                 stride_lse_t, stride_lse_h, stride_lse_s, s_l: gl.constexpr, o_l: gl.constexpr):
    """Store the rows of heads ``head0 ..`` (out [64, W] in the output MMA's layout, as columns 0
    .. W; lse in the scores') at split ``split64`` (stride 0 when the kernel writes the final
    output)."""
    _store_rows(out_ptr, out, token, head0, split64, num_heads, stride_o_t, stride_o_h, stride_o_s, 0, o_l)
    if lse_ptr is not None:
        l_head = (head0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_l))).to(gl.int64)
        gl.store(lse_ptr + token * stride_lse_t + l_head * stride_lse_h + split64 * stride_lse_s, lse,
                 mask=l_head < num_heads)


@gluon.jit
def _cta_cell(query_start_loc_ptr, num_heads, num_splits):
    """(head group, split, sequence, query_start_loc[seq], query_start_loc[seq + 1]) of this CTA:
    the grid is sequences x splits x head groups of 64, the head group fastest."""
    pid = gl.program_id(0)
    num_head_groups = (num_heads + BLOCK_M - 1) // BLOCK_M
    head_group = pid % num_head_groups
    rest = pid // num_head_groups
    split = rest % num_splits
    seq = rest // num_splits
    q_start = gl.load(query_start_loc_ptr + seq)
    q_end = gl.load(query_start_loc_ptr + seq + 1)
    return head_group, split, seq, q_start, q_end


@gluon.jit
def _split_tiles(seq_len, split, num_splits, TILE_N: gl.constexpr):
    """(first key, end key, tiles) of this split: the token sits at position seq_len - 1 and sees
    keys [0, seq_len); each split takes the same count of whole tiles, the last one fewer."""
    kv_hi = gl.maximum(seq_len, 0)
    tiles_per_split = ((kv_hi + TILE_N - 1) // TILE_N + num_splits - 1) // num_splits
    seg_lo = split * tiles_per_split * TILE_N
    seg_hi = gl.minimum(seg_lo + tiles_per_split * TILE_N, kv_hi)
    return seg_lo, seg_hi, (gl.maximum(seg_hi - seg_lo, 0) + TILE_N - 1) // TILE_N


@gluon.jit
def _allocate_shared(dtype: gl.constexpr, TILE_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The kernel's shared memory, each buffer in the wgmma operand layout: the queries (latent
    and rope parts), the ring of NUM_STAGES latent tiles (both parts) and P."""
    q_n_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, LATENT_DIM],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_M, LATENT_DIM], dtype))
    q_r_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, ROPE_DIM],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_M, ROPE_DIM], dtype))
    kn_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, TILE_N, LATENT_DIM],
                                        gl.NVMMASharedLayout.get_default_for([TILE_N, LATENT_DIM], dtype))
    kr_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, TILE_N, ROPE_DIM],
                                        gl.NVMMASharedLayout.get_default_for([TILE_N, ROPE_DIM], dtype))
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, TILE_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, TILE_N], dtype))
    return q_n_smem, q_r_smem, kn_bufs, kr_bufs, p_smem


@gluon.jit(do_not_specialize=["num_seqs", "num_tokens", "num_blocks", "max_blocks_per_seq", "num_splits"])
def mla_decode_gluon_kernel(
    out_ptr,  # [num_tokens, num_heads, 512] (q's dtype), or partials [.., num_splits, 512] fp32
    lse_ptr,  # [num_tokens, num_heads] or partials [num_tokens, num_heads, num_splits] fp32, or None
    q_nope_ptr, q_pe_ptr,  # [num_tokens, num_heads, 512], [num_tokens, num_heads, 64]
    kv_cache_ptr,  # [num_blocks, PAGE_SIZE, 576]
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr,  # [num_seqs, max_blocks_per_seq], [num_seqs], [num_seqs + 1]
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
    stride_o_t, stride_o_h, stride_o_s,  # stride_o_s: 0 when the kernel writes the final output
    stride_lse_t, stride_lse_h, stride_lse_s,
    stride_c_b, stride_c_s, stride_bt_s,
    scale, num_heads, num_seqs, num_tokens, num_blocks, max_blocks_per_seq, num_splits,
    PAGE_SIZE: gl.constexpr, TILE_N: gl.constexpr, NUM_STAGES: gl.constexpr,
):
    """(out, lse) of softmax(scale * (q_nope c_kv^T + q_pe k_pe^T)) c_kv over one key split of one
    token's sequence, for 64 of its heads (see the module docstring)."""
    gl.static_assert(NUM_STAGES >= 2, "the ring needs two slots")
    gl.static_assert(TILE_N % 32 == 0, "TILE_N: a multiple of the copy layout's 32 rows")
    dtype: gl.constexpr = kv_cache_ptr.dtype.element_ty

    # layouts: copies of 16 B a thread, a warp covering 4 rows x 64 columns; the two MMA results
    cp_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, TILE_N // 2, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, LATENT_DIM // 2, 16])
    row_cp: gl.constexpr = gl.SliceLayout(1, cp_l)
    col_cp: gl.constexpr = gl.SliceLayout(0, cp_l)

    head_group, split, seq, q_start, q_end = _cta_cell(query_start_loc_ptr, num_heads, num_splits)
    if (q_end <= q_start) | (q_start < 0) | (q_start >= num_tokens):
        return  # no query token (one token a sequence: it is query_start_loc[seq])
    token = q_start.to(gl.int64)
    seq_len = gl.load(seq_lens_ptr + seq)
    seg_lo, seg_hi, n_tiles = _split_tiles(seq_len, split, num_splits, TILE_N)
    q_n_smem, q_r_smem, kn_bufs, kr_bufs, p_smem = _allocate_shared(dtype, TILE_N, NUM_STAGES)

    # queries: rows = heads of this head group (rows past num_heads zero-filled)
    offs_cn = gl.arange(0, LATENT_DIM, layout=col_cp)
    offs_cr = gl.arange(0, ROPE_DIM, layout=col_cp)
    _issue_queries(q_n_smem, q_r_smem, q_nope_ptr, q_pe_ptr, token, head_group * BLOCK_M, num_heads, stride_qn_t,
                   stride_qn_h, stride_qp_t, stride_qp_h, offs_cn, offs_cr, row_cp)

    # prologue: tiles 0 .. NUM_STAGES - 2 (the queries join tile 0's group)
    offs_n = gl.arange(0, TILE_N, layout=row_cp)
    bt_row_ptr = block_table_ptr + seq.to(gl.int64) * stride_bt_s
    for t in gl.static_range(NUM_STAGES - 1):
        if t < n_tiles:
            _issue_tile(kn_bufs.index(t), kr_bufs.index(t), kv_cache_ptr, bt_row_ptr, seg_lo + t * TILE_N, seg_hi,
                        num_blocks, max_blocks_per_seq, stride_c_b, stride_c_s, offs_n, offs_cn, offs_cr, PAGE_SIZE)
        cp.commit_group()

    qk_scale = scale * LOG2E
    offs_sn = gl.arange(0, TILE_N, layout=gl.SliceLayout(0, s_l))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_l))
    l_acc = gl.zeros([BLOCK_M, TILE_N], gl.float32, layout=s_l)  # row sums, reduced once after the loop
    s_zero = gl.zeros([BLOCK_M, TILE_N], gl.float32, layout=s_l)
    acc = gl.zeros([BLOCK_M, LATENT_DIM], gl.float32, layout=o_l)
    for i in range(n_tiles):
        slot = i % NUM_STAGES
        cp.wait_group(NUM_STAGES - 2)  # this thread's copies of tile i (and of the queries) landed
        fence_async_shared()
        gl.thread_barrier()  # everyone's landed; everyone finished step i - 1
        nxt = i + NUM_STAGES - 1
        if nxt < n_tiles:  # refill the slot step i - 1 read
            _issue_tile(kn_bufs.index(nxt % NUM_STAGES), kr_bufs.index(nxt % NUM_STAGES), kv_cache_ptr, bt_row_ptr,
                        seg_lo + nxt * TILE_N, seg_hi, num_blocks, max_blocks_per_seq, stride_c_b, stride_c_s,
                        offs_n, offs_cn, offs_cr, PAGE_SIZE)
        cp.commit_group()

        kn = kn_bufs.index(slot)  # [TILE_N, 512]: K_nope of the scores, V of the output
        kr = kr_bufs.index(slot)  # [TILE_N, 64]
        s = warpgroup_mma(q_n_smem, kn.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q_r_smem, kr.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))  # [BLOCK_M, TILE_N] fp32

        p, alpha, m_i, l_acc = _softmax_step(s, seg_lo + i * TILE_N, offs_sn, seg_hi, qk_scale, m_i, l_acc)

        p_smem.store(p.to(dtype))
        fence_async_shared()
        gl.thread_barrier()  # all of P is in shared memory before either warpgroup reads it
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        acc = warpgroup_mma(p_smem, kn, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    cp.wait_group(0)

    l_i = gl.reduce(l_acc, 1, sum_combine)
    out, lse = finalize_rows(acc, m_i, l_i, s_l, o_l)

    _store_split(out_ptr, lse_ptr, out, lse, token, head_group * BLOCK_M, split.to(gl.int64), num_heads,
                 stride_o_t, stride_o_h, stride_o_s, stride_lse_t, stride_lse_h, stride_lse_s, s_l, o_l)
