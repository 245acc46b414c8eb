"""Host-side planning: which path runs a batch, with which tiles, and the workspaces it needs.

An engine builds one :class:`AttentionPlan` per step with :func:`plan_attention` (from host
metadata; it may synchronize once if given device tensors) and passes it to every layer's
``paged_attention(..., plan=plan)``, which then allocates nothing and never synchronizes.

The path rule (``path="auto"``):

* If some sequence has at least ``PREFILL_MIN_QUERY_LEN`` queries, those sequences run the
  large-tile prefill kernel and the others the unified kernel, in one call ("prefill").
* Long queries (``max_query_len > SPLIT_KV_MAX_QUERY_LEN``) take the unified ("2D") path: the
  Q blocks of the prefill/extend tokens already give the GPU enough programs.
* A decode batch of unequal lengths (one or a few long contexts among short ones: the uniform
  rule below would leave a long sequence in pieces over twice the even share of the keys) runs
  the persistent kernel with a work list made for it: the long sequences cut into items of about
  the even share for ``UNEQUAL_WAVES`` waves, the short ones whole, one launch of
  ``PERSISTENT_PROGRAMS_PER_SM`` programs per SM (``persistent_work_list``).
* Otherwise count the 2D grid, ``programs_2d = num_q_blocks * num_kv_heads``. If it reaches
  ``RESIDENT_PROGRAMS_PER_SM * num_sms`` (one full wave of decode programs) 2D runs.
  If not, split each sequence's keys into ``num_splits = min(FILL_MAX_SPLITS,
  (RESIDENT_PROGRAMS_PER_SM * num_sms) // programs_2d)`` segments: at most one wave, and a
  sequence cut in at most 32 pieces (the merge and each program's fixed start cost grow with the
  pieces). If that leaves segments longer than ``LONG_SEGMENT_TOKENS`` in a wave filled to
  less than ``FULL_WAVE_FILL`` (or in one split), cut ``MANY_WAVES_SEGMENT_TOKENS``-key segments
  instead (many waves of long programs). Short
  contexts do not split unless the 2D grid leaves most SMs idle: splitting needs
  ``programs_2d * RESIDENT_PROGRAMS_PER_SM * SPLIT_COST_TOKENS < num_sms * (max_seq_len -
  SPLIT_COST_TOKENS)`` (on 132 SMs: no split at 256 keys; at 512 keys up to 44 programs, at 1024
  up to 132). At most
  ``ceil(max_seq_len / MIN_SEGMENT_TOKENS)`` splits (a segment streams enough keys to amortize
  writing and merging its partial) and ``MAX_SPLITS``; one split means 2D, except that a pure
  decode batch whose programs read at least ``LONG_DECODE_TOKENS`` keys runs the same items in
  the persistent kernel (that constant's comment says why). The persistent path's work list (``persistent_work_list``) applies the same rule per Q block. The constants come from H200 split-count sweeps (docs/perf-notes.md, "Decode tiles and splits"):
  a grid of 1.3-1.5 waves of long programs lost 15-25% to one of 0.65-1 wave; batch 1 preferred
  32 splits to 40-49 by 8%; 2.5+ waves of 2048-key segments beat an under-filled single wave of
  8192-key ones by 14%; below ``SPLIT_COST_TOKENS``' bound the 2D kernel won by 4-36% (B=16 at
  256 keys 11.2 against 14.8 us, B=24 at 512 keys 18.5 against 25.0).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from pagedattn._streams import side_stream
from pagedattn.ops.common.device import current_stream_handle, interpreter_on
from pagedattn.ops.common.host_math import cdiv, next_power_of_2
from pagedattn.ops.common.launching import Tapes
from pagedattn.ops.common.target import TargetProps, fit_tiles, target_props
from pagedattn.ops.common.tiles import Tiles

SPLIT_KV_MAX_QUERY_LEN = 8
RESIDENT_PROGRAMS_PER_SM = 3  # decode tiles (16 x 64 keys, 4 warps, 3 stages): 146 regs, 72 KB smem
FILL_MAX_SPLITS = 32  # the one-wave split count is capped here
LONG_SEGMENT_TOKENS = 4096
MANY_WAVES_SEGMENT_TOKENS = 2048
# A one-wave split count that fills this share of the wave keeps its long segments: H200, 8 KV
# heads, B=8 L=32768 6 splits 259.5 against 16 splits 274.7 us, B=16 L=16384 3 against 8 260.5 /
# 275.3, B=4 L=65536 12 against 32 260.4 / 274.7, B=16 L=32768 505 / 519, B=24 L=32768 (2 splits)
# 761.8 / 760.7; an under-filled wave (B=8 L=32768 at 4 splits, 0.65 of it: 299) still loses.
FULL_WAVE_FILL = 0.9
MIN_SEGMENT_TOKENS = 128
# What splitting costs beyond the 2D kernel (the merge launch, the partials' round trip, ~5 us on
# the H200), in keys one 2D program streams in that time: B=1 decodes ran 8.3 us at 256 keys and
# 12.7 at 512 on the 2D kernel, 8.5 at 512 keys in 4 splits.
SPLIT_COST_TOKENS = 256
MAX_SPLITS = 128
INVARIANT_SEGMENT_TOKENS = 1024
PERSISTENT_MAX_SPLITS = 64
# The persistent grid: 3 waves of resident decode programs (9 per SM); programs past the work
# list exit at once. With more items than resident programs, the hardware starts a new program
# as one finishes, which balances items of unequal length; a one-wave grid striding several
# items per program left the longest programs running alone (H200, 2 x 16384 + 126 x 512:
# 364 us on 396 programs, 118 us on 1188).
PERSISTENT_PROGRAMS_PER_SM = 9
# A decode batch is "unequal" when its longest visible length exceeds UNEQUAL_RATIO x the mean
# (per Q block). Its list is cut for UNEQUAL_WAVES waves of items of about equal keys (long
# sequences into up to max_splits pieces, short ones whole), whatever the unsplit item count.
UNEQUAL_RATIO = 2
UNEQUAL_WAVES = 3
# A plan made for one unequal batch caps the persistent kernel at 168 registers per thread, so
# that 3 of its 4-warp programs fit an SM's 64K registers (uncapped: 194, 2 per SM; no spills at
# 168). H200: 2 x 16384 + 126 x 512 119 -> 113 us, 1 x 65536 + 255 x 128 143 -> 128. Plans for
# CUDA graphs keep the compiler's choice: uniform 32 x 4096 lost 135 -> 149 us with the cap.
UNEQUAL_MAX_REGISTERS = 168
# A decode batch of about equal lengths for which the split rule picks 2D (one split) runs the
# persistent kernel on the same items, without the register cap, when its programs are long (at
# least this many visible keys) and persistent_takes_fewer_waves says so. Uncapped, the
# persistent kernel holds 2 programs per SM (194 registers), the 2D kernel 3 (150): with the SMs
# saturated a program at 2 per SM streams 1.5x the bytes per second of one at 3 per SM, so the
# persistent kernel wins where its whole waves are fewer than 1.5x the 2D kernel's. H200, 2D ->
# persistent: 32 x 4096 143 -> 135 us, 64 x 2048 154 -> 136, 64 x 8192 576 -> 489, 128 x 4096
# 519 -> 501, 128 x 8192 1006 -> 957; the rule keeps 2D at 48 x 16384 (722 against 771) and
# 96 x 4096 (369 against 372). With the cap (3 per SM) the lists of 32 and 128 x 4096 took 154
# and 528. Short programs lose (128 x 512: 76 -> 82 us).
LONG_DECODE_TOKENS = 2048
PERSISTENT_UNCAPPED_PROGRAMS_PER_SM = 2
PREFILL_MIN_QUERY_LEN = 128
# short_prefill: up to this many waves of 128-row prefill programs, 64-row tiles at head 128
# (H200, paged, head 128: they won at 1, 2, 3.9 and 7.8 waves and lost 3% at 15.5)
SHORT_PREFILL_WAVES = 8
PATHS = ("auto", "unified", "split_kv", "persistent", "prefill")
SCHEDULES = ("auto", "static", "atomic")
# "auto": the atomic counter when the work list has at least this many items per program.
# On the H200 with the one-wave grid, static striding beat the counter at 0.08, 0.97 and 1.29
# items per program (10.4 vs 15.1, 51.4 vs 54.7, 169.7 vs 183.1 us); the counter is kept for
# lists of several items per program (mixed batches), where striding can leave programs idle.
ATOMIC_MIN_ITEMS_PER_PROGRAM = 2.0




@dataclass
class AttentionPlan:
    """What ``paged_attention(..., plan=plan)`` runs; built by :func:`plan_attention`.

    ``partial_out`` ``[max_num_tokens, num_q_heads, num_splits, head_size]`` fp32 and
    ``partial_lse`` ``[max_num_tokens, num_q_heads, num_splits]`` fp32 are the split-KV
    workspaces (None on the unified path).
    """

    path: str
    tiles: Tiles
    num_splits: int
    segment_size: int  # > 0: fixed tokens per split (batch-invariant mode)
    max_query_len: int
    max_seq_len: int
    max_num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    batch_invariant: bool
    partial_out: torch.Tensor | None
    partial_lse: torch.Tensor | None
    # persistent path only: the device work lists, their capacity and the fixed grid
    work_items: torch.Tensor | None = None  # [max_items, 5] int32: seq, q block, kv head, split, splits
    work_counts: torch.Tensor | None = None  # [3] int32: items, reduce rows, 1 = atomic schedule
    work_counter: torch.Tensor | None = None  # [1] int32 (atomic schedule)
    reduce_rows: torch.Tensor | None = None  # [max_num_tokens, 2] int32: token, splits
    num_programs: int = 0  # the persistent grid
    split_programs: int = 0  # the programs of one wave, which the work list is cut for
    # the programs the kernel holds at once, when fewer than split_programs (0: as many): a
    # uniform batch's split items fill one wave of them
    resident_programs: int = 0
    max_registers: int | None = None  # the persistent kernel's register cap (None: the compiler's choice)
    schedule: str = "auto"
    max_num_seqs: int = 0
    sliding_window: int | None = None
    # prefill path: sequences with at least prefill_min_q_len queries run the large-tile kernel,
    # the others (at most rest_max_query_len queries; 0: none; None: up to prefill_min_q_len - 1) the unified kernel with tiles for
    # that length, so a prefill among decodes leaves the decodes on decode tiles
    prefill_tiles: Tiles | None = None
    prefill_min_q_len: int = 0
    rest_max_query_len: int | None = None
    prefill_seqs: tuple[int, int] | None = None  # [first, end): the sequences holding every long one
    # the batch the plan was made or last updated for: a call with fewer tokens or sequences
    # raises (its work list or grid would address rows the call does not have)
    num_tokens: int = 0
    num_seqs: int = 0
    # persistent path on CUDA: update()'s pinned staging buffers and the event after their copies
    _staging: list | None = field(default=None, repr=False, compare=False)
    _staged: object = field(default=None, repr=False, compare=False)
    # recorded launches of the per-layer call, by input layout (pagedattn.ops.common.launching)
    _tapes: Tapes = field(default_factory=Tapes, repr=False, compare=False)
    # persistent path: (query_start_loc, splits per sequence) of the list update() last uploaded
    _listed: tuple | None = field(default=None, repr=False, compare=False)

    def update(self, query_start_loc, seq_lens) -> None:
        """Re-plan a persistent plan for a new batch in place (same buffers, same grid).

        For CUDA graphs: capture ``paged_attention(..., plan=plan)`` once at the maximum shape,
        then per step write the step's metadata into the captured input buffers, call
        ``plan.update(query_start_loc, seq_lens)`` with the same metadata on the host, and replay.
        Raises ValueError if the batch exceeds the capacity the plan was made for.
        """
        if self.path != "persistent":
            raise ValueError(f"update() re-plans persistent plans only; this plan's path is {self.path!r}")
        qsl, lens = _host_list(query_start_loc), _host_list(seq_lens)
        if len(lens) > self.max_num_seqs or (qsl and qsl[-1] > self.max_num_tokens):
            raise ValueError(
                f"batch of {len(lens)} sequences / {qsl[-1] if qsl else 0} tokens exceeds the plan's capacity "
                f"({self.max_num_seqs} sequences, {self.max_num_tokens} tokens)"
            )
        blocks, splits = work_list_layout(
            qsl, lens, tiles=self.tiles, num_kv_heads=self.num_kv_heads,
            num_programs=self.split_programs or self.num_programs, max_splits=self.partial_out.shape[2],
            sliding_window=self.sliding_window, resident=self.resident_programs or None,
        )
        if self._listed == (qsl, splits):
            # the device already holds this list (steady decode steps: same batch, same splits;
            # the kernels read the lengths from seq_lens): no rebuild, no upload, no wait on the
            # last upload (H200 host, 64 decodes inside vLLM: ~480 us a step otherwise)
            self.max_seq_len = max(lens + [0])
            return
        self._load(qsl, lens, _work_items(blocks, splits, self.num_kv_heads), _reduce_rows(qsl, splits))
        self._listed = (qsl, splits)

    def _load(self, qsl: list[int], lens: list[int], items: torch.Tensor, rows: torch.Tensor) -> None:
        """Upload the work list made for the batch (qsl, lens) and record that batch."""
        if items.shape[0] > self.work_items.shape[0]:
            raise ValueError(f"{items.shape[0]} work items exceed the plan's capacity {self.work_items.shape[0]}")
        atomic = self.schedule == "atomic" or (
            self.schedule == "auto" and items.shape[0] >= ATOMIC_MIN_ITEMS_PER_PROGRAM * self.num_programs)
        self._upload(items, rows, torch.tensor([items.shape[0], rows.shape[0], int(atomic)], dtype=torch.int32))
        q_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
        self.max_query_len = max(q_lens + [0])
        self.max_seq_len = max(lens + [0])
        self.num_tokens = qsl[-1] if qsl else 0
        self.num_seqs = len(lens)
        self._tapes.clear()

    def _upload(self, items: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor) -> None:
        """Write the host work list into the device buffers without waiting for the device.

        On CUDA the lists go through pinned staging buffers and non-blocking copies on the
        current stream, so they land after any replay already enqueued that reads the old lists
        and the host goes on at once (a copy from pageable memory would wait for the stream).
        A non-blocking copy reads the staging buffers when it executes: an event recorded after
        the copies makes the next update wait for them before rewriting (normally long done).
        """
        dst = ((self.work_items, items), (self.reduce_rows, rows), (self.work_counts, counts))
        if self.work_items.device.type != "cuda":
            for buf, src in dst:
                buf[: src.shape[0]].copy_(src)
            return
        if self._staging is None:
            self._staging = [torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True) for buf, _ in dst]
            self._staged = torch.cuda.Event()
        self._staged.synchronize()
        for stage, (buf, src) in zip(self._staging, dst):
            n = src.shape[0]
            stage[:n].copy_(src)
            buf[:n].copy_(stage[:n], non_blocking=True)
        self._staged.record(torch.cuda.current_stream(self.work_items.device))


def _long_sequences(q_lens: list[int], min_q_len: int) -> tuple[int, int]:
    """[first, end): the smallest range of sequences that holds every one with >= min_q_len queries."""
    long = [i for i, n in enumerate(q_lens) if n >= min_q_len]
    return (long[0], long[-1] + 1) if long else (0, 0)


def num_sms(device) -> int:
    """SMs (CUs) of ``device``'s target (:func:`pagedattn.ops.common.target.target_props`; the
    interpreter: 4, a few programs are plenty)."""
    return target_props(device).num_sms


def fitted(tiles: Tiles, target: TargetProps, head_size: int, dtype: torch.dtype,
           kv_dtype: torch.dtype | None = None) -> Tiles:
    """A choice of :func:`pick_tiles` or :func:`pick_prefill_tiles` (the H200's tables) fitted
    into ``target``'s shared memory and warp width (:func:`pagedattn.ops.common.target.fit_tiles`);
    the same tiles wherever they fit, the sm90 GPUs included."""
    q_bytes = dtype.itemsize
    kv_bytes = q_bytes if kv_dtype is None else kv_dtype.itemsize
    return fit_tiles(tiles, target, max(16, next_power_of_2(head_size)), q_bytes, kv_bytes)


def pick_tiles(max_query_len: int, num_queries_per_kv: int, head_size: int, *, fixed: bool = False) -> Tiles:
    """Tile shapes from the shapes alone (``fixed``: independent of the batch, for invariance).

    Decode gets the smallest M that ``tl.dot`` accepts (16), filled by the query heads of one
    KV head; longer queries get 64-row blocks so each K/V tile serves more rows. Decode tiles:
    64 keys, 4 warps, 3 stages (146 registers per thread with 32-bit offsets: 3 programs per SM;
    H200 sweeps in docs/perf-notes.md, "Decode tiles and splits").
    """
    head_size_pad = max(16, next_power_of_2(head_size))
    short = fixed or max_query_len <= 1
    block_m = max(16 if short else 64, next_power_of_2(num_queries_per_kv))
    if not short and max_query_len <= SPLIT_KV_MAX_QUERY_LEN:
        # speculative decode: rows for the longest query only (6 tokens x 4 heads fill 24 of 32
        # rows, not 24 of 64): H200, 16 x 6 at 8192, 216 -> 166 us
        block_m = max(16, min(block_m, next_power_of_2(max_query_len * num_queries_per_kv)))
    block_q = block_m // num_queries_per_kv
    tile_n = 32 if head_size_pad > 128 else 64
    num_warps = 4 if block_m * head_size_pad <= 64 * 128 else 8
    # decode: two tiles in flight (int32 offsets leave the registers); heads past 256 stay at 2 stages
    # (fp32 at head 512: 3 stages of 32-key tiles need ~290 KB of shared memory, over sm90's 227 KB).
    # Speculative decode's 32-row tiles keep 2: 3 need 78 KB of shared memory, two programs per SM, not three.
    num_stages = 3 if (short or block_m == 16) and head_size_pad <= 256 else 2
    if interpreter_on():
        num_warps = 1
    return Tiles(block_m, block_q, tile_n, num_warps, num_stages=num_stages)


def pick_prefill_tiles(head_size: int, dtype: torch.dtype, *, short: bool = False) -> Tiles:
    """Tiles of the large-tile prefill kernel (block_m query rows x tile_n keys), from the H200
    sweeps (docs/perf-notes.md, "Prefill tiles and TMA"; one set for contiguous and paged K/V,
    tuned on contiguous: at head 128 paged K/V preferred the same tiles): 128 x 128 keys at 8
    warps for head 128, 128 x 64
    at 4 warps for head 64 and at 8 warps (2 stages: shared memory) for heads up to 256.

    ``short`` (see :func:`short_prefill`): 64-row tiles, two programs per SM, for heads of 65
    to 128: they halve the grain of the causal triangle's last wave (H200, paged, head 128:
    S=512 21 against 24 us, S=1024 39 against 45, S=2048 111 against 123, S=4096 374 against
    388). At head 64 the 128 x 64 tiles stayed faster (S=2048 70 against
    77 us) and at head 256 64-row tiles lost by 1.6x."""
    head_size_pad = max(16, next_power_of_2(head_size))
    if interpreter_on():
        return Tiles(32, 32, 32, 1, 1)
    if dtype == torch.float32:
        return Tiles(64, 64, 32, 4 if head_size_pad <= 64 else 8, 2)
    if short and head_size_pad == 128:
        return Tiles(64, 64, 64, 4, 3)
    if head_size_pad <= 64:
        return Tiles(128, 128, 64, 4, 3)
    if head_size_pad <= 128:
        return Tiles(128, 128, 128, 8, 3)
    return Tiles(128, 128, 64, 8, 2)


def short_prefill(max_query_len: int, num_seqs: int, num_q_heads: int, sms: int, *, diagonal: bool) -> bool:
    """Whether a prefill's time is set by the tail of its causal triangle: its 128-row grid
    (counted from the longest query, as the grid is) is at most SHORT_PREFILL_WAVES waves of one
    program per SM, and ``diagonal``: its keys are mostly its own queries (the caller's test,
    e.g. at most twice as many keys as queries), so the programs' work grows along the diagonal.
    An extend over a long context has programs of nearly equal work instead, where 128-row tiles
    win by reading each K/V tile for twice the rows.

    The callers count what they know without a sync: a plan the sequences its prefill grid covers,
    an eager call every sequence (the grid's exiting programs included), so the same mixed batch
    may take 64-row tiles through a plan and 128-row tiles eagerly (results then differ in the
    last bits). The rule ignores ``causal`` (the plan does not know it); it was measured causal."""
    programs = cdiv(max_query_len, 128) * num_q_heads * num_seqs
    return diagonal and programs <= SHORT_PREFILL_WAVES * sms


def choose_num_splits(num_q_blocks: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, sms: int,
                      sliding_window: int | None = None) -> int:
    """The module docstring's rule; 1 means the unified path.

    With a sliding window a query sees at most ``sliding_window + max_query_len - 1`` keys, and
    that length (not the sequence's) decides how many segments are worth it.
    """
    if sliding_window:
        max_seq_len = min(max_seq_len, sliding_window + max_query_len - 1)
    if max_query_len > SPLIT_KV_MAX_QUERY_LEN or max_seq_len <= MIN_SEGMENT_TOKENS:
        return 1
    programs_2d = max(1, num_q_blocks * num_kv_heads)
    wave = RESIDENT_PROGRAMS_PER_SM * sms
    if programs_2d >= wave:
        return 1
    if _split_costs_more(programs_2d, max_seq_len, wave, RESIDENT_PROGRAMS_PER_SM):
        return 1  # short contexts: the idle SMs' share of the keys does not pay for the merge
    splits = max(1, min(FILL_MAX_SPLITS, wave // programs_2d))
    full_wave = splits > 1 and programs_2d * splits >= FULL_WAVE_FILL * wave
    if -(-max_seq_len // splits) > LONG_SEGMENT_TOKENS and not full_wave:
        splits = -(-max_seq_len // MANY_WAVES_SEGMENT_TOKENS)
    by_length = -(-max_seq_len // MIN_SEGMENT_TOKENS)
    return max(1, min(splits, by_length, MAX_SPLITS))


def balanced_segment(q_lens, lens, *, block_q: int, tile_n: int, num_kv_heads: int, splits: int, sms: int,
                     sliding_window: int | None) -> int:
    """Keys per split at fixed positions for a decode batch of unequal lengths, or 0 (keep the
    uniform rule).

    The uniform rule cuts every sequence into the same number of pieces of its own length, so
    one long context among many short ones stays one long program (or a few) while the short ones
    finish early: 2 x 16384 among 126 x 512 ran at 4.4x its bytes floor on the H200. Cutting at
    fixed positions every ``segment`` keys instead gives each sequence pieces in proportion to its
    length: ``segment`` is the keys one resident program would stream if the batch's keys were
    shared evenly (at least MIN_SEGMENT_TOKENS, whole tiles). Used when the uniform rule's
    longest piece exceeds twice that share; the grid then also holds empty programs for the
    positions past the short sequences, which exit after their metadata loads. Under
    ``path="auto"`` a nonzero result sends the batch to the persistent kernel's compact work
    list instead (see plan_attention); ``path="split_kv"`` keeps this cut.
    """
    visible = [max(v, 0) for v in lens]
    if sliding_window:
        visible = [min(v, sliding_window + q - 1) for v, q in zip(visible, q_lens)]
    blocks = sum(-(-q // block_q) for q in q_lens if q > 0)
    work = sum(v * -(-q // block_q) for v, q in zip(visible, q_lens) if q > 0) * num_kv_heads
    longest = max([v for v, q in zip(visible, q_lens) if q > 0] + [0])
    if work == 0 or longest <= MIN_SEGMENT_TOKENS or longest * blocks * num_kv_heads <= UNEQUAL_RATIO * work:
        return 0  # equal lengths: the uniform rule's cut (one split of a short context included)
    share = work / (RESIDENT_PROGRAMS_PER_SM * sms)
    segment = max(MIN_SEGMENT_TOKENS, -(-int(share) // tile_n) * tile_n)
    if longest / splits <= 2 * segment:
        return 0
    while -(-longest // segment) > MAX_SPLITS:
        segment *= 2
    return segment


def persistent_takes_fewer_waves(programs: int, sms: int) -> bool:
    """Whether ``programs`` equal decode programs finish sooner in the uncapped persistent kernel
    (2 per SM) than in the 2D kernel (3 per SM): a wave's time grows with the programs sharing
    an SM, so each kernel's time is its waves x its programs per SM; the persistent kernel must
    win by at least half of one of its waves (closer calls keep 2D)."""
    persistent = cdiv(programs, PERSISTENT_UNCAPPED_PROGRAMS_PER_SM * sms) * PERSISTENT_UNCAPPED_PROGRAMS_PER_SM
    two_d = cdiv(programs, RESIDENT_PROGRAMS_PER_SM * sms) * RESIDENT_PROGRAMS_PER_SM
    return persistent <= two_d - PERSISTENT_UNCAPPED_PROGRAMS_PER_SM / 2


def auto_path(max_query_len: int, num_splits: int) -> str:
    """The module docstring's rule, once the split count is known."""
    if max_query_len >= PREFILL_MIN_QUERY_LEN:
        return "prefill"
    return "split_kv" if num_splits > 1 else "unified"


def plan_for_call(num_seqs: int, num_tokens: int, max_query_len: int, max_seq_len: int, *, num_q_heads: int,
                  num_kv_heads: int, head_size: int, dtype: torch.dtype, device: torch.device,
                  sliding_window: int | None) -> AttentionPlan:
    """The plan a call without ``plan=`` runs: the ``"auto"`` rule of :func:`plan_attention` from
    the host maxima alone (no per-sequence lengths: every sequence counted at ``max_query_len``,
    and the prefill kernel's grid covering every sequence). Cached per shape and stream, so that
    repeated calls reuse the split-KV workspaces and the recorded launches."""
    stream = current_stream_handle(device)
    key = (num_seqs, num_tokens, max_query_len, max_seq_len, num_q_heads, num_kv_heads, head_size, dtype, device,
           sliding_window, stream)
    plan = _CALL_PLANS.pop(key, None)
    if plan is None:
        plan = _plan_for_call(num_seqs, num_tokens, max_query_len, max_seq_len, num_q_heads=num_q_heads,
                              num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype, device=device,
                              sliding_window=sliding_window)
        if len(_CALL_PLANS) >= CALL_PLANS_KEPT:
            _CALL_PLANS.pop(next(iter(_CALL_PLANS)))
    _CALL_PLANS[key] = plan  # most recently used last
    return plan


CALL_PLANS_KEPT = 8  # plans (and their split-KV workspaces) kept for calls without a plan
_CALL_PLANS: dict = {}


def _plan_for_call(num_seqs, num_tokens, max_query_len, max_seq_len, *, num_q_heads, num_kv_heads, head_size,
                   dtype, device, sliding_window) -> AttentionPlan:
    group = num_q_heads // num_kv_heads
    target = target_props(device)
    tiles = fitted(pick_tiles(max_query_len, group, head_size), target, head_size, dtype)
    sms = num_sms(device)
    q_blocks = num_seqs * cdiv(max_query_len, tiles.block_q)
    splits = choose_num_splits(q_blocks, num_kv_heads, max_query_len, max_seq_len, sms, sliding_window)
    path = auto_path(max_query_len, splits)
    common = dict(tiles=tiles, segment_size=0, max_query_len=max_query_len, max_seq_len=max_seq_len,
                  max_num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                  head_size=head_size, batch_invariant=False, num_tokens=num_tokens, num_seqs=num_seqs,
                  sliding_window=sliding_window)
    if path == "prefill":
        short = short_prefill(max_query_len, num_seqs, num_q_heads, sms, diagonal=max_seq_len <= 2 * max_query_len)
        # one sequence: the large-tile kernel serves it whatever its length (max_query_len may
        # be a loose bound), so the call is one launch without a unified launch for short ones
        one = num_seqs == 1
        return AttentionPlan(path=path, num_splits=1, partial_out=None, partial_lse=None,
                             prefill_tiles=fitted(pick_prefill_tiles(head_size, dtype, short=short), target,
                                                  head_size, dtype),
                             prefill_min_q_len=0 if one else PREFILL_MIN_QUERY_LEN,
                             rest_max_query_len=0 if one else None, **common)
    partial_out = partial_lse = None
    if path == "split_kv":
        partial_out = torch.empty(num_tokens, num_q_heads, splits, head_size, dtype=torch.float32, device=device)
        partial_lse = torch.empty(num_tokens, num_q_heads, splits, dtype=torch.float32, device=device)
    return AttentionPlan(path=path, num_splits=splits, partial_out=partial_out, partial_lse=partial_lse, **common)


def _host_list(x) -> list[int]:
    if isinstance(x, torch.Tensor):
        return x.tolist()  # Python ints (one sync if x lives on the device)
    return [int(v) for v in x]


def persistent_work_list(qsl, lens, *, tiles: Tiles, num_kv_heads: int, num_programs: int, max_splits: int,
                         sliding_window: int | None = None, resident: int | None = None):
    """(items [n, 5] int32, reduce rows [m, 2] int32) for the persistent kernel.

    Every Q block is one item per KV head, or several (its key range cut in equal segments)
    when its queries are short, the unsplit items would not fill one wave of ``num_programs``
    programs and the contexts are long enough to pay for the reduce (``_split_costs_more``).
    The split-KV rule (module docstring), with that wave: a Q block
    gets its share of the programs, ``floor(visible * num_programs / total visible)`` items per
    KV head (at least one, at most FILL_MAX_SPLITS), so the list holds at most one item per
    program of the wave; if that leaves items over LONG_SEGMENT_TOKENS keys,
    MANY_WAVES_SEGMENT_TOKENS-key items instead; never segments under MIN_SEGMENT_TOKENS.

    An unequal batch (its longest visible length over UNEQUAL_RATIO x the mean per short Q
    block) is cut whatever the unsplit item count, for UNEQUAL_WAVES waves and up to
    ``max_splits`` items per block: the long sequences become many items of about the even
    share and the short ones stay whole, and the grid's later programs take them as earlier
    ones finish (H200, on a grid of 3 waves: 2 x 16384 + 126 x 512 119 us, 1.4x its bytes floor,
    where the one-wave cut left each long piece at 2048 keys beside 512-key items: 364 us).

    Items are block-major, then KV head, then split: (seq, q block, head, split, splits). Reduce
    rows are every token of a split Q block, with its block's split count.

    This runs every engine step (``plan.update()`` before a graph replay), so it works per
    sequence in plain Python and leaves the per-item work to byte copies and a few torch ops:
    a sequence's Q blocks share its split count (they see the same keys), each block's items
    are a memoized template for its split count, and only the sequence and Q block columns are
    written into the joined templates. On a 2-core CPU host: 35-130 us for 1-256 decode
    sequences of equal length (the ~40 small torch ops of a vectorized form took 240-330 us);
    an unequal batch of 256 (100-8000 keys and one of 32768: 4672 items, each sequence's split
    count computed) about 200 us.
    """
    qsl = _int_list(qsl)
    blocks, splits = work_list_layout(qsl, lens, tiles=tiles, num_kv_heads=num_kv_heads, num_programs=num_programs,
                                      max_splits=max_splits, sliding_window=sliding_window, resident=resident)
    return _work_items(blocks, splits, num_kv_heads), _reduce_rows(qsl, splits)


def work_list_layout(qsl, lens, *, tiles: Tiles, num_kv_heads: int, num_programs: int, max_splits: int,
                     sliding_window: int | None = None,
                     resident: int | None = None) -> tuple[list[int], list[int] | None]:
    """(Q blocks per sequence, split count per sequence or None) of :func:`persistent_work_list`:
    everything the list depends on besides ``qsl``, decided without building it."""
    qsl, lens = _int_list(qsl), _int_list(lens)
    q_lens = [b - a for a, b in zip(qsl, qsl[1:])]
    if len(lens) < len(q_lens):
        raise ValueError(f"{len(lens)} sequence lengths for {len(q_lens)} sequences")
    blocks = [-(-q // tiles.block_q) if q > 0 else 0 for q in q_lens]  # Q blocks per sequence
    # None: a full grid of equal items without splitting: no partials to write and merge
    splits = _splits_per_seq(q_lens, blocks, lens, num_kv_heads=num_kv_heads, num_programs=num_programs,
                             max_splits=max_splits, sliding_window=sliding_window, resident=resident,
                             full=sum(blocks) * num_kv_heads >= num_programs)
    return blocks, splits


def _int_list(x) -> list[int]:
    """``x`` as a list of Python ints (numpy ints converted: no int32 overflow in the split
    arithmetic); lists of ints (what ``update()`` passes) as they are."""
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return x if isinstance(x, list) and all(type(v) is int for v in x) else [int(v) for v in x]


def _int32_tensor(values) -> torch.Tensor:
    """A 1-D int32 tensor from a list of ints or native int32 bytes, converted in C: on the host
    ``torch.tensor`` on a list costs ~50 ns per int, ``array`` ~15 ns and bytes one copy."""
    from array import array

    if not values:
        return torch.zeros(0, dtype=torch.int32)
    buf = bytearray(values) if isinstance(values, bytes) else array("i", values)  # "i": 4 bytes
    return torch.frombuffer(buf, dtype=torch.int32)  # shares (and keeps alive) buf, a private copy


def _splits_per_seq(q_lens, blocks, lens, *, num_kv_heads, num_programs, max_splits, sliding_window,
                    full: bool, resident: int | None = None) -> list[int] | None:
    """Each sequence's split count by persistent_work_list's rule (the same for all its Q
    blocks: they see the same keys); 1 for long queries and empty sequences. None when the
    unsplit items fill the grid (``full``) and the batch is not unequal. Comparisons rather than
    min()/max(): 4x faster."""
    visible = [v if v > 0 else 0 for v in lens[: len(q_lens)]]
    if sliding_window:  # a query sees at most the window and the queries before it
        visible = [v if v < sliding_window + q else sliding_window + q - 1 for v, q in zip(visible, q_lens)]
    if all(q == 1 for q in q_lens):  # a decode batch: every sequence one short Q block
        short, keys, short_blocks, longest = None, sum(visible), len(visible), max(visible + [0])
    else:
        short = [0 < q <= SPLIT_KV_MAX_QUERY_LEN for q in q_lens]
        keys = sum(v * nb for v, nb, sh in zip(visible, blocks, short) if sh)
        short_blocks = sum(nb for nb, sh in zip(blocks, short) if sh)
        longest = max([v for v, sh in zip(visible, short) if sh] + [0])
    unequal = longest > MIN_SEGMENT_TOKENS and longest * short_blocks > UNEQUAL_RATIO * keys
    if not unequal and (full or _split_costs_more(short_blocks * num_kv_heads, longest, num_programs,
                                                  PERSISTENT_UNCAPPED_PROGRAMS_PER_SM)):
        return None
    total = max(keys * num_kv_heads, 1)
    # a batch of about equal lengths: at most one item per program the kernel holds at once
    target, cap = (UNEQUAL_WAVES * num_programs, max_splits) if unequal else (resident or num_programs, FILL_MAX_SPLITS)
    # Up to `small` keys the rule gives 1 (a share under 2 items, no long-segment cut): most of
    # an unequal batch, decided by one comparison
    small = min(LONG_SEGMENT_TOKENS, (2 * total - 1) // target)

    def rule(v: int) -> int:
        n = v * target // total  # the block's share of the items, 1..cap
        n = 1 if n < 1 else cap if n > cap else n
        if v > n * LONG_SEGMENT_TOKENS:  # segments over LONG_SEGMENT_TOKENS keys: many waves
            n = -(-v // MANY_WAVES_SEGMENT_TOKENS)
        by_length = -(-v // MIN_SEGMENT_TOKENS)  # no segment under MIN_SEGMENT_TOKENS keys
        n = by_length if n > by_length else n
        n = 1 if n < 1 else n
        return max_splits if n > max_splits else n

    if short is None:
        return [1 if v <= small else rule(v) for v in visible]
    return [rule(v) if sh and v > small else 1 for v, sh in zip(visible, short)]


def _split_costs_more(programs: int, visible: int, wave: int, programs_per_sm: int) -> bool:
    """The split rule's short-context bound: whether ``programs`` unsplit programs of ``visible``
    keys, on a kernel holding ``programs_per_sm`` per SM, leave too few SMs idle for splitting to
    pay (``programs x programs_per_sm x SPLIT_COST_TOKENS >= SMs x (visible - SPLIT_COST_TOKENS)``;
    ``wave`` = RESIDENT_PROGRAMS_PER_SM x SMs). The 2D kernel holds 3 per SM (``choose_num_splits``);
    the persistent kernel 2 (graph plans keep the compiler's 194 registers), so its list leaves
    more short contexts whole. H200 graph replays, one item per block against the cut list:
    16 x 512 18.4 against 23.6 us, 24 x 512 20.2 against 30.4, 16 x 256 12.4 against 15.0; the cut
    list won at 8 x 512 (13.7 against 15.2) and 8 x 1024 (22.0 against 25.8)."""
    return (programs * programs_per_sm * RESIDENT_PROGRAMS_PER_SM * SPLIT_COST_TOKENS
            >= wave * (visible - SPLIT_COST_TOKENS))


def _per_block(per_seq, blocks) -> list:
    """A per-sequence list with each value repeated once per Q block of its sequence."""
    return [v for v, nb in zip(per_seq, blocks) for _ in range(nb)]


_BLOCK_ITEMS: dict[tuple[int, int], bytes] = {}


def _block_items(num_kv_heads: int, n: int) -> bytes:
    """The items of one Q block cut in ``n`` splits, its sequence and Q block left 0: rows
    (0, 0, head, split, n) for every head, then split, as int32 bytes. Memoized: an engine
    sees a few (heads, n) pairs, n <= max_splits; a Q block's items are then a byte copy."""
    data = _BLOCK_ITEMS.get((num_kv_heads, n))
    if data is None:
        from array import array

        data = array("i", [v for h in range(num_kv_heads) for i in range(n) for v in (0, 0, h, i, n)]).tobytes()
        if len(_BLOCK_ITEMS) < 4096:
            _BLOCK_ITEMS[num_kv_heads, n] = data
    return data


def _work_items(blocks, splits, num_kv_heads) -> torch.Tensor:
    """[n, 5] int32 items from the Q blocks and split counts (None: one each) per sequence:
    the blocks' templates joined as bytes, then the sequence and Q block columns written per
    block (one broadcast when every block has the same number of items)."""
    one_each = bool(blocks) and min(blocks) == max(blocks) == 1  # decode: one Q block per sequence
    if splits is None:
        data, per_block = _block_items(num_kv_heads, 1) * sum(blocks), num_kv_heads
    else:
        block_splits = splits if one_each else _per_block(splits, blocks)
        templates = {n: _block_items(num_kv_heads, n) for n in set(block_splits)}
        data = b"".join(map(templates.__getitem__, block_splits))
        per_block = num_kv_heads * next(iter(templates)) if len(templates) == 1 else 0
    if not data:
        return torch.zeros(0, 5, dtype=torch.int32)
    items = _int32_tensor(data).view(-1, 5)
    cols = _block_columns(blocks, one_each)  # [1 or 2, Q blocks]
    if per_block:
        items.view(-1, per_block, 5)[:, :, : len(cols)] = cols.t().unsqueeze(1)
    else:
        counts = _int32_tensor(block_splits) * num_kv_heads
        for k, col in enumerate(cols):  # per column: 1-D repeats are the fast ones (2-7x)
            items[:, k] = col.repeat_interleave(counts)
    return items


_TORCH_COLUMNS_MIN_BLOCKS = 128  # the break-even of spec-decode batches (1-2 Q blocks per sequence)


def _block_columns(blocks, one_each: bool) -> torch.Tensor:
    """[1 or 2, Q blocks] int32: each Q block's sequence and, unless every sequence has one Q
    block (0, already in the templates), its index in the sequence. Python lists below
    _TORCH_COLUMNS_MIN_BLOCKS blocks (~0.25 us per sequence), else a few torch ops (~30 us)."""
    if one_each:
        return torch.arange(len(blocks), dtype=torch.int32).view(1, -1)
    if sum(blocks) < _TORCH_COLUMNS_MIN_BLOCKS:
        q_blocks = [qb for nb in blocks for qb in range(nb)]
        return _int32_tensor(_per_block(range(len(blocks)), blocks) + q_blocks).view(2, -1)
    per_seq = _int32_tensor(blocks)
    seqs = torch.repeat_interleave(per_seq).to(torch.int32)
    first = torch.cumsum(per_seq, 0, dtype=torch.int32) - per_seq  # each sequence's first Q block
    return torch.stack([seqs, torch.arange(len(seqs), dtype=torch.int32) - first[seqs]])


def _reduce_rows(qsl, splits) -> torch.Tensor:
    """[m, 2] int32 reduce rows: (token, splits) for every token of a split sequence (its Q
    blocks cover its tokens in order; only short sequences are split)."""
    rows = []
    for s, n in enumerate(splits or ()):
        if n > 1:
            for t in range(qsl[s], qsl[s + 1]):
                rows += (t, n)
    return _int32_tensor(rows).view(-1, 2)


def plan_attention(
    query_start_loc,
    seq_lens,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    device=None,
    path: str = "auto",
    num_splits: int | None = None,
    batch_invariant: bool = False,
    segment_size: int = INVARIANT_SEGMENT_TOKENS,
    max_num_tokens: int | None = None,
    sliding_window: int | None = None,
    max_num_seqs: int | None = None,
    max_context_len: int | None = None,
    num_programs: int | None = None,
    schedule: str = "auto",
    dtype: torch.dtype = torch.bfloat16,
) -> AttentionPlan:
    """Plan one engine step.

    Parameters
    ----------
    query_start_loc : ``[num_seqs + 1]`` ints (list or host tensor; a device tensor costs a sync)
    seq_lens : ``[num_seqs]`` ints
    num_q_heads, num_kv_heads, head_size : the attention shape of every layer of the step.
    device : where the workspaces live (the kernels' device); default ``"cuda"`` when CUDA is
        available, else ``"cpu"`` (Triton's interpreter).
    path : ``"auto"`` (the module docstring's rule), ``"unified"``, ``"split_kv"``,
        ``"persistent"`` or ``"prefill"`` (every sequence through the large-tile kernel; under
        ``"auto"`` sequences with >= PREFILL_MIN_QUERY_LEN queries take it and the rest the
        unified kernel, in the same call).
    num_splits : force the split count of the split-KV path.
    batch_invariant : every sequence's output bitwise independent of the rest of the batch:
        the split-KV path with ``segment_size`` keys per split at fixed positions and tiles
        that depend on the head shape only. Workspace: ``num_tokens * num_q_heads *
        ceil(max_seq_len / segment_size) * head_size * 4`` bytes (large for long prefills).
    max_num_tokens : workspace capacity in tokens (default: this batch's token count).
    sliding_window : the layers' window, if any: it bounds the keys a query reads, which the
        split rule uses (correctness never depends on it).
    max_num_seqs, max_context_len : persistent path: the capacity to plan for (defaults: this
        batch), so that :meth:`AttentionPlan.update` can re-plan any batch up to it in place.
    num_programs : persistent path: the fixed grid (default ``PERSISTENT_PROGRAMS_PER_SM * num_sms``,
        three waves of resident programs; the work list is cut for one wave,
        ``min(num_programs, RESIDENT_PROGRAMS_PER_SM * num_sms)`` programs).
    schedule : persistent path: ``"static"`` striding, ``"atomic"`` work counter, or ``"auto"``
        (default): chosen at every ``update()`` from the work list's size, without recapture (the
        kernel reads the choice from the plan's device buffer).
    dtype : q's dtype (the prefill path's tiles depend on it).

    Examples
    --------
    >>> plan = plan_attention([0, 1, 2], [4096, 900], num_q_heads=32, num_kv_heads=8, head_size=128)
    >>> out = paged_attention(q, k_cache, v_cache, block_table, seq_lens, qsl, plan=plan)
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device} was asked for, but CUDA is not available (use device='cpu' for the interpreter)")
    path_requested = path
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    qsl = _host_list(query_start_loc)
    lens = _host_list(seq_lens)
    if len(qsl) != len(lens) + 1:
        raise ValueError(f"query_start_loc has {len(qsl)} entries; expected len(seq_lens) + 1 = {len(lens) + 1}")
    q_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
    max_query_len = max(q_lens + [0])
    max_seq_len = max(lens + [0])
    num_tokens = qsl[-1] if qsl else 0
    max_num_tokens = max(num_tokens, max_num_tokens or 0)
    group = num_q_heads // num_kv_heads

    segment = 0
    cap_registers = True
    if batch_invariant:
        tiles = fitted(pick_tiles(max_query_len, group, head_size, fixed=True), target_props(device), head_size, dtype)
        if segment_size < tiles.tile_n or segment_size % tiles.tile_n:
            raise ValueError(f"segment_size must be a positive multiple of {tiles.tile_n}, got {segment_size}")
        if path in ("unified", "persistent"):
            raise ValueError(f"batch_invariant=True runs the split_kv path; path={path!r} conflicts")
        path, segment = "split_kv", segment_size
        splits = max(1, -(-max_seq_len // segment))
    else:
        tiles = fitted(pick_tiles(max_query_len, group, head_size), target_props(device), head_size, dtype)
        if num_splits is not None:
            if num_splits < 1:
                raise ValueError(f"num_splits must be >= 1, got {num_splits}")
            splits = num_splits
        else:
            num_q_blocks = sum(-(-n // tiles.block_q) for n in q_lens)
            splits = choose_num_splits(num_q_blocks, num_kv_heads, max_query_len, max_seq_len, num_sms(device),
                                       sliding_window)
            if path in ("auto", "split_kv") and max_query_len <= SPLIT_KV_MAX_QUERY_LEN:
                segment = balanced_segment(q_lens, lens, block_q=tiles.block_q, tile_n=tiles.tile_n,
                                           num_kv_heads=num_kv_heads, splits=splits, sms=num_sms(device),
                                           sliding_window=sliding_window)
                if segment and path == "auto":
                    # unequal lengths: a compact work list of about equal items (the persistent
                    # kernel) instead of a grid of every sequence x split, whose slots past the
                    # short sequences' keys are programs that only exit (67k of them at
                    # 1 x 65536 + 255 x 128 on the H200: 341 us, 3.9x its bytes floor)
                    path = "persistent"
                elif segment:
                    splits = -(-max_seq_len // segment)
        if path == "auto":
            path = auto_path(max_query_len, splits)
            visible = min(max_seq_len, sliding_window) if sliding_window else max_seq_len
            if (path == "unified" and num_splits is None and max_query_len == 1 and visible >= LONG_DECODE_TOKENS
                    and persistent_takes_fewer_waves(num_q_blocks * num_kv_heads, num_sms(device))):
                path = "persistent"  # long decodes in fewer waves of 2 programs per SM: uncapped
                cap_registers = False
    if path == "persistent":
        return _plan_persistent(
            qsl, lens, tiles=tiles, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=head_size,
            device=device, max_num_tokens=max_num_tokens, max_num_seqs=max(len(lens), max_num_seqs or 0),
            max_context_len=max(max_seq_len, max_context_len or 0), num_programs=num_programs,
            schedule=schedule, sliding_window=sliding_window, fit_splits=path_requested == "auto",
            cap_registers=cap_registers,
        )
    if path == "prefill":
        min_q_len = PREFILL_MIN_QUERY_LEN if path_requested == "auto" else 0
        prefill_seqs = _long_sequences(q_lens, max(min_q_len, 1))
        rest_max = max([n for n in q_lens if n < min_q_len] + [0])
        if rest_max and prefill_seqs != (0, 0):
            side_stream(torch.device(device))  # created now, outside any CUDA-graph capture of the call
        return AttentionPlan(
            path="prefill", tiles=tiles, num_splits=1, segment_size=0, max_query_len=max_query_len,
            max_seq_len=max_seq_len, max_num_tokens=max_num_tokens, num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads, head_size=head_size, batch_invariant=False, partial_out=None,
            partial_lse=None, prefill_tiles=_plan_prefill_tiles(q_lens, lens, prefill_seqs, num_q_heads, head_size, dtype, device),
            prefill_min_q_len=min_q_len, rest_max_query_len=rest_max,
            prefill_seqs=prefill_seqs, num_tokens=num_tokens, num_seqs=len(lens),
        )
    if path == "unified":
        splits = 1

    partial_out = partial_lse = None
    if path == "split_kv":
        partial_out = torch.empty(max_num_tokens, num_q_heads, splits, head_size, dtype=torch.float32, device=device)
        partial_lse = torch.empty(max_num_tokens, num_q_heads, splits, dtype=torch.float32, device=device)
    return AttentionPlan(
        path=path, tiles=tiles, num_splits=splits, segment_size=segment,
        max_query_len=max_query_len, max_seq_len=max_seq_len, max_num_tokens=max_num_tokens,
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        batch_invariant=batch_invariant, partial_out=partial_out, partial_lse=partial_lse,
        num_tokens=num_tokens, num_seqs=len(lens),
    )


def _plan_prefill_tiles(q_lens, lens, prefill_seqs, num_q_heads, head_size, dtype, device) -> Tiles:
    """The prefill kernel's tiles for its grid: the sequences [first, end) of ``prefill_seqs``."""
    first, end = prefill_seqs
    max_q = max(q_lens[first:end] + [0])
    diagonal = max(lens[first:end] + [0]) <= 2 * max_q
    short = short_prefill(max_q, end - first, num_q_heads, num_sms(device), diagonal=diagonal)
    return fitted(pick_prefill_tiles(head_size, dtype, short=short), target_props(device), head_size, dtype)


def _plan_persistent(qsl, lens, *, tiles, num_q_heads, num_kv_heads, head_size, device, max_num_tokens,
                     max_num_seqs, max_context_len, num_programs, schedule, sliding_window,
                     fit_splits: bool = False, cap_registers: bool = True) -> AttentionPlan:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    target = target_props(device)
    if target.persistent_tile_n and tiles.tile_n > target.persistent_tile_n:
        # the target's compiler spills the persistent kernel's wider or deeper tiles
        tiles = replace(tiles, tile_n=target.persistent_tile_n)
    if target.persistent_stages and tiles.num_stages > target.persistent_stages:
        tiles = replace(tiles, num_stages=target.persistent_stages)
    wave = RESIDENT_PROGRAMS_PER_SM * num_sms(device)
    num_programs = num_programs or PERSISTENT_PROGRAMS_PER_SM * num_sms(device)
    split_programs = min(num_programs, wave)
    # measured on 4-warp decode tiles up to head 128 only (the cap would spill wider tiles)
    capped = fit_splits and cap_registers and tiles.num_warps == 4 and head_size <= 128
    # uncapped, the kernel holds 2 programs per SM (194 registers): a uniform batch cut for 3 per
    # SM ran 1.45 waves (H200, graph plans: 16 x 4096 86.4 -> 74.8 us cut for 2 per SM, 8 x 4096
    # 50.4 -> 42.1, 4 x 8192 50.4 -> 41.8; 32 x 1024, unsplit, 39.0 either way)
    resident = split_programs if capped else min(split_programs, PERSISTENT_UNCAPPED_PROGRAMS_PER_SM * num_sms(device))
    max_splits = max(1, min(PERSISTENT_MAX_SPLITS, -(-max_context_len // MIN_SEGMENT_TOKENS)))
    if fit_splits:  # a plan for this batch only: partials for the splits its list uses
        listed = persistent_work_list(qsl, lens, tiles=tiles, num_kv_heads=num_kv_heads,
                                      num_programs=split_programs, max_splits=max_splits,
                                      sliding_window=sliding_window, resident=resident)
        max_splits = max(1, int(listed[0][:, 4].max())) if listed[0].shape[0] else 1
        if max_splits == 1 and schedule == "auto":
            # one item per (sequence, Q block, KV head): static striding (the atomic counter pays
            # off at 2+ items a program of unequal length), and the launcher then needs no
            # reduce kernel (nothing to merge, no counter to reset)
            schedule = "static"
    max_q_blocks = max_num_tokens // tiles.block_q + max_num_seqs
    max_items = max(1, max_q_blocks * num_kv_heads * max_splits)
    plan = AttentionPlan(
        path="persistent", tiles=tiles, num_splits=max_splits, segment_size=0,
        max_query_len=0, max_seq_len=0, max_num_tokens=max_num_tokens,
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=head_size, batch_invariant=False,
        partial_out=torch.empty(max_num_tokens, num_q_heads, max_splits, head_size, dtype=torch.float32, device=device),
        partial_lse=torch.empty(max_num_tokens, num_q_heads, max_splits, dtype=torch.float32, device=device),
        work_items=torch.zeros(max_items, 5, dtype=torch.int32, device=device),
        work_counts=torch.zeros(3, dtype=torch.int32, device=device),
        work_counter=torch.zeros(1, dtype=torch.int32, device=device),
        reduce_rows=torch.zeros(max(1, max_num_tokens), 2, dtype=torch.int32, device=device),
        num_programs=num_programs, split_programs=split_programs, resident_programs=resident,
        schedule=schedule, max_num_seqs=max_num_seqs, sliding_window=sliding_window,
        max_registers=UNEQUAL_MAX_REGISTERS if capped else None,
    )
    if fit_splits:  # the list above, cut under the splits it uses, is the one update() would make
        plan._load(qsl, lens, *listed)
    else:
        plan.update(qsl, lens)
    return plan
