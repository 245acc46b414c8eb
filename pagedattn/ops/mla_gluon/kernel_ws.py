"""MLA decode for Hopper (sm90) in Gluon, warp-specialized: a copy warpgroup and two MMA warpgroups.

``mla_decode_gluon_ws_kernel`` (the default of ``pagedattn.ops.mla_gluon.launch``) has the
arguments, contract and results of ``pagedattn.ops.mla_gluon.kernel.mla_decode_gluon_kernel``
(split rule, partial (out, lse) layout for ``launch_merge_splits``, masking and NaN rules): one
CTA owns BLOCK_M = 64 query rows (heads ``64 * head_group ..`` of one token; rows past num_heads
read zeros and are not stored) and one key split, and walks it in 64-key tiles.

Shared memory (229,376 B of operands, in the wgmma layouts, + 3 x 256 B + the barriers): the
queries ``[64, 512] + [64, 64]``, a ring of NUM_STAGES = 2 latent tiles ``[64, 512] + [64,
64]``, the weights P ``[64, 64]`` (16-bit), and three fp32 row vectors: the rescale ``alpha`` of
the tile in flight and, after the loop, the row max and row sum. A third ring slot does not fit.

Three partitions, 12 warps (384 threads). ``setmaxnreg`` gives warpgroup 0 248 registers a
thread, warpgroup 1 PV_REGS = 160 and the copy warps COPY_REGS = 96 (128 x 504 of the 64K
register file):

* ``default`` (warpgroup 0, 4 warps): ``S = Q_nope K_nope^T + Q_rope K_rope^T`` for the whole
  64 x 64 tile (wgmma, both operands in shared memory: 36 m64n64k16 a tile), the online softmax
  in base 2, P and alpha to shared memory, then ``O[:, :256] = alpha O[:, :256] + P V[:, :256]``
  (4 m64n256k16); it keeps the row max and sum, and at the end stores its half of O and the lse.
* ``pv`` (warpgroup 1, 4 warps): ``O[:, 256:] = alpha O[:, 256:] + P V[:, 256:]`` (4
  m64n256k16) with P and alpha from shared memory; it computes no scores. At the end it reads
  the row max and sum and stores its half.
* ``copy`` (4 warps): reads the block ids a tile ahead and gathers the 576-wide rows of each
  tile (512 + 64 columns; a 64-key tile spans several pages or part of one) with cp.async, 16 B
  a thread a copy, into the ring; tile 0's arrival also covers the queries. No thread of an MMA
  warpgroup issues a global load in the loop.

Tile i uses ring slot ``i % 2`` in its lap ``i // 2``: its ring barriers complete for the
``(i // 2)``-th time, parity ``(i // 2) & 1``; a producer waiting for a slot to drain waits
the other parity (the first lap passes at once). An arrive by an MMA warpgroup is one thread's,
after a warpgroup barrier (Gluon's lowering), once the warpgroup's wgmma reading the buffer
have completed (``warpgroup_mma_wait``). After waiting on a ring barrier a consumer fences the
async proxy: cp.async writes through the generic proxy, wgmma reads through the async one.

Schedule: warpgroup 0 runs scores, softmax and its PV of tile i in sequence; warpgroup 1's PV
of tile i runs beside warpgroup 0's, and the copy warps fill the other slot throughout (a slot
drains at the end of its tile, a whole step before the tile that refills it is needed). The
tensor cores wait during warpgroup 0's softmax. Barriers:

* ``kv_ready[slot]`` (count 128 = copy threads): every copy thread arrives with
  ``cp.async.mbarrier.arrive.noinc`` after issuing the tile, which fires when that thread's
  copies have landed; both MMA warpgroups wait parity ``(i // 2) & 1``.
* ``kv_empty[slot]`` (count 2): each MMA warpgroup arrives once its PV of the tile completed
  (warpgroup 0's scores are done before its PV); the copy warps wait parity ``((i // 2) & 1) ^ 1``.
* ``p_ready`` (count 1): warpgroup 0 arrives after storing P and alpha of tile i and fencing;
  warpgroup 1 waits parity ``i & 1``.
* ``p_empty`` (count 1): warpgroup 1 arrives when its PV of tile i completed (P and alpha read);
  warpgroup 0 waits parity ``(i & 1) ^ 1`` before storing tile i + 1's, so it is never two
  phases ahead of warpgroup 1 on either P barrier.
* ``stats_ready`` (count 1): after the loop warpgroup 0 stores the row max and row sum and
  arrives; warpgroup 1 waits parity 0 before normalizing its half.

GROUP_SIGNAL (the ``groups`` config, off by default) changes ``kv_ready``'s signal alone: each
copy thread commits the tile's copies (tile 0's with the queries) as a cp.async group, waits
for it (``wait_group``) and fences the async proxy, and the partition arrives once (one
thread, after a barrier of the copy warps), so ``kv_ready`` counts 1. Triton's ConSan (triton
3.6) counts a cp.async as complete only at a ``wait_group`` and does not follow the noinc
arrive, so it reports every wgmma read of a ring slot as a race under the default; under
GROUP_SIGNAL it can check the ring. The copy warps then wait for each tile to land before
loading the next tile's block ids, so at most one tile's copies are in flight.

A split with no tiles (or a sequence without a query token) runs no loop iteration in any
partition: nothing is copied, the ring and P barriers never complete, and both MMA warpgroups
finalize an empty row (out 0, lse -inf) where there is a token to store for. The copy warps
may finish long before the MMA warpgroups; they wait for their own copies before exiting. The
CTA never returns before the fork (every warp must reach the partitions), so a program without
a token runs with zero tiles instead.

Keys past the split's end or the sequence, and block ids outside ``[0, num_blocks)``, are never
dereferenced: their copies are masked, which zero-fills the shared rows (stale values could be
NaN, and 0 * NaN is NaN in P V). Keys past the end get score -inf; an inf dot product becomes
NaN in the scores (``_softmax_step``), which spreads over the row through P into both halves.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from pagedattn.ops.common.gluon_math import LOG2E, finalize_rows, sum_combine
from pagedattn.ops.mla_gluon.kernel import (BLOCK_M, LATENT_DIM, ROPE_DIM, _allocate_shared, _cta_cell, _gather_tile,
                                            _issue_queries, _softmax_step, _split_tiles, _store_rows, _store_split,
                                            _tile_pages)

HALF = gl.constexpr(256)  # output columns a MMA warpgroup keeps: [64, 256] fp32 = 128 registers a thread
WG_WARPS = gl.constexpr(4)  # a warpgroup: the unit of wgmma and of setmaxnreg
COPY_WARPS = gl.constexpr(4)
COPY_THREADS = gl.constexpr(128)  # kv_ready's count: one noinc cp.async arrive per copy thread
# registers a thread of the workers (setmaxnreg); Triton gives the default warpgroup the rest of
# the 64K-register file (248 here): 128 threads x (PV_REGS + COPY_REGS + default) <= 65,536.
# No partition spills at these (ptxas, sm_90a, bf16 and fp16, pages 16 / 64 / 128)
PV_REGS = gl.constexpr(160)
COPY_REGS = gl.constexpr(96)


@gluon.jit
def _program(query_start_loc_ptr, seq_lens_ptr, num_heads, num_tokens, num_splits, TILE_N: gl.constexpr):
    """This CTA's (store_ok, token, sequence, split, first head, first key, end key, tiles). A
    sequence without a query token (one token a sequence: it is ``query_start_loc[seq]``) gets
    zero tiles and stores nothing: the CTA runs the partitions anyway rather than returning
    early, so every warp reaches the fork and the join."""
    head_group, split, seq, q_start, q_end = _cta_cell(query_start_loc_ptr, num_heads, num_splits)
    store_ok = (q_end > q_start) & (q_start >= 0) & (q_start < num_tokens)
    token = gl.where(store_ok, q_start, 0).to(gl.int64)
    seq_len = gl.load(seq_lens_ptr + seq)
    seg_lo, seg_hi, n_tiles = _split_tiles(seq_len, split, num_splits, TILE_N)
    n_tiles = gl.where(store_ok, n_tiles, 0)
    return store_ok, token, seq, split.to(gl.int64), head_group * BLOCK_M, seg_lo, seg_hi, n_tiles


@gluon.jit
def _publish_p(p, alpha, p_smem, alpha_smem, p_ready, p_empty, i):
    """Warpgroup 0 hands tile i's P (16-bit) and alpha to warpgroup 1: once warpgroup 1's PV of
    tile i - 1 has read the previous ones (p_empty), store, fence, arrive on p_ready."""
    mbarrier.wait(p_empty, (i & 1) ^ 1)
    p_smem.store(p)
    alpha_smem.store(alpha)
    fence_async_shared()  # P written through the generic proxy, read by wgmma (async proxy)
    mbarrier.arrive(p_ready, count=1)  # after a warpgroup barrier: all four warps' P is stored


@gluon.jit
def _finish_scores(acc, m_i, l_i, m_smem, l_smem, stats_ready, out_ptr, lse_ptr, token, head0, split64, num_heads,
                   stride_o_t, stride_o_h, stride_o_s, stride_lse_t, stride_lse_h, stride_lse_s, store_ok,
                   s_l: gl.constexpr, o_l: gl.constexpr):
    """Warpgroup 0 after the loop: the row max and sum to warpgroup 1 (stats_ready), then its
    half of O normalized and the lse stored."""
    m_smem.store(m_i)
    l_smem.store(l_i)
    mbarrier.arrive(stats_ready, count=1)
    out, lse = finalize_rows(acc, m_i, l_i, s_l, o_l)
    if store_ok:
        _store_split(out_ptr, lse_ptr, out, lse, token, head0, split64, num_heads, stride_o_t, stride_o_h, stride_o_s,
                     stride_lse_t, stride_lse_h, stride_lse_s, s_l, o_l)


@gluon.jit
def _finish_pv(acc, m_smem, l_smem, stats_ready, out_ptr, token, head0, split64, num_heads, stride_o_t, stride_o_h,
               stride_o_s, store_ok, o_l: gl.constexpr):
    """Warpgroup 1 after the loop: its half of O normalized by warpgroup 0's row max and sum."""
    mbarrier.wait(stats_ready, 0)
    m_i = m_smem.load(gl.SliceLayout(1, o_l))
    l_i = l_smem.load(gl.SliceLayout(1, o_l))
    out, _ = finalize_rows(acc, m_i, l_i, o_l, o_l)
    if store_ok:
        _store_rows(out_ptr, out, token, head0, split64, num_heads, stride_o_t, stride_o_h, stride_o_s, HALF, o_l)


@gluon.jit
def _score_partition(q_n_smem, q_r_smem, kn_bufs, kr_bufs, p_smem, alpha_smem, m_smem, l_smem,
                     kv_ready, kv_empty, p_ready, p_empty, stats_ready,
                     out_ptr, lse_ptr, token, head0, split64, num_heads, stride_o_t, stride_o_h, stride_o_s,
                     stride_lse_t, stride_lse_h, stride_lse_s, seg_lo, seg_hi, n_tiles, qk_scale, store_ok,
                     TILE_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Warpgroup 0: scores, softmax, P and alpha to shared memory, O[:, :256]; the lse."""
    dtype: gl.constexpr = kn_bufs.dtype
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WG_WARPS, 1],
                                                  instr_shape=[16, TILE_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WG_WARPS, 1],
                                                  instr_shape=[16, HALF, 16])
    offs_sn = gl.arange(0, TILE_N, layout=gl.SliceLayout(0, s_l))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_l))
    l_acc = gl.zeros([BLOCK_M, TILE_N], gl.float32, layout=s_l)  # row sums, reduced once after the loop
    s_zero = gl.zeros([BLOCK_M, TILE_N], gl.float32, layout=s_l)
    acc = gl.zeros([BLOCK_M, HALF], gl.float32, layout=o_l)
    for i in range(n_tiles):
        slot = i % NUM_STAGES
        mbarrier.wait(kv_ready.index(slot), (i // NUM_STAGES) & 1)
        fence_async_shared()  # the copy warps' cp.async writes, before the async proxy reads them
        kn = kn_bufs.index(slot)  # [TILE_N, 512]: K_nope of the scores, V of the output
        kr = kr_bufs.index(slot)
        s = warpgroup_mma(q_n_smem, kn.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q_r_smem, kr.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))

        p, alpha, m_i, l_acc = _softmax_step(s, seg_lo + i * TILE_N, offs_sn, seg_hi, qk_scale, m_i, l_acc)
        _publish_p(p.to(dtype), alpha, p_smem, alpha_smem, p_ready, p_empty, i)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        acc = warpgroup_mma(p_smem, kn.slice(0, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(kv_empty.index(slot), count=1)

    _finish_scores(acc, m_i, gl.reduce(l_acc, 1, sum_combine), m_smem, l_smem, stats_ready, out_ptr, lse_ptr, token,
                   head0, split64, num_heads, stride_o_t, stride_o_h, stride_o_s, stride_lse_t, stride_lse_h,
                   stride_lse_s, store_ok, s_l, o_l)


@gluon.jit
def _pv_partition(kn_bufs, p_smem, alpha_smem, m_smem, l_smem, kv_ready, kv_empty, p_ready, p_empty, stats_ready,
                  out_ptr, token, head0, split64, num_heads, stride_o_t, stride_o_h, stride_o_s, n_tiles, store_ok,
                  TILE_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Warpgroup 1: O[:, 256:] from warpgroup 0's P and alpha; normalized by its row max and sum."""
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WG_WARPS, 1],
                                                  instr_shape=[16, HALF, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, o_l)
    acc = gl.zeros([BLOCK_M, HALF], gl.float32, layout=o_l)
    for i in range(n_tiles):
        slot = i % NUM_STAGES
        mbarrier.wait(kv_ready.index(slot), (i // NUM_STAGES) & 1)  # complete already: orders the copies
        mbarrier.wait(p_ready, i & 1)
        fence_async_shared()
        alpha = alpha_smem.load(row_l)
        acc = acc * alpha[:, None]
        acc = warpgroup_mma(p_smem, kn_bufs.index(slot).slice(HALF, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(p_empty, count=1)
        mbarrier.arrive(kv_empty.index(slot), count=1)

    _finish_pv(acc, m_smem, l_smem, stats_ready, out_ptr, token, head0, split64, num_heads, stride_o_t, stride_o_h,
               stride_o_s, store_ok, o_l)


@gluon.jit
def _copy_partition(q_n_smem, q_r_smem, kn_bufs, kr_bufs, kv_ready, kv_empty, q_nope_ptr, q_pe_ptr, kv_cache_ptr,
                    bt_row_ptr, token, head0, num_heads, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
                    stride_c_b, stride_c_s, num_blocks, max_blocks_per_seq, seg_lo, seg_hi, n_tiles,
                    PAGE_SIZE: gl.constexpr, TILE_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                    GROUP_SIGNAL: gl.constexpr):
    """The copy warps: the queries, then each tile's gathered rows into the ring. GROUP_SIGNAL:
    each tile's copies (tile 0's with the queries) are committed as a group, waited for
    (``wait_group``) and fenced, then the partition arrives once (ConSan's form; one tile in
    flight)."""
    # copies of 16 B a thread, a warp covering 4 rows x 64 columns
    cp_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [COPY_WARPS, 1], [1, 0])
    row_cp: gl.constexpr = gl.SliceLayout(1, cp_l)
    col_cp: gl.constexpr = gl.SliceLayout(0, cp_l)
    offs_cn = gl.arange(0, LATENT_DIM, layout=col_cp)
    offs_cr = gl.arange(0, ROPE_DIM, layout=col_cp)
    offs_n = gl.arange(0, TILE_N, layout=row_cp)
    if n_tiles > 0:  # the queries ride with tile 0's arrival (the noinc arrive, or tile 0's group, covers them)
        _issue_queries(q_n_smem, q_r_smem, q_nope_ptr, q_pe_ptr, token, head0, num_heads, stride_qn_t, stride_qn_h,
                       stride_qp_t, stride_qp_h, offs_cn, offs_cr, row_cp)
    page = _tile_pages(bt_row_ptr, seg_lo, seg_hi, max_blocks_per_seq, offs_n, PAGE_SIZE)
    for i in range(n_tiles):
        slot = i % NUM_STAGES
        tile_start = seg_lo + i * TILE_N
        mbarrier.wait(kv_empty.index(slot), ((i // NUM_STAGES) & 1) ^ 1)  # both MMA warpgroups left it
        _gather_tile(kn_bufs.index(slot), kr_bufs.index(slot), kv_cache_ptr, page, tile_start, seg_hi, num_blocks,
                     stride_c_b, stride_c_s, offs_n, offs_cn, offs_cr, PAGE_SIZE)
        if GROUP_SIGNAL:
            cp.commit_group()
            cp.wait_group(0)  # this thread's copies of the tile (and of the queries) landed
            fence_async_shared()
            mbarrier.arrive(kv_ready.index(slot), count=1)  # after a partition-wide barrier
        else:
            cp.mbarrier_arrive(kv_ready.index(slot), increment_count=False)
        # the next tile's block ids (all masked past the split: nothing is read)
        page = _tile_pages(bt_row_ptr, tile_start + TILE_N, seg_hi, max_blocks_per_seq, offs_n, PAGE_SIZE)
    cp.commit_group()
    cp.wait_group(0)  # no copy of this thread outlives it


@gluon.jit(do_not_specialize=["num_seqs", "num_tokens", "num_blocks", "max_blocks_per_seq", "num_splits"])
def mla_decode_gluon_ws_kernel(
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
    PAGE_SIZE: gl.constexpr, TILE_N: gl.constexpr, NUM_STAGES: gl.constexpr, GROUP_SIGNAL: gl.constexpr,
):
    """(out, lse) of softmax(scale * (q_nope c_kv^T + q_pe k_pe^T)) c_kv over one key split of one
    token's sequence, for 64 of its heads (see the module docstring). Launched with num_warps=4
    (warpgroup 0); the two worker partitions add 8 warps."""
    gl.static_assert(NUM_STAGES == 2, "the ring has two slots (shared memory holds no third)")
    gl.static_assert(TILE_N == 64, "64-key tiles: P [64, 64] and the barrier protocol assume them")
    dtype: gl.constexpr = kv_cache_ptr.dtype.element_ty

    store_ok, token, seq, split64, head0, seg_lo, seg_hi, n_tiles = _program(
        query_start_loc_ptr, seq_lens_ptr, num_heads, num_tokens, num_splits, TILE_N)
    q_n_smem, q_r_smem, kn_bufs, kr_bufs, p_smem = _allocate_shared(dtype, TILE_N, NUM_STAGES)
    vec_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    alpha_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec_l)
    m_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec_l)
    l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec_l)
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    stats_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    # a noinc arrive per copy thread, or the copy partition's one arrive (GROUP_SIGNAL)
    READY_ARRIVALS: gl.constexpr = 1 if GROUP_SIGNAL else COPY_THREADS
    for t in gl.static_range(NUM_STAGES):
        mbarrier.init(kv_ready.index(t), count=READY_ARRIVALS)
        mbarrier.init(kv_empty.index(t), count=2)
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_empty, count=1)
    mbarrier.init(stats_ready, count=1)
    fence_async_shared()

    bt_row_ptr = block_table_ptr + seq.to(gl.int64) * stride_bt_s
    gl.warp_specialize([
        (_score_partition, (q_n_smem, q_r_smem, kn_bufs, kr_bufs, p_smem, alpha_smem, m_smem, l_smem,
                            kv_ready, kv_empty, p_ready, p_empty, stats_ready,
                            out_ptr, lse_ptr, token, head0, split64, num_heads, stride_o_t, stride_o_h, stride_o_s,
                            stride_lse_t, stride_lse_h, stride_lse_s, seg_lo, seg_hi, n_tiles, scale * LOG2E,
                            store_ok, TILE_N, NUM_STAGES)),
        (_pv_partition, (kn_bufs, p_smem, alpha_smem, m_smem, l_smem, kv_ready, kv_empty, p_ready, p_empty,
                         stats_ready, out_ptr, token, head0, split64, num_heads, stride_o_t, stride_o_h, stride_o_s,
                         n_tiles, store_ok, TILE_N, NUM_STAGES)),
        (_copy_partition, (q_n_smem, q_r_smem, kn_bufs, kr_bufs, kv_ready, kv_empty, q_nope_ptr, q_pe_ptr,
                           kv_cache_ptr, bt_row_ptr, token, head0, num_heads, stride_qn_t, stride_qn_h, stride_qp_t,
                           stride_qp_h, stride_c_b, stride_c_s, num_blocks, max_blocks_per_seq, seg_lo, seg_hi,
                           n_tiles, PAGE_SIZE, TILE_N, NUM_STAGES, GROUP_SIGNAL)),
    ], [WG_WARPS, COPY_WARPS], [PV_REGS, COPY_REGS])
