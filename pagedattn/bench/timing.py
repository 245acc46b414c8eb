"""Timing: CUDA-graph replays for short calls, ``triton.testing.do_bench`` (median) otherwise.

"Short" means under GRAPH_BELOW_US when replayed: the eager time of a call can be mostly host
overhead (Python checks, torch.compile guards), so a graph is tried whenever eager is under
GRAPH_TRY_US. A longer call whose eager time exceeds HOST_BOUND_RATIO x its replay time is
host-bound (do_bench would time the host: on the H200, prefill S=2048 took 351 us eager-paced against
211 us replayed), so it reports the replay too.

Under load (``bench kernels --under-load``) each timed replay follows a compute-bound GEMM burst
(LOAD_GEMM), untimed: inside an inference engine the model's GEMMs hold the GPU at its power
cap, and there the H200's SM clock ran 1400-1500 MHz instead of 1980 (nvidia-smi, reason "SW
power cap"). A kernel bound by its instruction issue rather than by HBM slows with the clock; this
times it at those clocks.

Short calls are captured once per input copy into one graph (the runner passes several copies
of small inputs, so replays rotate through more data than the L2 holds) and the median replay
time is divided by the number of copies. On the CPU (Triton interpreter) one call is timed with
``time.perf_counter``; those numbers only show that the suite runs.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

GRAPH_BELOW_US = 200.0  # calls shorter than this (replayed) are reported as graph replays
GRAPH_TRY_US = 1000.0  # eager time below which a graph is tried (eager may be host-bound)
HOST_BOUND_RATIO = 1.1  # eager slower than this x the graph replay: the host paces do_bench too
ROTATE_BYTES = 256 * 2**20  # small inputs are copied until the copies exceed this (L2 is ~60 MB)
MAX_COPIES = 100
LOAD_GEMM = 8192  # the burst: one bf16 matmul of this size cubed, 1.1 TFLOP, about 2 ms on the H200


def copies_for(nbytes: float, device: torch.device) -> int:
    """How many input copies to rotate over, given the bytes one call touches.

    1 on the CPU and when one call already touches ROTATE_BYTES.
    """
    if device.type == "cpu" or nbytes >= ROTATE_BYTES:
        return 1
    return int(min(MAX_COPIES, -(-ROTATE_BYTES // max(int(nbytes), 1))))


def _cpu_time(fn: Callable) -> dict:
    """One call (the correctness check before it served as the warm-up)."""
    t0 = time.perf_counter()
    fn()
    return {"time_us": (time.perf_counter() - t0) * 1e6, "method": "cpu-once"}


def _eager_us(fn: Callable, iters: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def gemm_load(device: torch.device) -> Callable[[], None]:
    """A compute-bound burst (one LOAD_GEMM-cubed bf16 matmul) to run before each timed replay."""
    a = torch.randn(LOAD_GEMM, LOAD_GEMM, device=device, dtype=torch.bfloat16)
    b = torch.randn(LOAD_GEMM, LOAD_GEMM, device=device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    return lambda: torch.mm(a, b, out=c)


def graph_time_us(fns: list[Callable], *, budget_ms: float = 200.0, load: Callable[[], None] | None = None) -> float:
    """Median replay time of one graph that calls every fn once, divided by len(fns); ``load``
    (untimed) runs before each timed replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as capture requires
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    one_ms = max((time.perf_counter() - t0) * 1e3, 1e-3)
    reps = int(min(1000, max(10, budget_ms / one_ms)))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    if load is not None:  # bring the clocks down to the loaded level before the first timed replay
        for _ in range(100):
            load()
    for start, end in events:
        if load is not None:
            load()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in events)
    del graph
    return ms * 1e3 / len(fns)


def bench(fns: list[Callable], device: torch.device, *, prefer_graph: bool = False,
          load: Callable[[], None] | None = None) -> dict:
    """``{"time_us", "method"}`` for one call; ``fns`` run the same call on different input copies.

    ``prefer_graph``: report the replay whenever the capture works (sweeps: every variant timed
    the same way, whichever side of the host-bound line its eager time falls). ``load``
    (:func:`gemm_load`): graph replays only, each after the burst."""
    if device.type == "cpu":
        return _cpu_time(fns[0])
    import triton.testing

    if load is not None:
        us = graph_time_us(fns, load=load)
        return {"time_us": us, "method": f"cudagraph x{len(fns)} copies, each replay after a GEMM burst"}

    eager = _eager_us(fns[0])
    fallback = "do_bench"
    extra = {}
    if eager < GRAPH_TRY_US or prefer_graph:
        try:
            us = graph_time_us(fns)
            if prefer_graph or us < GRAPH_BELOW_US or eager > HOST_BOUND_RATIO * us:
                return {"time_us": us, "method": f"cudagraph x{len(fns)} copies", "eager_us": eager}
            extra["graph_us"] = us  # captured fine; long enough and not host-bound: do_bench is reported
        except Exception as e:  # noqa: BLE001 - fall back, and say why
            torch.cuda.synchronize()
            fallback = f"do_bench (graph capture failed: {type(e).__name__}: {str(e)[:160]})"
    ms = triton.testing.do_bench(fns[0], warmup=25, rep=100, return_mode="median")
    return {"time_us": ms * 1e3, "method": fallback, "eager_us": eager, **extra}


def host_time_us(fn: Callable, calls: int = 50) -> float:
    """Host time of one call: ``calls`` back-to-back calls without synchronizing, wall / calls.

    One warm-up call and a synchronize come first; the device drains after the clock stops.
    """
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    wall = time.perf_counter() - t0
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return wall / calls * 1e6
