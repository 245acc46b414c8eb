"""Launcher of the Gluon prefill kernel (sm90): which calls it serves, grid, keyword arguments.

Compiled for sm90 only; ``use_gluon_prefill`` says which calls take it (docs/perf-notes.md has
the H200 timings behind that rule). The contract is ``launch_prefill``'s for a paged cache: the
same ``AttentionArgs``, the sequences ``seqs = (first, end)`` of the grid, ``min_q_len`` (shorter
sequences are left to the Q-block kernels), out and lse rows of the sequences' queries written
and no other.

Triton's Gluon (``triton.experimental.gluon``) is imported only when a kernel is needed, so
that pagedattn imports where it is missing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pagedattn.ops.common.bundles import AttentionArgs
from pagedattn.ops.common.device import environ_value
from pagedattn.ops.common.gluon import (
    GLUON_DTYPES,
    GLUON_OFF,
    aligned,
    load_kernel,
    on_sm9x,
    required,
    unavailable_reason,
)
from pagedattn.ops.common.host_math import cdiv
from pagedattn.ops.common.launching import launch
from pagedattn.ops.prefill.launch import q_tiles_fit

GLUON_PREFILL_ENV = "PAGEDATTN_PREFILL_GLUON"
GLUON_HEAD_SIZES = (64, 128, 256)
# the head sizes the automatic rule sends to the kernel: those timed on the H200 (head 256 compiles
# for sm90 without spills and is served with PAGEDATTN_PREFILL_GLUON=1; it passed the GPU suite on the H200, untimed)
GLUON_AUTO_HEAD_SIZES = (64, 128)
GLUON_MIN_PAGE = 16


@dataclass(frozen=True)
class GluonPrefillConfig:
    """A CTA: ``block_m`` query rows (16 per consumer warp: 64 = one warpgroup, 128 = two),
    ``block_n`` keys a step, a ring of ``num_stages`` K/V tile pairs, a producer partition of
    ``producer_warps`` warps capped at ``producer_regs`` registers a thread; ``pipelined``: the
    consumer's loop software-pipelined by one tile (``False``: the loop measured first on the
    H200, kept for the comparison); ``overlap``: P V of a tile in flight during the next tile's
    softmax too; ``group_signal``: the producer completes each tile's copies through cp.async
    commit groups (one tile in flight) and arrives on the ready barriers with a plain arrive,
    the form Triton's ConSan (``TRITON_INSTRUMENTATION_MODE=consan``) can follow; the default,
    ``cp.async.mbarrier.arrive.noinc``, keeps every ring slot's copies in flight at once, and
    ConSan in triton 3.6 counts cp.async as done only at a ``wait_group``; ``q_in_regs``: each
    consumer loads its Q rows into registers once and every ``S = Q K^T`` takes them as its A
    operand, so the wgmma reads only K from shared memory (an m64n64k16 step that reads both
    reads 4 KB for 32 tensor-core cycles, shared memory's whole 128 B a cycle)."""

    block_m: int = 128
    block_n: int = 64
    num_stages: int = 3
    producer_warps: int = 4  # one warp's 64 rows of 64-bit addresses spill at any register cap up to 96
    producer_regs: int = 64  # 56 spills 12 B at pages of 64 or more
    pipelined: bool = True  # the next tile's S = Q K^T issued before this tile's softmax
    overlap: bool = False  # with pipelined: this tile's P V also runs during the next tile's softmax
    split_consumers: bool = False  # the two 64-row halves in two partitions (block_m 128 only)
    consumer_regs: int = 208  # the second consumer partition's register cap (split_consumers)
    group_signal: bool = False  # tiles' copies completed through commit groups (for ConSan)
    lagged_signal: bool = False  # with group_signal: two tiles in flight; the producer fences, not the consumers
    q_in_regs: bool = False  # Q as the register A operand of S = Q K^T (heads up to 128)
    paired: bool = False  # mask-free key tiles two at a time: one softmax step and O rescale a pair (overlap)
    copy_rows: int = 0  # the producer's cp.async copies of a tile, this many rows a pass (0: the whole tile at once)
    tma: bool = False  # with group_signal: tiles of keys all before the range's end copied by TMA, a box a page
    split_release: bool = False  # with overlap: a K slot refilled once its scores are done, V's after P V
    thread_release: bool = False  # every consumer thread arrives on a slot's release (no bar.sync of the partition)

    def for_head(self, head_size: int) -> "GluonPrefillConfig":
        """This config at ``head_size``: past head 128 the key tile is 32 keys. At head 256 and 64
        keys a consumer holds a [64, 256] fp32 O and a [64, 64] score tile and spills 200 B on
        sm90 (2 stages: 197 KB of shared memory); at 32 keys and 3 stages it compiles without
        spills (193 / 198 / 61 registers, 164 KB), and with every score modifier at once spills
        4-8 B (207 / 206 / 56 registers; with the second consumer at 224 and the producer at 56
        still 4-8 B: not register pressure). Q stays in shared memory past head 128 (in
        registers it would take 64 more a thread)."""
        if head_size > 128 and (self.block_n > 32 or self.q_in_regs or self.paired or self.tma):
            return dataclasses.replace(self, block_n=min(self.block_n, 32), q_in_regs=False, paired=False,
                                       num_stages=min(self.num_stages, 3), tma=False)
        return self

    @property
    def ring_signal(self) -> int:
        """The kernel's GROUP_SIGNAL: 0 ``noinc`` arrivals, 1 commit groups, 2 commit groups one
        tile late."""
        return (2 if self.lagged_signal else 1) if self.group_signal else 0

    @property
    def pass_rows(self) -> int:
        """The kernel's COPY_ROWS: the rows of a tile's cp.async copies a pass (the whole tile by default)."""
        return min(self.copy_rows or self.block_n, self.block_n)

    @property
    def num_consumers(self) -> int:
        return 2 if self.split_consumers else 1

    @property
    def num_warps(self) -> int:
        """The default partition's warps (the launch's num_warps)."""
        return self.block_m // 16 // self.num_consumers


# two consumer warpgroups of 64 rows in two partitions, each loop pipelined by one tile with P V
# beside the next tile's softmax, 64 keys a step, 3 stages, Q as the register A operand of
# S = Q K^T at heads 64 and 128: the fastest of the variants at every prefill and extend point
# timed on the H200 (with Q read from shared memory by every wgmma instead, the same kernel ran
# 1.01-1.12x longer at S >= 2048 in one run beside vLLM's FA3; docs/perf-notes.md, the Gluon
# prefill entry, has the timings and each variant's registers and shared memory)
GLUON_PREFILL_CONFIG = GluonPrefillConfig(split_consumers=True, overlap=True, q_in_regs=True)
# FA3's tile on sm90, 128 keys a step (which halves the per-key cost of O's rescale, the ring's
# waits and the row maxima), copied by TMA: the producer needs no per-row addresses, so the
# consumers get 232 registers each. Two changes made it pay on the H200 (Nsight Compute, S=8192;
# docs/perf-notes.md): K's ring slot released once its scores are waited for and V's after its
# P V (split_release: without it the consumers spent a quarter of their samples waiting for K,
# and the variant ran 1.05-1.12x the 64-key default's time; with it 0.84-0.90x that), and a
# producer of one warp (from four warps each TMA box cost an election, a vote and a barrier of
# the four: 538 instructions a tile in each, 30% of the kernel's). Its tail tile's cp.async copies
# go 8 rows a pass (at 32, 48 registers spill). A ring of 3 (229 KB of shared memory) and the
# split release at 64 keys (1.00-1.07x the time of the same ring without it) were timed and
# dropped
TMA128_EARLYK_1W = dataclasses.replace(GLUON_PREFILL_CONFIG, group_signal=True, tma=True, block_n=128, num_stages=2,
                                       producer_warps=1, producer_regs=48, consumer_regs=232, copy_rows=8,
                                       split_release=True)
# the same with a slot released by an arrive of every consumer thread instead of the partition's
# one arrive, which Triton lowers as a bar.sync of the partition first (Nsight Compute on
# tma128-earlyk-1w: 41% of the stall samples at barriers, the arrive's the largest); compiled for
# sm_90a each consumer warpgroup keeps one bar.sync a tile (before its K wait) of three, and its
# stall samples at barriers fell to 34.5%. On the H200, same run: 0.96-0.99x tma128-earlyk-1w's
# time on S=2048 and 8192, the extend and the chunk prompts, 0.91x at S=32768. At 64-key tiles the
# same release ran 1.00-1.05x the default's time and was dropped
TMA128_THREADS = dataclasses.replace(TMA128_EARLYK_1W, thread_release=True)
# what PAGEDATTN_PREFILL_GLUON may ask for: 1 the default config for every call the kernel
# serves, 0 the portable kernel everywhere, or a variant kept for a same-run comparison
GLUON_PREFILL_CONFIGS = {"1": GLUON_PREFILL_CONFIG, "split": GluonPrefillConfig(split_consumers=True),
                         "pipelined": GluonPrefillConfig(), "serial": GluonPrefillConfig(pipelined=False),
                         # the default with the ready barriers signalled in the form ConSan follows
                         "groups": dataclasses.replace(GLUON_PREFILL_CONFIG, group_signal=True),
                         # the same one tile late, two tiles' copies in flight: the producer waits for and
                         # fences tile j - 1 after issuing tile j, and the consumers drop the proxy fence
                         # (a MEMBAR.ALL.CTA and FENCE.VIEW.ASYNC.S) after each of their two ring waits a
                         # tile. The tile in flight unsignalled takes a slot, so the ring has one more: at 3
                         # stages it ran 1.09-1.16x the default's time on the H200 (the consumers waiting on
                         # a ring one tile shallower); at 4 it keeps the default's depth ahead of them, and ran
                         # 0.99-1.03x the default's time
                         "lagged": dataclasses.replace(GLUON_PREFILL_CONFIG, group_signal=True, lagged_signal=True,
                                                       num_stages=4),
                         # the default with a deeper ring (4 tiles of 64 keys, 164 KB of shared memory at head
                         # 128, no spills): level with the default on the H200 (S=8192 1246.7 against 1248.0 us;
                         # 5 tiles 1259.7), so the ring's depth is not what limits it. (Loading a tile's block
                         # ids before the wait for its slot ran 1.03-1.09x the default's time.)
                         "stages4": dataclasses.replace(GLUON_PREFILL_CONFIG, num_stages=4),
                         # the default with the producer's copies by TMA (one thread issues a box of a page's
                         # keys x 64 columns, where 128 threads issue 16 cp.async each and their addresses),
                         # and the consumers without their proxy fences; the tile that reaches the range's
                         # end keeps the masked cp.async copies (signalled as "groups"); heads 64 and 128:
                         # 0.97-1.00x the default's time on the H200 (S=2048 95.2 against 97.7 us, S=8192
                         # 1247.6 against 1248.0, the traffic's chunk prompts 499.7 against 515.5), one run
                         "tma": dataclasses.replace(GLUON_PREFILL_CONFIG, group_signal=True, tma=True),
                         # the split release (K's slot released once its scores are waited for, V's after its
                         # P V; TMA128_EARLYK_1W's) in the form ConSan follows, so the sanitizer checks its
                         # protocol (a K refill racing the consumers' reads of V's slot, or of K's)
                         "groups-earlyk": dataclasses.replace(GLUON_PREFILL_CONFIG, group_signal=True,
                                                              split_release=True),
                         "tma128-earlyk-1w": TMA128_EARLYK_1W,
                         "tma128-threads": TMA128_THREADS,
                         # the default with Q read from shared memory by every S = Q K^T
                         "smemq": dataclasses.replace(GLUON_PREFILL_CONFIG, q_in_regs=False),
                         # the default with the mask-free tiles taken in pairs (128 keys a softmax step from a
                         # ring of six 64-key slots) and Q read from shared memory: level with the default on
                         # the H200 (1240 against 1258 us at S=8192, 98.7 against 98.9 at 2048, 0.95x on an
                         # extend)
                         "pairs-smemq": dataclasses.replace(GLUON_PREFILL_CONFIG, paired=True, num_stages=6,
                                                            q_in_regs=False),
                         # the same with Q in registers. With the producer at 64 registers the second consumer
                         # gets 216, and ptxas spilled one Q fragment (32 B at head 128; it ran 0.92-0.94x the
                         # default on the H200); the producer at 56 leaves it 224: no spills at 16-token pages
                         # (the producer spills 12 B at 64 and more): level with the default on the H200 (S=8192
                         # 1249.0 against 1248.0 us, 1.03x its time at S=2048 and on an extend)
                         "pairs": dataclasses.replace(GLUON_PREFILL_CONFIG, paired=True, num_stages=6, producer_regs=56,
                                                      consumer_regs=224),
                         "0": GLUON_OFF}
# what the automatic rule takes at head 128 (calls with no score modifier): 128-key tiles by TMA,
# K released apart from V, a one-warp producer, slots released by every consumer thread: on the
# H200 beside vLLM's FA3 (same run), S=2048 86.7 against the 64-key default's 97.5 us, S=8192
# 1096.6 / 1251.2, S=32768 15.5 / 19.0 ms, 4 x 512 on 4096 309.0 / 355.0, the traffic's chunk
# prompts 450.5 / 509.8 (0.84-0.97x FA3's speed, the default 0.74-0.81x). Not timed at head 64
# without modifiers, and with score modifiers its consumers spill (1244 B compiled for sm_90a;
# tma128-earlyk-1w 1436 B): those keep GLUON_PREFILL_CONFIG
GLUON_AUTO_CONFIG_HEAD128 = TMA128_THREADS
# the automatic rule's floor: below it the tl kernel was as fast on the H200 (a 512-token prefill:
# 16.8 against 16.6 us), above it the Gluon kernel was faster (2048: 99.6 against 103.9 us; 4 x 512
# on 4096: 360.9 against 382.7; 8192: 1221 against 1347), beside shorter sequences too: with the
# decodes' unified kernel on a second stream, a 2048-token prefill among 63 decodes ran 229.3
# against 229.7 us (CUDA-graph replays) and 2 x 4096 prefills with 2 extends and 16 decodes 1003
# against 1073 (do_bench). With Q in shared memory the first of those had run 226.4 against
# 220.6, and the rule then left such calls to the tl kernel.
GLUON_MIN_QUERY_TOKENS = 2048
GLUON_MIN_QUERY_LEN = 512
# AttentionArgs' score modifiers the kernel computes (any other sends the call to the tl kernel)
GLUON_MODIFIERS = ("sliding_window", "softcap", "alibi_mode", "alibi_slopes", "sinks", "prefix_ranges")


def gluon_kernel():
    """The ``@gluon.jit`` kernel, or None where this Triton has no usable Gluon."""
    return load_kernel("pagedattn.ops.prefill_gluon.kernel", "prefill_gluon_kernel")


def gluon_prefill_requested():
    """What ``PAGEDATTN_PREFILL_GLUON`` asks for, read at each call (cheaply): a config (``1``
    or a variant's name in GLUON_PREFILL_CONFIGS), ``GLUON_OFF`` (``0``), or None (unset or
    any other value: the automatic rule of :func:`use_gluon_prefill`)."""
    return environ_value(GLUON_PREFILL_ENV, GLUON_PREFILL_CONFIGS)


def gluon_prefill_supported(a: AttentionArgs, max_query_len: int,
                            config: GluonPrefillConfig = GLUON_PREFILL_CONFIG) -> str | None:
    """None when the Gluon kernel can serve the prefill launch of this ``paged_attention`` call,
    else the reason it cannot.

    It serves a paged cache of q's dtype (bfloat16 or float16; no fp8), head size 64 or 128,
    pages of a power-of-2 size >= 16, any GQA group, the causal mask with the score modifiers of
    GLUON_MODIFIERS (a sliding window, softcap, ALiBi, sinks, prefix ranges), a positive
    scale, K and V caches of one layout with 16-byte aligned rows. Inputs are assumed to have
    passed ``paged_attention``'s checks.
    """
    reason = unavailable_reason(gluon_kernel())
    if reason is not None:
        return reason
    q, k, v = a.q, a.k_cache, a.v_cache
    if a.block_table is None or k.dim() != 4:
        return "contiguous K/V: the Gluon kernel reads a paged cache"
    if q.dtype not in GLUON_DTYPES:
        return f"q dtype {q.dtype}: the Gluon kernel takes bfloat16 or float16"
    if k.dtype != q.dtype or v.dtype != q.dtype or a.k_scale is not None:
        return f"kv_cache dtype {k.dtype}: the Gluon kernel takes a cache of q's dtype (no fp8)"
    head_size = q.shape[2]
    if head_size not in GLUON_HEAD_SIZES or v.shape[-1] != head_size:
        return f"head_size {head_size} (values {v.shape[-1]}): the Gluon kernel takes {GLUON_HEAD_SIZES}"
    page_size = k.shape[1]
    if page_size < GLUON_MIN_PAGE or page_size & (page_size - 1):
        return f"block_size {page_size}: the Gluon kernel takes a power of 2 >= {GLUON_MIN_PAGE}"
    if not a.causal:
        return "causal=False: the Gluon kernel is causal only"
    others = [m for m in a.score_modifiers() if m not in GLUON_MODIFIERS]
    if others:
        return f"{', '.join(others)}: the Gluon kernel takes no such score modifier"
    if a.alibi_mode and a.alibi_slopes is None:
        return f"alibi_mode {a.alibi_mode} without alibi_slopes"
    if not a.scale > 0:
        return f"scale {a.scale}: the Gluon kernel takes a positive scale"
    if k.stride() != v.stride():
        return f"k_cache strides {tuple(k.stride())} differ from v_cache's {tuple(v.stride())}"
    for name, t, dims in (("k_cache", k, (0, 1, 2)), ("v_cache", v, (0, 1, 2))):
        if not aligned(t, dims):
            return f"{name}: the Gluon kernel needs 16-byte aligned rows (strides {tuple(t.stride())})"
    if not q_tiles_fit(max_query_len, config.block_m):
        return f"max_query_len {max_query_len}: too many {config.block_m}-row Q tiles for the grid"
    return None


def use_gluon_prefill(a: AttentionArgs, max_query_len: int) -> GluonPrefillConfig | None:
    """The Gluon config of this call's prefill launch, or None for the portable kernel.

    On a CUDA GPU of compute capability 9.x, for a call the kernel serves: the config
    ``PAGEDATTN_PREFILL_GLUON`` names, else (unset) GLUON_AUTO_CONFIG_HEAD128 at head 128 and the
    default one at head 64, when the call holds at least
    GLUON_MIN_QUERY_TOKENS query tokens and a sequence of GLUON_MIN_QUERY_LEN or more, a head
    size of GLUON_AUTO_HEAD_SIZES and no score modifier: the modifiers passed the
    GPU suite against the float64 reference, but the one shape timed with them (GPT-OSS's:
    head 64, a 128-key window, sinks; 4096 tokens) ran 139.9 us on the Gluon kernel against
    115.6 on the tl kernel, so only an explicit ``PAGEDATTN_PREFILL_GLUON`` sends them there.
    """
    config = gluon_prefill_requested()
    if config is GLUON_OFF or not on_sm9x(a.q):
        return None
    if config is None:
        if (a.q.shape[0] < GLUON_MIN_QUERY_TOKENS or max_query_len < GLUON_MIN_QUERY_LEN
                or a.score_modifiers() or a.q.shape[2] not in GLUON_AUTO_HEAD_SIZES):
            return None
        config = GLUON_AUTO_CONFIG_HEAD128 if a.q.shape[2] == 128 else GLUON_PREFILL_CONFIG
    return config if gluon_prefill_supported(a, max_query_len, config) is None else None


def _page_descriptor(cache: torch.Tensor, box: int):
    """A host TMA descriptor over a paged cache ``[num_blocks, page, num_kv_heads, head]`` (its
    own strides, 16-byte aligned as ``gluon_prefill_supported`` checked) with boxes of ``box``
    keys of one head x 64 columns, 128 bytes: the swizzle width of the ring's layout. A block id
    outside ``[0, num_blocks)`` is out of the descriptor's bounds, which TMA fills with zeros."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=cache.element_size() * 8, rank=4)
    return TensorDescriptor(cache, list(cache.shape), list(cache.stride()), [1, box, 1, 64], layout)


def launch_prefill_gluon(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    a: AttentionArgs,
    *,
    max_query_len: int,
    min_q_len: int = 0,
    seqs: tuple[int, int] | None = None,
    config: GluonPrefillConfig = GLUON_PREFILL_CONFIG,
) -> None:
    """``launch_prefill`` over the paged cache for the Gluon kernel (``gluon_prefill_supported``
    must have said None).

    ``out`` ``[num_tokens, num_q_heads, head_size]`` q's dtype and ``lse`` ``[num_tokens,
    num_q_heads]`` float32 or None: the rows of sequences ``seqs = (first, end)`` (default: all)
    with at least ``min_q_len`` queries are written. ``config`` is taken at q's head size
    (``GluonPrefillConfig.for_head``).
    """
    kernel = required(gluon_kernel())
    config = config.for_head(a.q.shape[2])
    q, k, v, pr = a.q, a.k_cache, a.v_cache, a.prefix_ranges
    num_seqs = a.seq_lens.shape[0]
    first, end = (0, num_seqs) if seqs is None else seqs
    if q.shape[0] == 0 or end <= first or max_query_len == 0:
        return
    num_q_heads = q.shape[1]
    grid = (num_q_heads, end - first, cdiv(max_query_len, config.block_m))  # the tl kernel's launch order
    tma_box, k_desc, v_desc = 0, k, v
    if config.tma:
        tma_box = min(k.shape[1], config.block_n)  # a page, or a tile's part of a longer page
        k_desc, v_desc = _page_descriptor(k, tma_box), _page_descriptor(v, tma_box)
    launch(kernel, grid,
           out_ptr=out, lse_ptr=lse, q_ptr=q, k_cache_ptr=k, v_cache_ptr=v, block_table_ptr=a.block_table,
           seq_lens_ptr=a.seq_lens, query_start_loc_ptr=a.query_start_loc,
           alibi_slopes_ptr=a.alibi_slopes if a.alibi_mode else None, sinks_ptr=a.sinks, prefix_ranges_ptr=pr,
           stride_q_t=q.stride(0), stride_q_h=q.stride(1), stride_o_t=out.stride(0), stride_o_h=out.stride(1),
           stride_lse_t=lse.stride(0) if lse is not None else 0, stride_lse_h=lse.stride(1) if lse is not None else 0,
           stride_c_b=k.stride(0), stride_c_s=k.stride(1), stride_c_h=k.stride(2),
           stride_bt_s=a.block_table.stride(0), stride_pr_s=pr.stride(0) if pr is not None else 0,
           stride_pr_r=pr.stride(1) if pr is not None else 0,
           scale=a.scale, softcap=float(a.softcap or 0.0), sliding_window=int(a.sliding_window or 0),
           num_prefix_ranges=pr.shape[1] if pr is not None else 0,
           num_seqs=num_seqs, num_tokens=q.shape[0], num_blocks=k.shape[0],
           max_blocks_per_seq=a.block_table.shape[1], min_q_len=min_q_len, first_seq=first,
           NUM_QUERIES_PER_KV=num_q_heads // k.shape[2], HEAD=q.shape[2], PAGE_SIZE=k.shape[1],
           BLOCK_N=config.block_n, NUM_STAGES=config.num_stages, PRODUCER_WARPS=config.producer_warps,
           PRODUCER_REGS=config.producer_regs, PIPELINED=config.pipelined, OVERLAP=config.overlap,
           NUM_CONSUMERS=config.num_consumers, CONSUMER_REGS=config.consumer_regs,
           GROUP_SIGNAL=config.ring_signal, Q_IN_REGS=config.q_in_regs, PAIRED=config.paired and config.overlap,
           COPY_ROWS=config.pass_rows, TMA_BOX=tma_box, SPLIT_EMPTY=config.split_release,
           THREAD_RELEASE=config.thread_release, k_desc=k_desc, v_desc=v_desc,
           USE_SOFTCAP=bool(a.softcap),
           ALIBI_MODE=int(a.alibi_mode),
           USE_WINDOW=bool(a.sliding_window and a.sliding_window > 0), HAS_PREFIX=pr is not None,
           num_warps=config.num_warps)
