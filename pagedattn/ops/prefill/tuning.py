"""Per-device tiles for the prefill kernel: a short timing of a few candidates on the first call
of a shape, remembered for the process.

The planner's table (``pagedattn.plan.prefill.pick_prefill_tiles``, from H200 sweeps) is the
deterministic fallback and stays the choice unless ``PAGEDATTN_AUTOTUNE=1``. With it, the first
call of each key (device, dtypes, head sizes, grouping, paged or not, page size, causal, query
length bucket, query heads, sequence count bucket, the table's tiles) times the fallback and the candidates below on that call's own inputs, keeps
the fastest, and every later call of the key launches it. A call made while a CUDA graph is
being captured never tunes (timing needs host synchronization): it takes a remembered choice
or the fallback. Candidates that do not fit the device (too much shared memory, too many
registers) are skipped, so the same list serves every GPU Triton targets.

Measured on the H200 with the key holding the grid's size and the table's tiles, and the
options timed in interleaved rounds (``choose_tiles``) behind a sleep kernel (``time_call``):
as fast as the planner's table at S=512 and 2048, on the extend and on the mixed batch; at
S=8192 and 32768 it takes 64-row tiles that the benchmark times 1-5% slower (1331 against 1291
us, 20.6 against 19.7 ms), with or without the L2 flushed before each timed call. It stays
opt-in.

Candidate lists come from the H200 sweeps (docs/perf-notes.md, "Prefill tiles and TMA"): the
winners and runners-up per head size, in the fallback's neighbourhood.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch
from triton.runtime.errors import OutOfResources, PTXASError

from pagedattn.ops.common.device import interpreter_on
from pagedattn.ops.common.tiles import Tiles

# head size (padded to a power of 2) -> (block_m, tile_n, num_warps, num_stages)
CANDIDATES = {
    64: [(128, 64, 4, 3), (128, 128, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    128: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
    256: [(128, 64, 8, 2), (64, 64, 8, 2), (64, 32, 8, 2), (128, 32, 8, 3)],
}
INTERPRETER_CANDIDATES = [(32, 32, 1, 1), (16, 16, 1, 1)]  # a test of the mechanism, not a tuning

_chosen: dict[tuple, Tiles] = {}


def autotune_enabled(device: torch.device) -> bool:
    """``PAGEDATTN_AUTOTUNE=1`` (read at each call), on CUDA or ROCm devices (torch's "cuda")
    and the interpreter (the CPU): where this module can time a kernel and see a graph capture.
    Other devices keep the fallback."""
    return os.environ.get("PAGEDATTN_AUTOTUNE", "0") == "1" and device.type in ("cuda", "cpu")


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph (never on the CPU)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def remembered(key: tuple, fallback: Tiles) -> Tiles:
    """The choice made for ``key``, or the fallback: for calls that may not tune (an output
    aliasing an input), so every call of a key launches the same tiles once one is chosen."""
    return _chosen.get(key, fallback)


def query_bucket(max_query_len: int) -> int:
    """Queries per sequence, rounded up to a power of 2 from 128 and capped at 16384: the grid's
    size changes the best tiles, small differences in length do not."""
    bucket = 128
    while bucket < max_query_len and bucket < 16384:
        bucket *= 2
    return bucket


def candidates(head_size_pad: int, dtype: torch.dtype, fallback: Tiles) -> list[Tiles]:
    """The fallback first, then the other candidates for this head size (fp32 keeps the fallback:
    its tiles are bounded by shared memory, not tuned)."""
    if interpreter_on():
        table = INTERPRETER_CANDIDATES
    elif dtype == torch.float32:
        table = []
    else:
        table = CANDIDATES.get(min(max(head_size_pad, 64), 256), [])
    tiles = [fallback] + [Tiles(m, m, n, w, s) for m, n, w, s in table]
    return list(dict.fromkeys(tiles))  # in order, without repeats


TUNE_MIN_ROUNDS = 5
TUNE_MAX_ROUNDS = 25
TUNE_TARGET_SECONDS = 0.02  # per candidate: short calls get more rounds, up to TUNE_MAX_ROUNDS


TUNE_QUEUE_CYCLES = 1_000_000  # GPU clock cycles (~0.5 ms) queued ahead of each timed call


def time_call(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds of one call: CUDA events around it on a GPU, wall clock on the CPU (the caller
    warms up first and takes the median over rounds).

    On a GPU a sleep kernel is queued first, so the host has launched the call before the GPU
    reaches the start event: the events time the kernels, not the host's launch work (on the
    H200, without it, an S=512 prefill, 16.5 us of kernel behind tens of microseconds of launch,
    was tuned to tiles that run 20 us)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(TUNE_QUEUE_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def choose_tiles(key: tuple, fallback: Tiles, options: list[Tiles], run: Callable[[Tiles], None],
                 device: torch.device, timer: Callable = time_call) -> Tiles:
    """The remembered tiles of ``key``; else, when tuning is on and no graph is being captured,
    the fastest of ``options`` (remembered); else the fallback.

    Each option runs once first (compilation, warm caches); one that does not fit the device
    (Triton's OutOfResources or a ptxas failure) is skipped, any other error propagates. The
    rest are timed in rounds, one call of each option per round (``timer(lambda: run(tiles),
    device)``), so a drift of the clocks or the temperature during tuning weighs on every option
    alike; at least TUNE_MIN_ROUNDS rounds, more for short calls (until an option has
    TUNE_TARGET_SECONDS of timed calls, at most TUNE_MAX_ROUNDS). The lowest median wins.
    On the H200, five timed calls of each option in turn (not interleaved) picked tiles 5% slower
    than the table's at S=8192 (1449 against 1375 us)."""
    if key in _chosen:
        return _chosen[key]
    if not autotune_enabled(device) or capturing(device):
        return fallback
    usable = []
    for tiles in options:
        try:
            run(tiles)
        except (OutOfResources, PTXASError):  # does not fit this device: shared memory, registers
            continue
        usable.append(tiles)
    times: dict[Tiles, list[float]] = {t: [] for t in usable}
    rounds = 0
    while usable and (rounds < TUNE_MIN_ROUNDS or (rounds < TUNE_MAX_ROUNDS and
                                                   min(sum(v) for v in times.values()) < TUNE_TARGET_SECONDS)):
        for tiles in usable:
            times[tiles].append(timer(lambda: run(tiles), device))
        rounds += 1
    best = min(usable, key=lambda t: statistics.median(times[t])) if usable else fallback
    _chosen[key] = best
    return best


def chosen_tiles() -> dict[tuple, Tiles]:
    """A copy of the choices made so far (key -> tiles), to inspect or log them."""
    return dict(_chosen)


def forget_choices() -> None:
    """Drop every remembered choice (the next call of each key tunes again)."""
    _chosen.clear()
