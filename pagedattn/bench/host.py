"""pagedattn bench host: the host time and the GPU time of one call, per path.

An engine calls attention once per layer: outside CUDA graphs (prefill and mixed steps, eager
engines) the Python cost of each call adds up to milliseconds a step. This benchmark measures it
per path at the Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head size 128, bf16,
page 16), with a plan built once and out= / lse_out= preallocated, as an engine's per-layer call:

* host time of one call: N calls back to back without synchronizing (after a warm-up), wall time
  / N; the median of several such runs (and the best). The GPU keeps up or queues: either way
  the wall clock stops once the host has issued the N-th call. The runs are taken in rounds over
  every row of the table, one run of each row a round (``HostTimer``), so that the rows, the
  peers' included, share the host's slow and fast spells: on the GPU machines' CPUs a row timed
  on its own read 1.5-3x apart between runs of the table minutes apart.
* GPU time of one call: CUDA-graph replays for short calls, triton's do_bench median otherwise
  (pagedattn.bench.timing.bench).
* launches: the kernels one call runs (from torch.profiler), which sets the host target: 15 us
  for one launch, 25 us for two launches or two streams, 40 us without a plan.

Paths: unified, split_kv, persistent, the automatic plan, prefill, a mixed batch (one 2048-token
prefill and 63 decodes: prefill kernel and decodes on a second stream), the plan-less call (the
maxima given, so it does not synchronize), mla_decode (128 heads, 512 + 64 latent) and write_kv.
Every call is checked against the reference before it is timed. With --peers, the available peer
providers of pagedattn bench (their per-layer call, planned outside the timing) are measured on
the same inputs.

Without a GPU the same code runs in Triton's interpreter on tiny shapes: the numbers are
interpreter numbers (the check still holds, the times say nothing about speed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

CALLS = 50  # back-to-back calls per host-time run
RUNS = 5  # host-time runs; the median is reported
HOST_TARGET_US = {1: 15.0, 2: 25.0}  # by launches per call (or two streams) with a plan
PLANLESS_TARGET_US = 40.0


@dataclass
class HostCase:
    """One batch: a bench workload case (segments) and the paths timed on it."""

    label: str
    segments: list  # (count, query_len, seq_len)
    paths: tuple  # plan paths of paged_attention, "planless", or peers


def _cases(quick: bool) -> list[HostCase]:
    if quick:  # the interpreter: the same paths on tiny batches
        return [
            HostCase("decode B=2 L=64", [(2, 1, 64)], ("unified", "split_kv", "persistent", "auto", "planless")),
            HostCase("mixed 1x130 + 3x1@131", [(1, 130, 130), (3, 1, 131)], ("auto", "planless")),
            HostCase("prefill S=130", [(1, 130, 130)], ("prefill", "planless")),
        ]
    decode = ("unified", "split_kv", "persistent", "auto", "planless")
    return [
        HostCase("decode B=32 L=4096", [(32, 1, 4096)], decode),
        HostCase("decode B=128 L=4096", [(128, 1, 4096)], decode),
        HostCase("mixed 1x2048 + 63x1@2049", [(1, 2048, 2048), (63, 1, 2049)], ("auto", "planless")),
        HostCase("prefill S=2048", [(1, 2048, 2048)], ("prefill", "planless")),
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostTimer:
    """Host times of many rows, in interleaved rounds: ``add(row, fn)`` as each row passes its
    check, then ``measure()`` warms every call up and runs ``runs`` rounds, each one run of
    ``calls`` back-to-back calls of every row in turn; a row gets the median of its runs
    (``host_us``), the best (``host_us_best``) and all of them (``host_us_runs``)."""

    def __init__(self, device: torch.device, *, calls: int = CALLS, runs: int = RUNS, warmup: int = 3):
        self.device, self.calls, self.runs, self.warmup = device, calls, runs, warmup
        self._rows: list = []

    def add(self, row: dict, fn: Callable) -> None:
        self._rows.append((row, fn))

    def measure(self, progress=None) -> None:
        for _, fn in self._rows:
            for _ in range(self.warmup):
                fn()
        _sync(self.device)
        per_call = [[] for _ in self._rows]
        for _ in range(self.runs):
            for times, (_, fn) in zip(per_call, self._rows):
                _sync(self.device)
                t0 = time.perf_counter()
                for _ in range(self.calls):
                    fn()
                times.append((time.perf_counter() - t0) / self.calls * 1e6)
                _sync(self.device)
            if progress is not None:
                progress.step("host-time round")
        for times, (row, _) in zip(per_call, self._rows):
            row.update(host_us=statistics.median(times), host_us_best=min(times),
                       host_us_runs=[round(x, 2) for x in times])
        self._rows.clear()


def count_launches(fn: Callable, device: torch.device) -> int | None:
    """Kernels one call runs on the GPU (torch.profiler's CUDA activity); None on the CPU."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(1 for n in names if not n.lower().startswith(("memcpy", "memset")))


def _target(path: str, launches: int | None, two_streams: bool) -> float | None:
    if path == "planless":
        return PLANLESS_TARGET_US
    if launches is None:
        return None
    n = 2 if two_streams else launches
    return HOST_TARGET_US.get(min(n, 2))


def _paged_call(inputs, path: str):
    """(call, out tensor, plan) for one path on one case's inputs; plan None for the plan-less call."""
    from pagedattn import paged_attention, plan_attention

    q, k_cache = inputs.q, inputs.k_cache
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    args = inputs.paged_args()
    if path == "planless":
        kwargs = inputs.paged_kwargs()  # max_query_len and max_seq_len: no host sync
        return (lambda: paged_attention(*args, out=out, lse_out=lse, **kwargs)), out, None
    plan = plan_attention(inputs.query_start_loc.cpu(), inputs.seq_lens.cpu(), num_q_heads=q.shape[1],
                          num_kv_heads=k_cache.shape[2], head_size=q.shape[2], device=q.device, path=path,
                          sliding_window=inputs.features.get("sliding_window"), dtype=q.dtype)
    kwargs = dict(inputs.paged_kwargs(), plan=plan)
    return (lambda: paged_attention(*args, out=out, lse_out=lse, **kwargs)), out, plan


def _row(call: str, case: str, **kw) -> dict:
    return dict(call=call, case=case, ok=None, max_err=None, tolerance=None, host_us=None, gpu_us=None,
                launches=None, target_us=None, method=None, note="", **kw)


def _time_row(row: dict, fn: Callable, device: torch.device, *, timer: HostTimer, two_streams: bool = False,
              path: str = "") -> None:
    """Fill GPU time, launches and the target of a row whose call passed its check, and give the
    call to ``timer`` for its host time."""
    from pagedattn.bench.timing import bench

    timer.add(row, fn)
    if device.type == "cuda":
        timing = bench([fn], device)
        row.update(gpu_us=timing["time_us"], method=timing["method"])
        row["launches"] = count_launches(fn, device)
        row["target_us"] = _target(path, row["launches"], two_streams)
    else:
        row["method"] = "interpreter (not a speed)"


def _checked_row(row: dict, fn: Callable, check: Callable[[], tuple], device, *, timer, progress,
                 path: str) -> dict:
    """Run ``fn`` once, ``check()`` its result -> (ok, max_err, tolerance), and time the row if it
    passed; an exception is the row's note. Reports the verdict to ``progress``."""
    try:
        fn()
        ok, err, tol = check()
        row.update(ok=ok, max_err=err, tolerance=tol)
        if ok:
            _time_row(row, fn, device, timer=timer, path=path)
    except Exception as e:  # noqa: BLE001
        row.update(ok=False, note=f"{type(e).__name__}: {str(e)[:200]}")
    progress.step(f"{row['case']}: {_verdict(row)}")
    return row


def attention_rows(case: HostCase, device, dtype, *, timer, seed, progress) -> list[dict]:
    from pagedattn.bench.check import compare, reference
    from pagedattn.bench.workloads import LLAMA, _case, build_inputs

    shape = dict(LLAMA) if device.type == "cuda" else dict(num_q_heads=4, num_kv_heads=2, head_size=32)
    bench_case = _case(case.label, "host", "mixed", case.segments, shape)
    inputs = build_inputs(bench_case, device, dtype, seed=seed)
    ref = reference(inputs)
    rows = []
    for path in case.paths:
        row = _row("paged_attention", case.label, path=path)
        try:
            fn, out, plan = _paged_call(inputs, path)
            fn()
            err, ok, tol = compare(out, ref)
            row.update(ok=ok, max_err=err, tolerance=tol)
            if plan is not None:
                row["plan"] = plan.path + (f" x{plan.num_splits}" if plan.path == "split_kv" else "")
            two_streams = plan is not None and plan.path == "prefill" and bool(plan.rest_max_query_len)
            if ok:
                _time_row(row, fn, device, timer=timer, two_streams=two_streams, path=path)
            else:
                row["note"] = f"max abs error {err:.3g} > {tol:g}: not timed"
        except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
            row.update(ok=False, note=f"{type(e).__name__}: {str(e)[:200]}")
        rows.append(row)
        progress.step(f"{case.label} / {path}: {_verdict(row)}")
    return rows


def peer_rows(case: HostCase, device, dtype, providers, *, timer, seed, progress) -> list[dict]:
    """The peers' per-layer calls (``Prepared.run``; their planning happens in ``prepare``)."""
    from pagedattn.bench.check import compare, reference
    from pagedattn.bench.workloads import LLAMA, _case, build_inputs

    bench_case = _case(case.label, "host", "mixed", case.segments, dict(LLAMA))
    inputs = build_inputs(bench_case, device, dtype, seed=seed)
    ref = reference(inputs)
    rows = []
    for prov in providers:
        row = _row(prov.name, case.label, path="peer")
        supported, why = prov.supports(bench_case)
        if not supported:
            row.update(note=f"not supported: {why}")
        else:
            try:
                prepared = prov.prepare(inputs)
                err, ok, tol = compare(prepared.to_tokens(prepared()), ref)
                row.update(ok=ok, max_err=err, tolerance=tol, note=prepared.note)
                if ok:
                    _time_row(row, prepared.run, device, timer=timer)
                    row["target_us"] = None
            except Exception as e:  # noqa: BLE001
                row.update(ok=False, note=f"{type(e).__name__}: {str(e)[:200]}")
        rows.append(row)
        progress.step(f"{case.label} / {prov.name}: {_verdict(row)}")
    return rows


def mla_rows(device, dtype, *, quick, timer, seed, progress) -> list[dict]:
    from pagedattn import mla_decode
    from pagedattn.reference import mla_decode_ref
    from pagedattn.testing import TOLERANCES, make_paged_batch, max_errors, within_tolerance

    heads, latent, rope = (128, 512, 64) if not quick else (8, 32, 16)
    batch, ctx = (32, 4096) if not quick else (2, 64)
    g = torch.Generator().manual_seed(seed)
    b = make_paged_batch([(1, ctx)] * batch, num_q_heads=heads, num_kv_heads=1, head_size=latent + rope,
                         block_size=16, dtype=dtype, device=device, generator=g)
    q_nope, q_pe = b.q[..., :latent], b.q[..., latent:]
    kv = b.k_cache[:, :, 0].contiguous()
    out = torch.empty(q_nope.shape, dtype=dtype, device=device)
    scale = (latent // 4 + rope) ** -0.5
    args = (q_nope, q_pe, kv, b.block_table, b.seq_lens, b.query_start_loc)

    def fn():
        return mla_decode(*args, scale=scale, max_query_len=1, max_seq_len=ctx, out=out)

    def check():
        ref, _ = mla_decode_ref(*args, scale=scale,
                                compute_dtype=torch.float32 if device.type == "cuda" else torch.float64)
        ref = ref.double()  # the comparison helpers take the reference in float64
        return within_tolerance(out, None, ref, None), max_errors(out, None, ref, None)[0], TOLERANCES[dtype][0]

    row = _row("mla_decode", f"MLA decode B={batch} L={ctx}, {heads} heads", path="mla_decode")
    return [_checked_row(row, fn, check, device, timer=timer, progress=progress, path="mla_decode")]


def varlen_rows(device, dtype, *, quick, timer, seed, progress) -> list[dict]:
    """varlen_attention (contiguous K/V, no plan: what an encoder or an MLA prefill calls)."""
    from pagedattn import varlen_attention
    from pagedattn.reference import varlen_attention_ref
    from pagedattn.testing import TOLERANCES, max_errors, within_tolerance

    hq, hk, d, s = (32, 8, 128, 2048) if not quick else (4, 2, 32, 40)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, hq, d, generator=g).to(device, dtype)
    k = torch.randn(s, hk, d, generator=g).to(device, dtype)
    v = torch.randn(s, hk, d, generator=g).to(device, dtype)
    cu = torch.tensor([0, s], dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))

    def fn():
        return varlen_attention(q, k, v, cu, cu, max_query_len=s, out=out)

    def check():
        ref, _ = varlen_attention_ref(q, k, v, cu.cpu(), cu.cpu())
        return within_tolerance(out, None, ref, None), max_errors(out, None, ref, None)[0], TOLERANCES[dtype][0]

    row = _row("varlen_attention", f"varlen prefill S={s} (contiguous K/V)", path="varlen, no plan")
    # no plan: the 40 us target
    return [_checked_row(row, fn, check, device, timer=timer, progress=progress, path="planless")]


def write_kv_rows(device, dtype, *, quick, timer, seed, progress) -> list[dict]:
    from pagedattn import write_kv
    from pagedattn.reference import write_kv_ref

    heads, d, bs = (8, 128, 16) if not quick else (2, 32, 16)
    rows = []
    for tokens in ((32, 2048) if not quick else (2, 40)):
        g = torch.Generator().manual_seed(seed + tokens)
        blocks = 2 * -(-tokens // bs) + 4
        key = torch.randn(tokens, heads, d, generator=g).to(device, dtype)
        value = torch.randn(tokens, heads, d, generator=g).to(device, dtype)
        k_cache = torch.randn(blocks, bs, heads, d, generator=g).to(device, dtype)
        v_cache = torch.randn(blocks, bs, heads, d, generator=g).to(device, dtype)
        slots = torch.randperm(blocks * bs, generator=g)[:tokens].to(device)
        ref_k, ref_v = write_kv_ref(key, value, k_cache, v_cache, slots)

        def check():  # called at once below, in this iteration
            ok = bool(torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v))
            return ok, 0.0 if ok else float((k_cache.float() - ref_k.float()).abs().max()), 0.0

        def fn():
            write_kv(key, value, k_cache, v_cache, slots)

        label = f"write_kv {tokens} tokens" + (" (a decode step)" if tokens <= 32 else " (a prefill)")
        rows.append(_checked_row(_row("write_kv", label, path="write_kv"), fn, check, device, timer=timer,
                                 progress=progress, path="write_kv"))
    return rows


def _verdict(row: dict) -> str:
    if row["ok"] is None:
        return "skipped"
    if not row["ok"]:
        return "FAIL"
    # host times are measured after every row is checked (HostTimer), so a row's line has its GPU time only
    return "PASS" if row["gpu_us"] is None else f"GPU {row['gpu_us']:.1f} us"


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def markdown_table(results: dict) -> str:
    from pagedattn.bench.report import header_line, interpreted

    interp = interpreted(results)
    cfg = results["config"]
    lines = [header_line(results), ""]
    if interp:
        lines += ["Triton interpreter on the CPU, tiny shapes: the same calls as on a GPU, checked against the "
                  "reference; the host times are interpreter numbers (each call runs the kernels in Python), "
                  "not the cost of a call on a GPU.", ""]
        lines += ["| call | batch | path (plan) | check | interpreter ms / call |", "|---|---|---|---|---|"]
        for r in results["rows"]:
            check = "-" if r["ok"] is None else ("PASS" if r["ok"] else "FAIL")
            host = _fmt(r["host_us"] / 1e3 if r["host_us"] is not None else None, ".0f")
            lines.append(f"| {r['call']} | {r['case']} | {_path(r)} | {check} | {host} |")
    else:
        lines += [f"Host time: {cfg['calls']} calls back to back without synchronizing, wall time / "
                  f"{cfg['calls']} (median of {cfg['runs']} runs taken in rounds over every row, after "
                  "warm-up; best: the fastest run). GPU time: "
                  "CUDA-graph replay or do_bench median. Target: host time a call may cost (15 us one launch, "
                  "25 us two launches or streams, 40 us without a plan).", ""]
        lines += ["| call | batch | path (plan) | launches | host us / call | best | GPU us / call | host / GPU | target "
                  "| check |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["rows"]:
            ratio = r["host_us"] / r["gpu_us"] if r["host_us"] and r["gpu_us"] else None
            check = "-" if r["ok"] is None else ("PASS" if r["ok"] else "FAIL")
            target = _fmt(r["target_us"], ".0f")
            if r["target_us"] is not None and r["host_us"] is not None:
                target += " (met)" if r["host_us"] <= r["target_us"] else " (not met)"
            lines.append(f"| {r['call']} | {r['case']} | {_path(r)} | {_fmt(r['launches'], 'd')} | "
                         f"{_fmt(r['host_us'])} | {_fmt(r.get('host_us_best'))} | {_fmt(r['gpu_us'])} | "
                         f"{_fmt(ratio, '.2f')} | {target} | {check} |")
    notes = [r for r in results["rows"] if r.get("note") and not r["ok"]]
    if notes:
        lines.append("")
        lines += [f"- {r['call']} on {r['case']} ({_path(r)}): {r['note']}" for r in notes]
    return "\n".join(lines) + "\n"


def _path(r: dict) -> str:
    if r["path"] == "planless":
        return "no plan"
    if r.get("plan"):
        return r["plan"] if r["path"] != "auto" else f"auto: {r['plan']}"
    return r["path"] if r["path"] != "peer" else "peer"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedattn bench host",
                                description="Host time and GPU time of one call per path (the per-layer cost).")
    p.add_argument("--quick", action="store_true", help="tiny shapes (the default without a GPU)")
    p.add_argument("--calls", type=int, default=None, help=f"back-to-back calls per run (default {CALLS}; 1 on the CPU)")
    p.add_argument("--runs", type=int, default=None, help=f"host-time rounds over every row; each row's median is reported (default {RUNS}; 1 on the CPU)")
    p.add_argument("--case", action="append", help="keep only batches whose label contains this text (repeatable)")
    p.add_argument("--peers", default="all",
                   help="comma list of peer providers of pagedattn bench to time beside (default: every available "
                        "anchor; none: skip)")
    p.add_argument("--no-mla", action="store_true", help="skip mla_decode")
    p.add_argument("--no-write-kv", action="store_true", help="skip write_kv")
    p.add_argument("--json", default="bench_out/host.json", help="results file (default: %(default)s)")
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument("--seed", type=int, default=0)
    return p


def _peers(spec: str, device) -> list:
    if spec == "none" or device.type != "cuda":
        return []
    from pagedattn.bench.providers import PROVIDERS

    if spec == "all":
        names = [n for n, p in PROVIDERS.items() if p.anchor]
    else:
        names = [x.strip() for x in spec.split(",") if x.strip()]
        unknown = [n for n in names if n not in PROVIDERS]
        if unknown:
            raise SystemExit(f"pagedattn bench host: unknown provider(s) {unknown}; choose from {', '.join(PROVIDERS)}")
    chosen = []
    for n in names:
        ok, why = PROVIDERS[n].available()
        if ok:
            chosen.append(PROVIDERS[n])
        elif spec != "all":
            print(f"warning: provider {n} unavailable: {why}", file=sys.stderr)
    return chosen


def main(argv=None) -> int:
    from pagedattn.bench.cli import select_device
    from pagedattn.terminal import Progress, interpreter_banner

    args = build_parser().parse_args(argv)
    device = select_device()  # before anything imports a Triton kernel
    from pagedattn.bench.report import machine_info, write_json, write_outputs

    on_cpu = device.type == "cpu"
    quick = args.quick or on_cpu
    dtype = torch.float16 if on_cpu else torch.bfloat16
    calls = args.calls or (1 if on_cpu else CALLS)
    runs = args.runs or (1 if on_cpu else RUNS)
    if on_cpu:
        interpreter_banner()
    cases = [c for c in _cases(quick) if not args.case or any(t in c.label for t in args.case)]
    peers = _peers(args.peers, device)
    steps = (sum(len(c.paths) + len(peers) for c in cases) + 1 + (0 if args.no_mla else 1)
             + (0 if args.no_write_kv else 2) + runs)
    progress = Progress(steps, stream=sys.stderr)
    results = dict(machine=machine_info(device),
                   config=dict(argv=list(sys.argv[1:] if argv is None else argv), dtype=str(dtype).removeprefix("torch."),
                               quick=quick, calls=calls, runs=runs, peers=[p.name for p in peers]),
                   rows=[])
    # on the interpreter the checked call was the warm-up (nothing compiles)
    timer = HostTimer(device, calls=calls, runs=runs, warmup=0 if on_cpu else 3)
    timing = dict(timer=timer, seed=args.seed, progress=progress)
    try:
        for case in cases:
            results["rows"] += attention_rows(case, device, dtype, **timing)
            if peers:
                results["rows"] += peer_rows(case, device, dtype, peers, **timing)
            write_json(results, args.json)
        results["rows"] += varlen_rows(device, dtype, quick=quick, **timing)
        if not args.no_mla:
            results["rows"] += mla_rows(device, dtype, quick=quick, **timing)
        if not args.no_write_kv:
            results["rows"] += write_kv_rows(device, dtype, quick=quick, **timing)
        timer.measure(progress)
    finally:
        progress.close()
    write_outputs(results, args.json, markdown_table(results), args.markdown)
    return 1 if any(r["ok"] is False for r in results["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
