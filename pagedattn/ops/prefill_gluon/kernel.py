"""Causal paged prefill / extend for Hopper (sm90) in Gluon: cp.async producer warps feeding wgmma.

The same computation as ``pagedattn.ops.prefill.kernel.prefill_attention_kernel`` restricted to
a paged 16-bit cache and a causal mask: for one BLOCK_M-row tile of one query head, ``out =
softmax(scale * q k^T + causal) v`` with ``lse`` in natural log, over the keys ``[0,
min(seq_len, last query position + 1))``, with the tl kernel's score modifiers (a sliding
window, softcap, ALiBi, sinks, prefix ranges) applied as ``ops.common.attention_math`` applies
them; a window or prefix ranges change the key range and which tiles are masked.

One CTA per (query head, sequence, Q tile), the tl kernel's grid and launch order (the heaviest
Q tile of every head and sequence first). Two partitions (``gl.warp_specialize``):

* the default partition, NUM_WARPS warps (BLOCK_M = 16 * NUM_WARPS rows, a warpgroup per 64):
  per key tile ``S = Q K^T`` (wgmma, K from shared memory, Q from shared memory or, with
  Q_IN_REGS, from registers loaded once), the online softmax in base 2
  in registers, ``P`` converted in registers to the A operand of ``O += P V`` (wgmma, V from
  shared memory, O in registers); PIPELINED issues the next tile's ``S`` before this tile's
  softmax, OVERLAP also keeps this tile's ``P V`` running during the next tile's softmax. Tiles
  that every row sees in full (below the causal diagonal) run without a mask, with PAIRED two at
  a time (one softmax step and one rescale of O for both); the diagonal tiles mask
  ``k_pos > q_pos``. At the end it normalizes and stores out (q's dtype) and lse;
* the producer, PRODUCER_WARPS warps with few registers: for each key tile, the block ids of its
  keys through the table, then one cp.async per 16 bytes of K and of V into ring slot
  ``i % NUM_STAGES`` (COPY_ROWS rows a pass, in a loop, where that is less than BLOCK_N); with
  TMA_BOX (the ``tma`` configs), one thread issues a TMA box per page and 64 columns instead, for
  every tile whose keys all lie before the range's end.

Queries are loaded once (plain loads, rows past the sequence read as zeros) and stored into
shared memory by the default warps before the partitions fork.

Barrier protocol (per ring slot s; i is the key tile, ``ph = (i // NUM_STAGES) & 1``):

* ``k_ready[s]`` / ``v_ready[s]``, count 32 * PRODUCER_WARPS: after issuing tile i's K (then V)
  copies, every producer thread does ``cp.async.mbarrier.arrive.noinc`` on it, which fires when
  that thread's earlier copies have landed; the phase completes when all of the tile's K (V) is
  in shared memory. The consumer waits ``(k_ready[s], ph)`` before ``S = Q K^T`` and
  ``(v_ready[s], ph)`` before ``O += P V``, each followed by ``fence.proxy.async`` (cp.async
  writes through the generic proxy, wgmma reads through the async proxy).
* with GROUP_SIGNAL the ready barriers count one arrival: the producer waits for the tile's
  cp.async groups, fences and arrives once (``_signal_landed``); a TMA tile's arrival is the
  ``expect`` of its bytes, and the phase completes when the boxes have landed.
* ``kv_empty[s]``, one arrival per consumer partition: the partition arrives once (the arrive is
  lowered as a partition-wide barrier, then one thread) after both wgmma of tile i are waited
  for, so no warpgroup still reads K or V of slot s. The producer waits ``(kv_empty[s], ph ^ 1)``
  before refilling slot s: the first pass through the ring (phase 1 of a fresh barrier) goes
  through at once.
* with SPLIT_EMPTY, ``k_empty[s]`` and ``v_empty[s]`` instead: K's released once ``S = Q K^T`` of
  tile i is waited for, V's after its ``P V``; the producer waits for each before copying K and V
  into slot s, so K is refilled a softmax step earlier (FA3's two pipelines).
* with THREAD_RELEASE those barriers count every consumer thread, and each thread arrives by
  ``cp.async.mbarrier.arrive.noinc`` after its own wgmma wait (``_release``), with no barrier of
  the partition before it.

Both partitions walk the same tiles ``0 .. n_tiles - 1`` (computed before the fork), so every
arrive has its wait; at the join no copy or arrive is outstanding and the barriers are
invalidated.

Keys past the range and keys whose block id lies outside ``[0, num_blocks)`` (-1 for unused
table entries, or past the table's row) are never dereferenced: their copies are masked, which
zero-fills the shared rows (stale rows could hold NaN, and 0 * NaN is NaN in P V). Keys past the
range are masked by the causal rule; a key of a bad block id inside the range keeps the score
0 with a zero value (the tl kernel drops it: the output of such a corrupt sequence differs but
stays finite, and nothing outside the cache is read).

NaN and inf as ``ops.common.attention_math``: a non-finite dot product becomes NaN before the
mask, and a NaN or inf in the accumulator turns the whole row NaN at the end.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from pagedattn.ops.common.gluon_math import LOG2E, finalize_rows, max_combine, sum_combine, tanh, to_16bit_pairs



@gluon.jit
def _producer(k_cache_ptr, v_cache_ptr, k_desc, v_desc, bt_row_ptr, k_bufs, v_bufs, k_ready, v_ready, empties,
              kv_head, t_lo, n_tiles, kv_hi, num_blocks, max_blocks_per_seq, stride_c_b, stride_c_s, stride_c_h,
              HEAD: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
              PRODUCER_WARPS: gl.constexpr, GROUP_SIGNAL: gl.constexpr, COPY_ROWS: gl.constexpr,
              TMA_BOX: gl.constexpr, SPLIT_EMPTY: gl.constexpr):
    """Gather K and V tiles [BLOCK_N, HEAD] page by page into the ring (see the module docstring).
    GROUP_SIGNAL 1: each tile's copies are waited for (``wait_group``) and fenced, then one arrive
    of the partition (ConSan's form; one tile in flight). GROUP_SIGNAL 2: the same one tile late,
    so two tiles' copies are in flight: tile j - 1 is waited for, fenced and signalled after tile
    j's copies are issued (the last tile after the loop); the consumers then need no fence.
    COPY_ROWS < BLOCK_N: the cp.async copies of a tile go COPY_ROWS rows a pass (``_copy_passes``:
    at 128-key tiles and the few registers a TMA producer is given, a whole tile's 16 rows a
    thread of 64-bit addresses spill). TMA_BOX > 0 (with
    GROUP_SIGNAL 1): a tile whose keys all lie before kv_hi is copied by TMA through the host
    descriptors ``k_desc`` / ``v_desc`` (``_copy_tile_tma``), the one tile that reaches kv_hi by
    the masked cp.async copies, so that no key past the range is read. ``empties``: (K's slot free,
    V's slot free), one barrier twice unless SPLIT_EMPTY (then K is refilled once its S = Q K^T is
    done, V once its P V is)."""
    k_empty, v_empty = empties
    # 16 bytes a thread, HEAD // 8 threads across a row
    COL_THREADS: gl.constexpr = HEAD // 8
    cp_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // COL_THREADS, COL_THREADS], [PRODUCER_WARPS, 1], [1, 0])
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, cp_l))
    offs_d = gl.arange(0, HEAD, layout=gl.SliceLayout(0, cp_l))
    # offsets inside a page fit in int32, the page's own offset may not. When pages divide
    # BLOCK_N, a key's slot in its page is the same in every tile (tiles start at multiples of
    # BLOCK_N) and is computed once; a page longer than a tile puts tile i at slot
    # (i * BLOCK_N) % PAGE_SIZE of its page, so ``_copy_rows`` takes the slot per tile.
    in_page = (offs_n % PAGE_SIZE) * stride_c_s + kv_head * stride_c_h
    if TMA_BOX:
        gl.static_assert(GROUP_SIGNAL == 1, "TMA tiles complete on the ready barriers' one arrival")
        # the ring seen as TMA boxes of TMA_BOX keys x 64 columns: a [BLOCK_N, HEAD] slot of the
        # 128-byte swizzled layout is HEAD // 64 column blocks of BLOCK_N rows of 128 bytes, one
        # after the other (the layout the wgmma descriptors read)
        box_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                        element_bitwidth=k_bufs.dtype.primitive_bitwidth, rank=4)
        BOXES: gl.constexpr = NUM_STAGES * (HEAD // 64) * (BLOCK_N // TMA_BOX)
        k_boxes = k_bufs._reinterpret(k_bufs.dtype, [BOXES, 1, TMA_BOX, 1, 64], box_layout)
        v_boxes = v_bufs._reinterpret(v_bufs.dtype, [BOXES, 1, TMA_BOX, 1, 64], box_layout)
    k_rows = k_bufs  # the ring in COPY_ROWS x 64 pieces, for copies pass by pass
    v_rows = v_bufs
    if COPY_ROWS < BLOCK_N:
        rows_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                         element_bitwidth=k_bufs.dtype.primitive_bitwidth, rank=2)
        PIECES: gl.constexpr = NUM_STAGES * (HEAD // 64) * (BLOCK_N // COPY_ROWS)
        k_rows = k_bufs._reinterpret(k_bufs.dtype, [PIECES, COPY_ROWS, 64], rows_layout)
        v_rows = v_bufs._reinterpret(v_bufs.dtype, [PIECES, COPY_ROWS, 64], rows_layout)
    for i in range(t_lo, n_tiles):
        j = i - t_lo  # the tile's place in the ring's sequence
        slot = j % NUM_STAGES
        ph = (j // NUM_STAGES) & 1
        if TMA_BOX and (i + 1) * BLOCK_N <= kv_hi:  # without TMA_BOX the JIT drops this branch unseen
            mbarrier.wait(k_empty.index(slot), ph ^ 1)
            _copy_tile_tma(k_desc, k_boxes, k_ready.index(slot), bt_row_ptr, max_blocks_per_seq, i, slot, kv_head,
                           HEAD, PAGE_SIZE, BLOCK_N, TMA_BOX)
            if SPLIT_EMPTY:
                mbarrier.wait(v_empty.index(slot), ph ^ 1)
            _copy_tile_tma(v_desc, v_boxes, v_ready.index(slot), bt_row_ptr, max_blocks_per_seq, i, slot, kv_head,
                           HEAD, PAGE_SIZE, BLOCK_N, TMA_BOX)
        else:
            # (a wait in each branch: hoisted above them, ptxas lays out the timed TMA build anew)
            mbarrier.wait(k_empty.index(slot), ph ^ 1)
            _copy_tile(k_cache_ptr, v_cache_ptr, bt_row_ptr, k_bufs, v_bufs, k_rows, v_rows, k_ready, v_ready, v_empty,
                       i, j, slot, ph, offs_n, offs_d, in_page, kv_head, kv_hi, num_blocks, max_blocks_per_seq, stride_c_b,
                       stride_c_s, stride_c_h, HEAD, PAGE_SIZE, BLOCK_N, NUM_STAGES, PRODUCER_WARPS, GROUP_SIGNAL,
                       COPY_ROWS, SPLIT_EMPTY)
    if GROUP_SIGNAL == 2:
        if n_tiles > t_lo:
            _signal_landed(k_ready, v_ready, (n_tiles - 1 - t_lo) % NUM_STAGES, 0)


@gluon.jit
def _copy_tile(k_cache_ptr, v_cache_ptr, bt_row_ptr, k_bufs, v_bufs, k_rows, v_rows, k_ready, v_ready, v_empty, i,
               j, slot, ph, offs_n, offs_d, in_page, kv_head, kv_hi, num_blocks, max_blocks_per_seq, stride_c_b,
               stride_c_s, stride_c_h, HEAD: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
               NUM_STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr, GROUP_SIGNAL: gl.constexpr,
               COPY_ROWS: gl.constexpr, SPLIT_EMPTY: gl.constexpr):
    """Key tile i (the j-th of the ring's sequence, its pass ``ph``) into ring slot ``slot`` by
    masked cp.async copies of the producer's threads, K then V, signalled as GROUP_SIGNAL says (``_producer``):
    the whole tile at once (its rows' addresses computed once for both), or with COPY_ROWS <
    BLOCK_N pass by pass into ``k_rows`` / ``v_rows`` (``_copy_passes``), where V's passes load the
    block ids and form the addresses again: keeping K's across V's wait is what the passes avoid
    (one pass's addresses live at a time), and it is one tile a program (the TMA configs copy the
    tile that reaches kv_hi this way). SPLIT_EMPTY: V's copies wait for ``v_empty`` (the caller
    waited for K's slot)."""
    if COPY_ROWS == BLOCK_N:
        offs, ok = _copy_rows(bt_row_ptr, i * BLOCK_N, offs_n, offs_d, in_page, kv_head, kv_hi, num_blocks,
                              max_blocks_per_seq, stride_c_b, stride_c_s, stride_c_h, PAGE_SIZE, BLOCK_N)
        cp.async_copy_global_to_shared(k_bufs.index(slot), k_cache_ptr + offs, mask=ok[:, None])
    else:
        _copy_passes(k_cache_ptr, k_rows, bt_row_ptr, i, slot, kv_head, kv_hi, num_blocks, max_blocks_per_seq,
                     stride_c_b, stride_c_s, stride_c_h, HEAD, PAGE_SIZE, BLOCK_N, PRODUCER_WARPS, COPY_ROWS)
    if GROUP_SIGNAL:
        cp.commit_group()
    else:
        cp.mbarrier_arrive(k_ready.index(slot), increment_count=False)
    if SPLIT_EMPTY:
        mbarrier.wait(v_empty.index(slot), ph ^ 1)
    if COPY_ROWS == BLOCK_N:
        cp.async_copy_global_to_shared(v_bufs.index(slot), v_cache_ptr + offs, mask=ok[:, None])
    else:
        _copy_passes(v_cache_ptr, v_rows, bt_row_ptr, i, slot, kv_head, kv_hi, num_blocks, max_blocks_per_seq,
                     stride_c_b, stride_c_s, stride_c_h, HEAD, PAGE_SIZE, BLOCK_N, PRODUCER_WARPS, COPY_ROWS)
    if GROUP_SIGNAL:
        cp.commit_group()
        if GROUP_SIGNAL == 1:  # this tile's groups, the only ones in flight
            _signal_landed(k_ready, v_ready, slot, 0)
        elif j > 0:  # the groups in flight: tile j - 1's K and V, then tile j's
            _signal_landed(k_ready, v_ready, (j - 1) % NUM_STAGES, 2)
    else:
        cp.mbarrier_arrive(v_ready.index(slot), increment_count=False)


@gluon.jit
def _copy_rows(bt_row_ptr, key0, offs_n, offs_d, in_page, kv_head, kv_hi, num_blocks, max_blocks_per_seq, stride_c_b,
               stride_c_s, stride_c_h, PAGE_SIZE: gl.constexpr, ROWS: gl.constexpr):
    """The cache offsets [ROWS, columns of offs_d] of keys ``key0 ..`` and which rows to copy: those
    before kv_hi whose block id lies in the cache (the others are zero-filled). ``in_page``: the
    rows' offsets inside their pages when pages divide ROWS (else taken here)."""
    k_pos = key0 + offs_n
    page_idx = k_pos // PAGE_SIZE
    in_range = k_pos < kv_hi
    # one block id per key row (the rows of a page read the same id: L1 hits)
    page = gl.load(bt_row_ptr + page_idx, mask=in_range & (page_idx < max_blocks_per_seq), other=-1)
    ok = in_range & (page >= 0) & (page < num_blocks)
    if ROWS % PAGE_SIZE != 0:
        in_page = (k_pos % PAGE_SIZE) * stride_c_s + kv_head * stride_c_h
    row = gl.where(ok, page.to(gl.int64) * stride_c_b + in_page, 0)
    return row[:, None] + offs_d[None, :], ok


@gluon.jit
def _copy_passes(cache_ptr, rows_view, bt_row_ptr, i, slot, kv_head, kv_hi, num_blocks, max_blocks_per_seq,
                 stride_c_b, stride_c_s, stride_c_h, HEAD: gl.constexpr, PAGE_SIZE: gl.constexpr,
                 BLOCK_N: gl.constexpr, PRODUCER_WARPS: gl.constexpr, COPY_ROWS: gl.constexpr):
    """Key tile i of one cache into ring slot ``slot``, COPY_ROWS rows a pass in a loop that is not
    unrolled, so that one pass's row addresses are live at a time (unrolled, ptxas computed every
    pass's up front and the producer spilled at 40-48 registers with 128-key tiles). ``rows_view``:
    the ring as [NUM_STAGES * HEAD // 64 * passes, COPY_ROWS, 64] pieces of 64 columns (the
    swizzled slot's layout, as the TMA boxes see it)."""
    HALVES: gl.constexpr = HEAD // 64
    PASSES: gl.constexpr = BLOCK_N // COPY_ROWS
    # 16 bytes a thread, 8 threads across a piece's 64 columns
    cp_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
    offs_n = gl.arange(0, COPY_ROWS, layout=gl.SliceLayout(1, cp_l))
    offs_d = gl.arange(0, 64, layout=gl.SliceLayout(0, cp_l))
    in_page = (offs_n % PAGE_SIZE) * stride_c_s + kv_head * stride_c_h
    for c in range(PASSES):
        offs, ok = _copy_rows(bt_row_ptr, i * BLOCK_N + c * COPY_ROWS, offs_n, offs_d, in_page, kv_head, kv_hi,
                              num_blocks, max_blocks_per_seq, stride_c_b, stride_c_s, stride_c_h, PAGE_SIZE, COPY_ROWS)
        for h in gl.static_range(HALVES):
            cp.async_copy_global_to_shared(rows_view.index((slot * HALVES + h) * PASSES + c), cache_ptr + offs + h * 64,
                                           mask=ok[:, None])


@gluon.jit
def _copy_tile_tma(desc, boxes, ready, bt_row_ptr, max_blocks_per_seq, i, slot, kv_head, HEAD: gl.constexpr,
                   PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, TMA_BOX: gl.constexpr):
    """Key tile i of the cache ``desc`` ([num_blocks, PAGE_SIZE, num_kv_heads, HEAD], boxes of
    [1, TMA_BOX, 1, 64]) into ring slot ``slot`` by TMA: per page of the tile (or the tile's part
    of a longer page) one box per 64 columns, all completing on ``ready``, whose expected bytes
    are set first (its one arrival). A block id outside the cache (or a page past the table's
    row, read as -1) puts the box out of bounds, and TMA fills it with zeros, as the masked
    copies do."""
    PIECES: gl.constexpr = BLOCK_N // TMA_BOX
    HALVES: gl.constexpr = HEAD // 64
    mbarrier.expect(ready, BLOCK_N * HEAD * boxes.dtype.primitive_bitwidth // 8)
    for p in gl.static_range(PIECES):
        key = i * BLOCK_N + p * TMA_BOX
        page_idx = key // PAGE_SIZE
        page = gl.load(bt_row_ptr + page_idx, mask=page_idx < max_blocks_per_seq, other=-1)
        for h in gl.static_range(HALVES):
            tma.async_copy_global_to_shared(desc, [page, key % PAGE_SIZE, kv_head, h * 64], ready,
                                            boxes.index((slot * HALVES + h) * PIECES + p))


@gluon.jit
def _signal_landed(k_ready, v_ready, slot, NEWER_GROUPS: gl.constexpr):
    """Wait for the K and V commit groups of ring slot ``slot`` (NEWER_GROUPS committed after
    them), fence them for the async proxy and arrive on the slot's ready barriers (one arrive
    of the partition each)."""
    cp.wait_group(NEWER_GROUPS + 1)  # K landed (this thread's copies)
    fence_async_shared()
    mbarrier.arrive(k_ready.index(slot), count=1)  # after a partition-wide barrier
    cp.wait_group(NEWER_GROUPS)
    fence_async_shared()
    mbarrier.arrive(v_ready.index(slot), count=1)


@gluon.jit
def _release(bar, THREAD_RELEASE: gl.constexpr):
    """A consumer partition's release of a ring slot (its wgmma reading the slot waited for).
    THREAD_RELEASE: every thread arrives by ``cp.async.mbarrier.arrive.noinc``, which with no copy
    of its own in flight arrives at once, and the barrier counts every consumer thread; Triton
    does not take that arrive for a shared-memory write, so no barrier of the partition precedes
    it (compiled for sm_90a the loop keeps one ``bar.sync`` a tile, before its K wait). Else the
    partition's one arrive, which Triton lowers as a ``bar.sync`` of the partition and one
    thread's arrive, and the next ring wait gets another ``bar.sync``."""
    if THREAD_RELEASE:
        cp.mbarrier_arrive(bar, increment_count=False)
    else:
        mbarrier.arrive(bar, count=1)


@gluon.jit
def _base2_scores(qk, i, q_pos, qk_scale, mods, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr,
                  FEATURES: gl.constexpr):
    """The scores ``qk`` of key tile i with the softcap and ALiBi of ``mods`` applied (``mods``,
    ``FEATURES``: ``_probabilities``'): ``(x, c, k_pos)``, where ``x * c`` are the base-2 scores
    and ``k_pos`` the tile's key positions. A non-finite dot product becomes NaN."""
    USE_SOFTCAP: gl.constexpr = FEATURES[0]
    ALIBI_MODE: gl.constexpr = FEATURES[1]
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    scale, softcap, slope, sliding_window, pr_row, num_prefix_ranges, stride_pr_r = mods
    x = qk + qk * 0.0  # an inf dot product becomes NaN (never read as a masked key)
    k_pos = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
    c = qk_scale  # x * c: the base-2 scores
    if USE_SOFTCAP or ALIBI_MODE != 0:
        x = x * scale
        if USE_SOFTCAP:
            x = softcap * tanh(x / softcap)
        if ALIBI_MODE == 1:
            x = x + slope * (k_pos[None, :] - q_pos[:, None]).to(gl.float32)
        if ALIBI_MODE == 2:
            x = x - slope * gl.sqrt(gl.maximum(q_pos[:, None] - k_pos[None, :], 0).to(gl.float32))
        x = x * LOG2E
        c = 1.0
    return x, c, k_pos


@gluon.jit
def _probabilities(qk, i, m_i, l_i, q_pos, qk_scale, mods, DTYPE: gl.constexpr, HEAD: gl.constexpr,
                   BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr, MASKED: gl.constexpr, FEATURES: gl.constexpr):
    """One key tile's step of the online softmax: from the scores ``qk`` of tile i, P as the
    register A operand of ``O += P V``, the new row maxima and sums, and the factor ``alpha``
    (in the accumulator's row layout) that rescales O before this tile's P V adds to it.

    ``mods`` = (scale, softcap, ALiBi slope, sliding window, the sequence's prefix ranges, their
    count, their stride) of this head; ``FEATURES`` = (USE_SOFTCAP, ALIBI_MODE, USE_WINDOW,
    HAS_PREFIX), the kernel's. A softcap or ALiBi (``ops.common.attention_math.
    softcap_and_alibi``'s formulas) forms the natural-log scores first; MASKED applies the causal
    rule, with USE_WINDOW the window's, and with HAS_PREFIX makes a query and a key of one
    prefix range visible to each other whatever those rules say."""
    USE_WINDOW: gl.constexpr = FEATURES[2]
    HAS_PREFIX: gl.constexpr = FEATURES[3]
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, HEAD, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    scale, softcap, slope, sliding_window, pr_row, num_prefix_ranges, stride_pr_r = mods
    x, c, k_pos = _base2_scores(qk, i, q_pos, qk_scale, mods, BLOCK_N, NUM_WARPS, FEATURES)
    if MASKED:
        vis = k_pos[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            vis = vis & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        if HAS_PREFIX:
            for r in range(num_prefix_ranges):
                start = gl.load(pr_row + r * stride_pr_r)
                end = gl.load(pr_row + r * stride_pr_r + 1)
                in_q = (q_pos >= start) & (q_pos < end)
                in_k = (k_pos >= start) & (k_pos < end)
                vis = vis | (in_q[:, None] & in_k[None, :])
        x = gl.where(vis, x, float("-inf"))
        m_new = gl.maximum(m_i, gl.reduce(x, 1, max_combine) * c)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
    else:
        m_new = gl.maximum(m_i, gl.reduce(x, 1, max_combine) * c)
        m_use = m_new
    p = gl.exp2(x * c - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.reduce(p, 1, sum_combine)
    if BLOCK_N > 64:
        # at 128 keys the packed conversion compiled worse for sm_90a: the consumers spilled
        # (18 B in the loop, tma128-earlyk-1w), or, with every thread releasing its slots
        # (tma128-threads), ptxas added PRMTs instead of removing them (260 in the kernel, 68 here)
        p16 = p.to(DTYPE)
    else:
        p16 = to_16bit_pairs(p, DTYPE)  # one instruction a pair (``p.to`` adds a PRMT a pair)
    p_op = gl.convert_layout(p16, p_l)  # registers: the A operand of the second wgmma
    return p_op, m_new, l_i, gl.convert_layout(alpha, gl.SliceLayout(1, o_l))


@gluon.jit
def _pair_probabilities(qa, qb, i, m_i, l_i, q_pos, qk_scale, mods, DTYPE: gl.constexpr, HEAD: gl.constexpr,
                        BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr, FEATURES: gl.constexpr):
    """``_probabilities`` of two mask-free key tiles i and i + 1 as one step: one new row maximum
    over both, one ``alpha`` (O is rescaled once for 2 * BLOCK_N keys), P of each tile."""
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, HEAD, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    xa, c, _ = _base2_scores(qa, i, q_pos, qk_scale, mods, BLOCK_N, NUM_WARPS, FEATURES)
    xb, c, _ = _base2_scores(qb, i + 1, q_pos, qk_scale, mods, BLOCK_N, NUM_WARPS, FEATURES)
    m_new = gl.maximum(m_i, gl.maximum(gl.reduce(xa, 1, max_combine), gl.reduce(xb, 1, max_combine)) * c)
    pa = gl.exp2(xa * c - m_new[:, None])
    pb = gl.exp2(xb * c - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + (gl.reduce(pa, 1, sum_combine) + gl.reduce(pb, 1, sum_combine))
    pa_op = gl.convert_layout(pa.to(DTYPE), p_l)
    pb_op = gl.convert_layout(pb.to(DTYPE), p_l)
    return pa_op, pb_op, m_new, l_i, gl.convert_layout(alpha, gl.SliceLayout(1, o_l))


@gluon.jit
def _issue_scores(q_op, k_bufs, k_ready, j, s_zero, NUM_STAGES: gl.constexpr, FENCE: gl.constexpr):
    """Wait for the key tile at ring position j and issue ``S = Q K^T`` (async): (S, the K tile).
    ``q_op``: the Q tile in shared memory, or in registers as the wgmma's A operand. FENCE: the
    producer signalled the copies without a proxy fence (``cp.async.mbarrier.arrive.noinc``)."""
    slot = j % NUM_STAGES
    k_tile = k_bufs.index(slot)  # [BLOCK_N, HEAD]
    mbarrier.wait(k_ready.index(slot), (j // NUM_STAGES) & 1)
    if FENCE:
        fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads through the async one
    return warpgroup_mma(q_op, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True), k_tile


@gluon.jit
def _issue_values(p_op, v_bufs, v_ready, j, acc, NUM_STAGES: gl.constexpr, FENCE: gl.constexpr):
    """Wait for the value tile at ring position j and issue ``O += P V`` (async): (O, the V tile)."""
    slot = j % NUM_STAGES
    v_tile = v_bufs.index(slot)
    mbarrier.wait(v_ready.index(slot), (j // NUM_STAGES) & 1)
    if FENCE:
        fence_async_shared()
    return warpgroup_mma(p_op, v_tile, acc, is_async=True), v_tile


@gluon.jit
def _attend_pairs(i_lo, i_hi, t_base, q_op, k_bufs, v_bufs, k_ready, v_ready, empties, m_i, l_i, acc, q_pos,
                  qk_scale, mods, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                  NUM_WARPS: gl.constexpr, FEATURES: gl.constexpr, FENCE: gl.constexpr, THREAD_RELEASE: gl.constexpr):
    """The mask-free key tiles i_lo .. i_hi - 1 (an even count) two at a time: each pair's two
    ``S = Q K^T`` are waited for together and take one softmax step (``_pair_probabilities``), so
    O's rescale, the row maxima and the waits come once for 2 * BLOCK_N keys. Overlapped as
    ``_attend_tiles``' OVERLAP: pair j + 1's scores are issued with pair j's ``P V`` and its
    softmax runs while they finish. Four ring slots are held at once (a pair's P V and the next
    pair's scores): NUM_STAGES >= 5 keeps one slot filling. ``empties``: one barrier twice (a slot
    is released whole)."""
    kv_empty = empties[1]
    HEAD: gl.constexpr = acc.shape[1]
    DTYPE: gl.constexpr = q_op.dtype
    gl.static_assert(NUM_STAGES >= 5, "pairs hold four ring slots at once")
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_l)
    if i_lo < i_hi:
        qa, ka = _issue_scores(q_op, k_bufs, k_ready, i_lo - t_base, s_zero, NUM_STAGES, FENCE)
        qb, kb = _issue_scores(q_op, k_bufs, k_ready, i_lo + 1 - t_base, s_zero, NUM_STAGES, FENCE)
        qa, qb, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(qa, qb, ka, kb))
        pa, pb, m_i, l_i, alpha = _pair_probabilities(qa, qb, i_lo, m_i, l_i, q_pos, qk_scale, mods, DTYPE, HEAD,
                                                      BLOCK_N, NUM_WARPS, FEATURES)
        acc = acc * alpha[:, None]
        for i in range(i_lo, i_hi - 2, 2):
            qa, ka = _issue_scores(q_op, k_bufs, k_ready, i + 2 - t_base, s_zero, NUM_STAGES, FENCE)
            qb, kb = _issue_scores(q_op, k_bufs, k_ready, i + 3 - t_base, s_zero, NUM_STAGES, FENCE)
            acc, va = _issue_values(pa, v_bufs, v_ready, i - t_base, acc, NUM_STAGES, FENCE)
            acc, vb = _issue_values(pb, v_bufs, v_ready, i + 1 - t_base, acc, NUM_STAGES, FENCE)
            qa, qb, _, _ = warpgroup_mma_wait(num_outstanding=2, deps=(qa, qb, ka, kb))  # issued first: done first
            pa_next, pb_next, m_i, l_i, alpha = _pair_probabilities(qa, qb, i + 2, m_i, l_i, q_pos, qk_scale, mods,
                                                                    DTYPE, HEAD, BLOCK_N, NUM_WARPS, FEATURES)
            acc, _, _, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, pa, pb, va, vb))
            # slots i and i + 1 free: their wgmma are done
            _release(kv_empty.index((i - t_base) % NUM_STAGES), THREAD_RELEASE)
            _release(kv_empty.index((i + 1 - t_base) % NUM_STAGES), THREAD_RELEASE)
            acc = acc * alpha[:, None]
            pa = pa_next
            pb = pb_next
        last = i_hi - 2
        acc, va = _issue_values(pa, v_bufs, v_ready, last - t_base, acc, NUM_STAGES, FENCE)
        acc, vb = _issue_values(pb, v_bufs, v_ready, last + 1 - t_base, acc, NUM_STAGES, FENCE)
        acc, _, _, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, pa, pb, va, vb))
        _release(kv_empty.index((last - t_base) % NUM_STAGES), THREAD_RELEASE)
        _release(kv_empty.index((last + 1 - t_base) % NUM_STAGES), THREAD_RELEASE)
    return m_i, l_i, acc


@gluon.jit
def _attend_tiles(i_lo, i_hi, t_base, q_op, k_bufs, v_bufs, k_ready, v_ready, empties, m_i, l_i, acc, q_pos,
                  qk_scale, mods, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                  NUM_WARPS: gl.constexpr, MASKED: gl.constexpr, PIPELINED: gl.constexpr, OVERLAP: gl.constexpr,
                  FEATURES: gl.constexpr, FENCE: gl.constexpr, SPLIT_EMPTY: gl.constexpr,
                  THREAD_RELEASE: gl.constexpr):
    """Online softmax over key tiles i_lo .. i_hi - 1 (MASKED: the causal rule k_pos <= q_pos and
    the window's; else every key is visible to every row). Tile i sits at ring position
    ``i - t_base`` (t_base: the first tile the producer loads); ``mods``, ``FEATURES``:
    ``_probabilities``'; ``q_op``: ``_issue_scores``'.

    PIPELINED: software-pipelined by one tile: tile i + 1's ``S = Q K^T`` is issued before tile
    i's softmax, so the tensor cores run it while the warps compute exponentials; both wgmma in
    flight are waited for together, then slot i is released. OVERLAP (with PIPELINED): tile i's
    ``O += P V`` is issued right behind tile i + 1's ``S = Q K^T`` and runs while the warps
    compute tile i + 1's softmax (the scores are waited for alone, the older wgmma first); O is
    rescaled by tile i + 1's factor once its P V is done, and P of two tiles is live in
    registers. Else each tile's two wgmma and its softmax run one after the other.

    ``empties`` = (K's slot free, V's slot free). SPLIT_EMPTY (OVERLAP only): two barriers, K's
    slot released as soon as its scores are waited for, V's after its P V, so the producer
    refills K a softmax step earlier; else one barrier twice, the slot released whole after P V."""
    k_empty, kv_empty = empties
    HEAD: gl.constexpr = acc.shape[1]
    DTYPE: gl.constexpr = q_op.dtype
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_l)
    if not PIPELINED:
        for i in range(i_lo, i_hi):
            qk, k_tile = _issue_scores(q_op, k_bufs, k_ready, i - t_base, s_zero, NUM_STAGES, FENCE)
            qk, _ = warpgroup_mma_wait(num_outstanding=0, deps=(qk, k_tile))  # [BLOCK_M, BLOCK_N] fp32
            p_op, m_i, l_i, alpha = _probabilities(qk, i, m_i, l_i, q_pos, qk_scale, mods, DTYPE, HEAD,
                                                   BLOCK_N, NUM_WARPS, MASKED, FEATURES)
            acc = acc * alpha[:, None]
            acc, v_tile = _issue_values(p_op, v_bufs, v_ready, i - t_base, acc, NUM_STAGES, FENCE)
            acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op, v_tile))  # [BLOCK_M, HEAD] fp32
            # slot free: both wgmma of the tile are done
            _release(kv_empty.index((i - t_base) % NUM_STAGES), THREAD_RELEASE)
    elif i_lo < i_hi:
        qk, k_tile = _issue_scores(q_op, k_bufs, k_ready, i_lo - t_base, s_zero, NUM_STAGES, FENCE)
        qk, _ = warpgroup_mma_wait(num_outstanding=0, deps=(qk, k_tile))
        if SPLIT_EMPTY:
            _release(k_empty.index((i_lo - t_base) % NUM_STAGES), THREAD_RELEASE)
        if OVERLAP:
            p_op, m_i, l_i, alpha = _probabilities(qk, i_lo, m_i, l_i, q_pos, qk_scale, mods, DTYPE, HEAD,
                                                   BLOCK_N, NUM_WARPS, MASKED, FEATURES)
            acc = acc * alpha[:, None]
            for i in range(i_lo, i_hi - 1):
                qk_next, k_next = _issue_scores(q_op, k_bufs, k_ready, i + 1 - t_base, s_zero, NUM_STAGES, FENCE)
                acc, v_tile = _issue_values(p_op, v_bufs, v_ready, i - t_base, acc, NUM_STAGES, FENCE)
                qk, _ = warpgroup_mma_wait(num_outstanding=1, deps=(qk_next, k_next))  # issued first: done first
                if SPLIT_EMPTY:
                    _release(k_empty.index((i + 1 - t_base) % NUM_STAGES), THREAD_RELEASE)
                p_next, m_i, l_i, alpha = _probabilities(qk, i + 1, m_i, l_i, q_pos, qk_scale, mods, DTYPE, HEAD,
                                                         BLOCK_N, NUM_WARPS, MASKED, FEATURES)
                acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op, v_tile))
                # slot i free (SPLIT_EMPTY: its V): both its wgmma are done
                _release(kv_empty.index((i - t_base) % NUM_STAGES), THREAD_RELEASE)
                acc = acc * alpha[:, None]
                p_op = p_next
        else:
            for i in range(i_lo, i_hi - 1):
                qk_next, k_next = _issue_scores(q_op, k_bufs, k_ready, i + 1 - t_base, s_zero, NUM_STAGES, FENCE)
                p_op, m_i, l_i, alpha = _probabilities(qk, i, m_i, l_i, q_pos, qk_scale, mods, DTYPE, HEAD,
                                                       BLOCK_N, NUM_WARPS, MASKED, FEATURES)
                acc = acc * alpha[:, None]
                acc, v_tile = _issue_values(p_op, v_bufs, v_ready, i - t_base, acc, NUM_STAGES, FENCE)
                qk, acc, _, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(qk_next, acc, p_op, v_tile, k_next))
                # slot i free: both its wgmma are done
                _release(kv_empty.index((i - t_base) % NUM_STAGES), THREAD_RELEASE)
            p_op, m_i, l_i, alpha = _probabilities(qk, i_hi - 1, m_i, l_i, q_pos, qk_scale, mods, DTYPE, HEAD,
                                                   BLOCK_N, NUM_WARPS, MASKED, FEATURES)
            acc = acc * alpha[:, None]
        last = i_hi - 1
        acc, v_tile = _issue_values(p_op, v_bufs, v_ready, last - t_base, acc, NUM_STAGES, FENCE)
        acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op, v_tile))
        _release(kv_empty.index((last - t_base) % NUM_STAGES), THREAD_RELEASE)
    return m_i, l_i, acc


@gluon.jit
def _consumer(q_smem, k_bufs, v_bufs, k_ready, v_ready, empties, out_ptr, lse_ptr, stride_o_t, stride_o_h,
              stride_lse_t, stride_lse_h, head, q_start, q_len, row_lo, context_len, num_tokens, t_lo, t_mid_lo,
              t_mid_hi, n_tiles, scale, mods, sink_log2, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, PIPELINED: gl.constexpr, OVERLAP: gl.constexpr,
              PAIRED: gl.constexpr, Q_IN_REGS: gl.constexpr, FEATURES: gl.constexpr, FENCE: gl.constexpr,
              SPLIT_EMPTY: gl.constexpr, THREAD_RELEASE: gl.constexpr):
    """Attend over the key tiles and store out and lse: tiles t_lo .. t_mid_lo - 1 (the window's
    edge, with a window only) and t_mid_hi .. n_tiles - 1 (the diagonal) masked, the ones between
    without a mask. ``sink_log2``: the head's sink logit in base 2 (-inf: none), a key of weight
    e^sink and no value. Q_IN_REGS: Q is read from shared memory once, into registers as the A
    operand of every ``S = Q K^T`` (else each wgmma reads it from shared memory again)."""
    HEAD: gl.constexpr = q_smem.shape[1]
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, HEAD, 16])
    if Q_IN_REGS:
        q_op = q_smem.load(gl.DotOperandLayout(operand_index=0, parent=s_l, k_width=2))
    else:
        q_op = q_smem
    q_pos = context_len + row_lo + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_l))
    m_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_l)) + sink_log2
    l_i = gl.where(m_i > float("-inf"), 1.0, 0.0)
    acc = gl.zeros([BLOCK_M, HEAD], gl.float32, layout=o_l)
    qk_scale = scale * LOG2E
    USE_WINDOW: gl.constexpr = FEATURES[2]
    if USE_WINDOW:
        m_i, l_i, acc = _attend_tiles(t_lo, t_mid_lo, t_lo, q_op, k_bufs, v_bufs, k_ready, v_ready, empties, m_i,
                                      l_i, acc, q_pos, qk_scale, mods, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_WARPS,
                                      True, PIPELINED, OVERLAP, FEATURES, FENCE, SPLIT_EMPTY, THREAD_RELEASE)
    t_pairs = t_mid_lo
    if PAIRED:  # the mask-free tiles two at a time, an odd one left for _attend_tiles
        t_pairs = t_mid_lo + (t_mid_hi - t_mid_lo) // 2 * 2
        m_i, l_i, acc = _attend_pairs(t_mid_lo, t_pairs, t_lo, q_op, k_bufs, v_bufs, k_ready, v_ready, empties, m_i,
                                      l_i, acc, q_pos, qk_scale, mods, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_WARPS,
                                      FEATURES, FENCE, THREAD_RELEASE)
    m_i, l_i, acc = _attend_tiles(t_pairs, t_mid_hi, t_lo, q_op, k_bufs, v_bufs, k_ready, v_ready, empties, m_i,
                                  l_i, acc, q_pos, qk_scale, mods, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_WARPS, False,
                                  PIPELINED, OVERLAP, FEATURES, FENCE, SPLIT_EMPTY, THREAD_RELEASE)
    m_i, l_i, acc = _attend_tiles(t_mid_hi, n_tiles, t_lo, q_op, k_bufs, v_bufs, k_ready, v_ready, empties, m_i,
                                  l_i, acc, q_pos, qk_scale, mods, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_WARPS, True,
                                  PIPELINED, OVERLAP, FEATURES, FENCE, SPLIT_EMPTY, THREAD_RELEASE)

    out, lse = finalize_rows(acc, m_i, l_i, s_l, o_l)

    rows = row_lo + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_l))
    token = (q_start + rows).to(gl.int64)
    row_ok = (rows < q_len) & (token >= 0) & (token < num_tokens)
    offs_d = gl.arange(0, HEAD, layout=gl.SliceLayout(0, o_l))
    o_ptrs = out_ptr + token[:, None] * stride_o_t + head * stride_o_h + offs_d[None, :]
    gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    if lse_ptr is not None:
        l_rows = row_lo + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_l))
        l_token = (q_start + l_rows).to(gl.int64)
        l_ok = (l_rows < q_len) & (l_token >= 0) & (l_token < num_tokens)
        gl.store(lse_ptr + l_token * stride_lse_t + head * stride_lse_h, lse, mask=l_ok)


@gluon.jit
def _key_tiles(p_first, p_last, seq_len, sliding_window, pr_row, num_prefix_ranges, stride_pr_r,
               BLOCK_N: gl.constexpr, USE_WINDOW: gl.constexpr, HAS_PREFIX: gl.constexpr):
    """The key tiles of a Q tile whose queries sit at positions p_first .. p_last:
    ``(kv_hi, t_lo, t_mid_lo, t_mid_hi, n_tiles)``. Keys ``[0, kv_hi)`` up to the last query's
    position, widened to every prefix range that holds a query position of the tile; tiles
    ``t_lo .. n_tiles - 1`` are loaded (below t_lo no row's window reaches), tiles
    ``t_mid_lo .. t_mid_hi - 1`` are seen in full by every row, the others are masked."""
    kv_hi = gl.maximum(gl.minimum(seq_len, p_last + 1), 0)
    kv_lo = seq_len * 0
    if USE_WINDOW:
        kv_lo = gl.maximum(p_first - sliding_window + 1, 0)
    if HAS_PREFIX:
        for r in range(num_prefix_ranges):
            start = gl.load(pr_row + r * stride_pr_r)
            end = gl.load(pr_row + r * stride_pr_r + 1)
            hit = (start < end) & (start <= p_last) & (end > p_first)
            kv_lo = gl.where(hit, gl.minimum(kv_lo, start), kv_lo)
            kv_hi = gl.where(hit, gl.maximum(kv_hi, end), kv_hi)
        kv_lo = gl.maximum(kv_lo, 0)
        kv_hi = gl.minimum(kv_hi, seq_len)
    n_tiles = (kv_hi + BLOCK_N - 1) // BLOCK_N
    t_lo = 0
    t_mid_lo = 0
    if USE_WINDOW:
        t_lo = gl.minimum(kv_lo // BLOCK_N, n_tiles)
        in_every_window = gl.maximum(p_last - sliding_window + 1, 0)  # keys from here on: in every row's window
        t_mid_lo = gl.minimum(gl.maximum((in_every_window + BLOCK_N - 1) // BLOCK_N, t_lo), n_tiles)
    t_mid_hi = gl.maximum(gl.minimum(gl.maximum(p_first + 1, 0) // BLOCK_N, n_tiles), t_mid_lo)
    return kv_hi, t_lo, t_mid_lo, t_mid_hi, n_tiles


@gluon.jit
def _ring_barriers(NUM_STAGES: gl.constexpr, READY_ARRIVALS: gl.constexpr, EMPTY_ARRIVALS: gl.constexpr,
                   SPLIT_EMPTY: gl.constexpr):
    """The ring's barriers, one per slot each: K landed, V landed (READY_ARRIVALS arrivals), and
    the slot free again (EMPTY_ARRIVALS: one per consumer partition, or per consumer thread with
    ``_release``'s THREAD_RELEASE): ``(k_ready, v_ready, (K free, V free))``, the last one barrier
    twice unless SPLIT_EMPTY."""
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = k_empty
    if SPLIT_EMPTY:
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(s), count=READY_ARRIVALS)
        mbarrier.init(v_ready.index(s), count=READY_ARRIVALS)
        mbarrier.init(k_empty.index(s), count=EMPTY_ARRIVALS)
        if SPLIT_EMPTY:
            mbarrier.init(v_empty.index(s), count=EMPTY_ARRIVALS)
    return k_ready, v_ready, (k_empty, v_empty)


@gluon.jit
def _invalidate_ring(k_ready, v_ready, empties, NUM_STAGES: gl.constexpr, SPLIT_EMPTY: gl.constexpr):
    k_empty, v_empty = empties
    for s in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(k_ready.index(s))
        mbarrier.invalidate(v_ready.index(s))
        mbarrier.invalidate(k_empty.index(s))
        if SPLIT_EMPTY:
            mbarrier.invalidate(v_empty.index(s))


@gluon.jit
def _head_terms(alibi_slopes_ptr, sinks_ptr, head):
    """(ALiBi slope, sink logit in log2 units) of query head ``head``: 0 and -inf where absent."""
    slope = 0.0
    if alibi_slopes_ptr is not None:
        slope = gl.load(alibi_slopes_ptr + head).to(gl.float32)
    sink_log2 = float("-inf")
    if sinks_ptr is not None:
        sink_log2 = gl.load(sinks_ptr + head).to(gl.float32) * LOG2E
    return slope, sink_log2


@gluon.jit
def _queries_to_shared(q_ptr, q_start, q_len, row_lo, head, num_tokens, stride_q_t, stride_q_h, dtype: gl.constexpr,
                       HEAD: gl.constexpr, BLOCK_M: gl.constexpr, NUM_WARPS: gl.constexpr):
    """The Q tile (rows ``row_lo ..`` of the sequence's queries, one head) in shared memory in the
    wgmma operand layout; rows past the sequence or outside q read as zeros."""
    COL_THREADS: gl.constexpr = HEAD // 8
    ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // COL_THREADS, COL_THREADS], [NUM_WARPS, 1], [1, 0])
    rows = row_lo + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld_l))
    offs_d = gl.arange(0, HEAD, layout=gl.SliceLayout(0, ld_l))
    token = (q_start + rows).to(gl.int64)
    row_ok = (rows < q_len) & (token >= 0) & (token < num_tokens)
    q = gl.load(q_ptr + token[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :], mask=row_ok[:, None],
                other=0.0)
    return gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD], gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD],
                                                                                                dtype), q)


@gluon.jit(do_not_specialize=["num_seqs", "num_tokens", "num_blocks", "max_blocks_per_seq", "min_q_len", "first_seq",
                              "sliding_window", "num_prefix_ranges"])
def prefill_gluon_kernel(
    out_ptr,  # [num_tokens, num_q_heads, HEAD] q's dtype
    lse_ptr,  # [num_tokens, num_q_heads] fp32, or None
    q_ptr,  # [num_tokens, num_q_heads, HEAD]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, PAGE_SIZE, num_kv_heads, HEAD], the same strides
    k_desc, v_desc,  # host TMA descriptors over the two caches (TMA_BOX > 0), else the caches again
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr,  # [num_seqs, max_blocks_per_seq], [num_seqs], [num_seqs + 1]
    alibi_slopes_ptr, sinks_ptr,  # [num_q_heads] each, or None
    prefix_ranges_ptr,  # [num_seqs, num_prefix_ranges, 2] int32, or None
    stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
    stride_c_b, stride_c_s, stride_c_h, stride_bt_s, stride_pr_s, stride_pr_r,
    scale, softcap, sliding_window, num_prefix_ranges,
    num_seqs, num_tokens, num_blocks, max_blocks_per_seq, min_q_len, first_seq,
    NUM_QUERIES_PER_KV: gl.constexpr, HEAD: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PIPELINED: gl.constexpr,
    OVERLAP: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr, GROUP_SIGNAL: gl.constexpr,
    Q_IN_REGS: gl.constexpr, PAIRED: gl.constexpr, COPY_ROWS: gl.constexpr, TMA_BOX: gl.constexpr,
    SPLIT_EMPTY: gl.constexpr, THREAD_RELEASE: gl.constexpr,
    USE_SOFTCAP: gl.constexpr, ALIBI_MODE: gl.constexpr, USE_WINDOW: gl.constexpr, HAS_PREFIX: gl.constexpr,
):
    """out = softmax(scale * q k^T + causal mask) v for one Q tile of one head (see the module docstring),
    with the score modifiers of ``ops.common.attention_math``: a softcap (USE_SOFTCAP), ALiBi
    (ALIBI_MODE 1 linear, 2 sqrt; slopes per query head), a sliding window (USE_WINDOW:
    ``sliding_window`` keys up to and including the query's position), sinks (a logit per query
    head), prefix ranges (HAS_PREFIX: a query and a key of one range see each other).

    BLOCK_M = 16 * num_warps * NUM_CONSUMERS rows (one warpgroup per 64). NUM_CONSUMERS = 2: the
    tile's two halves run in two consumer partitions of num_warps warps (the second capped at
    CONSUMER_REGS registers), which sync only through the ring's barriers, so one half's softmax
    can run while the other's wgmma do. The grid's sequences are ``first_seq, first_seq + 1,
    ...``; sequences with fewer than ``min_q_len`` queries are left to the Q-block kernels.
    """
    NUM_WARPS: gl.constexpr = gl.num_warps()
    WG_ROWS: gl.constexpr = 16 * NUM_WARPS  # the rows of one consumer partition
    BLOCK_M: gl.constexpr = WG_ROWS * NUM_CONSUMERS
    gl.static_assert(NUM_WARPS % 4 == 0, "the default partition is whole warpgroups")
    gl.static_assert(NUM_STAGES >= 2, "the ring needs two slots")
    gl.static_assert(not SPLIT_EMPTY or (OVERLAP and not PAIRED), "K released apart from V: the overlapped loop")
    gl.static_assert(BLOCK_N % (32 * PRODUCER_WARPS // (HEAD // 8)) == 0, "BLOCK_N: whole rows of the copy layout")
    gl.static_assert((COPY_ROWS == BLOCK_N) | ((BLOCK_N % COPY_ROWS == 0) & (COPY_ROWS % (4 * PRODUCER_WARPS) == 0)
                                               & (HEAD % 64 == 0)), "COPY_ROWS: whole passes of 64-column pieces")
    dtype: gl.constexpr = k_cache_ptr.dtype.element_ty

    head = gl.program_id(0)
    seq = gl.program_id(1) + first_seq
    if seq >= num_seqs:
        return
    m_block = gl.num_programs(2) - 1 - gl.program_id(2)  # the heaviest Q tile first
    q_start = gl.load(query_start_loc_ptr + seq)
    q_len = gl.load(query_start_loc_ptr + seq + 1) - q_start
    row_lo = m_block * BLOCK_M
    if (q_len < min_q_len) | (row_lo >= q_len):
        return
    seq_len = gl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # query j sits at position context_len + j
    kv_head = head // NUM_QUERIES_PER_KV
    p_first = context_len + row_lo
    p_last = gl.minimum(p_first + BLOCK_M, seq_len) - 1
    pr_row = seq_lens_ptr  # an int32 pointer never read without HAS_PREFIX (a jit tuple holds no None)
    if HAS_PREFIX:
        pr_row = prefix_ranges_ptr + seq.to(gl.int64) * stride_pr_s
    kv_hi, t_lo, t_mid_lo, t_mid_hi, n_tiles = _key_tiles(p_first, p_last, seq_len, sliding_window, pr_row,
                                                          num_prefix_ranges, stride_pr_r, BLOCK_N, USE_WINDOW,
                                                          HAS_PREFIX)
    slope, sink_log2 = _head_terms(alibi_slopes_ptr, sinks_ptr, head)
    mods = (scale, softcap, slope, sliding_window, pr_row, num_prefix_ranges, stride_pr_r)
    FEATURES: gl.constexpr = (USE_SOFTCAP, ALIBI_MODE, USE_WINDOW, HAS_PREFIX)

    q_smem = _queries_to_shared(q_ptr, q_start, q_len, row_lo, head, num_tokens, stride_q_t, stride_q_h, dtype, HEAD,
                                BLOCK_M, NUM_WARPS)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD], dtype)
    k_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD], kv_layout)
    v_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD], kv_layout)
    # a noinc arrive per producer thread, or the partition's one arrive (GROUP_SIGNAL)
    READY_ARRIVALS: gl.constexpr = 1 if GROUP_SIGNAL else 32 * PRODUCER_WARPS
    # the consumers fence the async proxy after each ring wait unless the producer fenced its
    # copies before signalling them (GROUP_SIGNAL 2; 1 keeps both fences, the form ConSan ran)
    # or TMA writes the ring (through the async proxy; its cp.async tail tiles signal as GROUP_SIGNAL 1)
    CONSUMER_FENCE: gl.constexpr = (GROUP_SIGNAL != 2) & (TMA_BOX == 0)
    # a release: the partition's one arrive, or every consumer thread's (THREAD_RELEASE)
    EMPTY_ARRIVALS: gl.constexpr = NUM_CONSUMERS * (32 * NUM_WARPS if THREAD_RELEASE else 1)
    k_ready, v_ready, empties = _ring_barriers(NUM_STAGES, READY_ARRIVALS, EMPTY_ARRIVALS, SPLIT_EMPTY)
    fence_async_shared()  # the queries and the barriers' initialization, before any async-proxy use

    bt_row_ptr = block_table_ptr + seq.to(gl.int64) * stride_bt_s
    # (the partitions' (function, arguments) pairs are written out in each branch: the JIT takes
    # no function as a value)
    if NUM_CONSUMERS == 1:
        gl.warp_specialize([
            (_consumer, (q_smem, k_bufs, v_bufs, k_ready, v_ready, empties, out_ptr, lse_ptr, stride_o_t, stride_o_h,
                         stride_lse_t, stride_lse_h, head, q_start, q_len, row_lo, context_len, num_tokens, t_lo,
                         t_mid_lo, t_mid_hi, n_tiles, scale, mods, sink_log2, WG_ROWS, BLOCK_N, NUM_STAGES, NUM_WARPS,
                         PIPELINED, OVERLAP, PAIRED, Q_IN_REGS, FEATURES, CONSUMER_FENCE, SPLIT_EMPTY, THREAD_RELEASE)),
            (_producer, (k_cache_ptr, v_cache_ptr, k_desc, v_desc, bt_row_ptr, k_bufs, v_bufs, k_ready, v_ready,
                         empties, kv_head, t_lo, n_tiles, kv_hi, num_blocks, max_blocks_per_seq, stride_c_b,
                         stride_c_s, stride_c_h, HEAD, PAGE_SIZE, BLOCK_N, NUM_STAGES, PRODUCER_WARPS, GROUP_SIGNAL,
                         COPY_ROWS, TMA_BOX, SPLIT_EMPTY)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])
    else:
        # both halves walk every tile of the whole tile's range (the ring's protocol), the mask
        # and the row maxima keep each half's rows right
        gl.warp_specialize([
            (_consumer, (q_smem.slice(0, WG_ROWS), k_bufs, v_bufs, k_ready, v_ready, empties, out_ptr, lse_ptr,
                         stride_o_t, stride_o_h, stride_lse_t, stride_lse_h, head, q_start, q_len, row_lo,
                         context_len, num_tokens, t_lo, t_mid_lo, t_mid_hi, n_tiles, scale, mods, sink_log2, WG_ROWS,
                         BLOCK_N, NUM_STAGES, NUM_WARPS, PIPELINED, OVERLAP, PAIRED, Q_IN_REGS, FEATURES,
                         CONSUMER_FENCE, SPLIT_EMPTY, THREAD_RELEASE)),
            (_producer, (k_cache_ptr, v_cache_ptr, k_desc, v_desc, bt_row_ptr, k_bufs, v_bufs, k_ready, v_ready,
                         empties, kv_head, t_lo, n_tiles, kv_hi, num_blocks, max_blocks_per_seq, stride_c_b,
                         stride_c_s, stride_c_h, HEAD, PAGE_SIZE, BLOCK_N, NUM_STAGES, PRODUCER_WARPS, GROUP_SIGNAL,
                         COPY_ROWS, TMA_BOX, SPLIT_EMPTY)),
            (_consumer, (q_smem.slice(WG_ROWS, WG_ROWS), k_bufs, v_bufs, k_ready, v_ready, empties, out_ptr,
                         lse_ptr, stride_o_t, stride_o_h, stride_lse_t, stride_lse_h, head, q_start, q_len,
                         row_lo + WG_ROWS, context_len, num_tokens, t_lo, t_mid_lo, t_mid_hi, n_tiles, scale, mods,
                         sink_log2, WG_ROWS, BLOCK_N, NUM_STAGES, NUM_WARPS, PIPELINED, OVERLAP, PAIRED, Q_IN_REGS,
                         FEATURES, CONSUMER_FENCE, SPLIT_EMPTY, THREAD_RELEASE)),
        ], [PRODUCER_WARPS, NUM_WARPS], [PRODUCER_REGS, CONSUMER_REGS])

    _invalidate_ring(k_ready, v_ready, empties, NUM_STAGES, SPLIT_EMPTY)
