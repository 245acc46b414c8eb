"""pagedattn bench kernels: check, then time, every (case, provider); write JSON and a table.

Without a CUDA GPU the suite runs on the CPU through the Triton interpreter (TRITON_INTERPRET
is set here before anything imports a kernel), with fp16 and tiny heads: a correctness run. Its
table then shows pass/fail and the error per case; the JSON keeps the interpreter's time of the
checked call, which says nothing about speed.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch

from pagedattn.bench.workloads import ALL_WORKLOADS, SUITES

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def select_device() -> torch.device:
    """CUDA when present (and the interpreter not forced), else the CPU under the interpreter."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return torch.device("cuda", torch.cuda.current_device())
    if "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"
    return torch.device("cpu")


def _split(values, default):
    if not values:
        return list(default)
    out = []
    for v in values:
        out += [x.strip() for x in v.split(",") if x.strip()]
    return out


EPILOG = """other benchmarks: pagedattn bench e2e | serve | mla | host | plot | tune | waves
(pagedattn bench --help lists them)"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedattn bench kernels", description=__doc__.splitlines()[0].split(": ", 1)[1],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=sorted(SUITES), default="reference",
                   help="reference: the reference workloads (decode grid, prefill, extend, mixed, feature shapes); "
                        "hetero: batches of unequal lengths and speculative decode, beside their bytes floor; "
                        "all: both (default: %(default)s)")
    p.add_argument("--workload", action="append",
                   help=f"repeatable or comma list of {', '.join(ALL_WORKLOADS)} (default: the suite's)")
    p.add_argument("--provider", action="append", help="comma list (default: every available one)")
    p.add_argument("--case", action="append",
                   help="keep only cases whose name contains this text (repeatable: any of them)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default bf16 on a GPU, fp16 on the CPU")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes (seconds in the CPU interpreter; always on without a GPU)")
    p.add_argument("--json", default="bench_out/results.json", help="results file (default: %(default)s)")
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument("--no-ceilings", action="store_true", help="skip the read and matmul ceilings")
    p.add_argument("--under-load", action="store_true",
                   help="time each replay right after a compute-bound GEMM burst, at the clocks an engine's "
                        "GEMMs leave (GPU only; timing.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="list cases and providers, then exit")
    return p


def _metrics(rec: dict, ceilings: dict) -> None:
    from pagedattn.bench.workloads import bytes_floor_us

    rec["bytes_floor_us"] = bytes_floor_us(rec["kv_bytes"])
    rec["x_bytes_floor"] = rec["time_us"] / rec["bytes_floor_us"] if rec["bytes_floor_us"] else None
    t = rec["time_us"] * 1e-6
    rec["gbps"] = rec["kv_bytes"] / t / 1e9
    rec["tflops"] = rec["flops"] / t / 1e12
    if ceilings:
        floor_s = max(rec["flops"] / (ceilings["matmul_tflops"] * 1e12),
                      rec["kv_bytes"] / (ceilings["read_gbps"] * 1e9))
        rec["floor_us"] = floor_s * 1e6
        rec["pct_of_ceiling"] = 100.0 * floor_s / t


def run_case(case, providers, device, dtype, *, seed, ceilings, progress, load=None) -> list[dict]:
    """Check and time every provider on one case; returns one record per provider."""
    from pagedattn.bench.check import compare, reference
    from pagedattn.bench.timing import bench, copies_for
    from pagedattn.bench.workloads import build_inputs, describe, work

    import time

    from pagedattn.bench.workloads import bytes_floor_us

    inputs = build_inputs(case, device, dtype, seed=seed)
    counts = work(case, dtype)
    touched = counts["kv_bytes"] + 2 * inputs.q.numel() * inputs.q.element_size()  # K/V read, Q in, O out
    n_copies = copies_for(touched, device)
    copies = [inputs] + [build_inputs(case, device, dtype, seed=seed + i) for i in range(1, n_copies)]
    interpreter = device.type == "cpu"
    ref = reference(inputs)
    records = []
    for prov in providers:
        rec = dict(case=case.name, workload=case.workload, kind=case.kind, provider=prov.name,
                   anchor=prov.anchor, dtype=str(dtype).removeprefix("torch."), params=describe(case),
                   status="skip", ok=None, reason="", max_err=None, time_us=None, gbps=None,
                   tflops=None, pct_of_ceiling=None, bytes_floor_us=bytes_floor_us(counts["kv_bytes"]),
                   x_bytes_floor=None, **counts)
        supported, why = prov.supports(case)
        prepared = []
        if not supported:
            rec["reason"] = why
        else:
            try:
                prepared = [prov.prepare(inputs)]
                t0 = time.perf_counter()
                out = prepared[0].to_tokens(prepared[0]())
                call_us = (time.perf_counter() - t0) * 1e6
                err, ok, tol = compare(out, ref)
                rec.update(max_err=err, ok=ok, tolerance=tol, checked=ref.what, note=prepared[0].note)
                if not ok:
                    rec.update(status="fail", reason=f"max abs error {err:.3g} > {tol:g}")
                elif interpreter:  # a correctness run: the checked call's time, no bandwidth figures
                    rec.update(status="ok", time_us=call_us, method="interpreter, one call (not a speed)")
                else:
                    prepared += [prov.prepare(x) for x in copies[1:]]
                    rec.update(bench(prepared, device, load=load), status="ok", n_copies=len(prepared))
                    _metrics(rec, ceilings)
            except Exception as e:  # noqa: BLE001 - a broken provider is reported, the run goes on
                rec.update(status="error", ok=False, reason=f"{type(e).__name__}: {str(e)[:300]}")
                if os.environ.get("PAGEDATTN_BENCH_DEBUG"):
                    traceback.print_exc()
            finally:
                del prepared
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
        records.append(rec)
        progress.step(_progress_label(rec, interpreter))

    if not interpreter:
        _one_method(records, ceilings)
    anchor_times = [r["time_us"] for r in records if r["anchor"] and r["status"] == "ok"]
    best = min(anchor_times) if anchor_times else None
    for r in records:
        r["best_anchor_us"] = best
        r["ratio_to_best_anchor"] = best / r["time_us"] if best and r["status"] == "ok" else None
    return records


def _one_method(records: list[dict], ceilings: dict) -> None:
    """Time a case's providers one way: where every one was captured as a CUDA graph but some
    were reported through do_bench (long enough and not host-bound, timing.bench's rule), report
    every replay. do_bench flushes the L2 before each call and times one launch on the caller's
    stream, a replay does neither: on the H200 a 2048-token prefill among 63 decodes read
    262 us through do_bench and 226 us replayed, one kernel, so a row of both methods compares
    the methods, not the kernels. The do_bench median stays in ``do_bench_us``."""
    timed = [r for r in records if r["status"] == "ok"]
    replayed = [r["time_us"] if r["method"].startswith("cudagraph") else r.get("graph_us") for r in timed]
    if not timed or None in replayed or all(r["method"].startswith("cudagraph") for r in timed):
        return
    for r, us in zip(timed, replayed):
        if not r["method"].startswith("cudagraph"):
            r.update(do_bench_us=r["time_us"], time_us=us,
                     method=f"cudagraph x{r['n_copies']} copies (as the case's other providers)")
            _metrics(r, ceilings)


def _progress_label(rec: dict, interpreter: bool) -> str:
    label = f"{rec['case']} / {rec['provider']}: "
    if rec["status"] == "ok":
        return label + ("PASS" if interpreter else f"{rec['time_us']:.1f} us")
    return label + {"fail": "FAIL", "error": "ERROR", "skip": "skipped"}[rec["status"]]


def main(argv=None) -> int:
    from pagedattn.terminal import Progress, interpreter_banner

    args = build_parser().parse_args(argv)
    device = select_device()  # before anything imports a Triton kernel
    from pagedattn.bench.ceilings import measure_ceilings
    from pagedattn.bench.providers import PROVIDERS
    from pagedattn.bench.report import machine_info, markdown_table, write_json, write_outputs
    from pagedattn.bench.workloads import make_cases

    on_cpu = device.type == "cpu"
    if on_cpu and not args.quick:  # full shapes take hours in the interpreter
        print("no GPU: running the --quick shapes", file=sys.stderr)
        args.quick = True
    dtype_name = args.dtype or ("fp16" if on_cpu else "bf16")
    if on_cpu and dtype_name == "bf16":
        build_parser().error("bf16 does not run on the Triton interpreter; use --dtype fp16 or fp32")
    dtype = DTYPES[dtype_name]
    if args.under_load and on_cpu:
        build_parser().error("--under-load times GPU clocks under a GEMM load; there is no GPU here")

    workloads = _split(args.workload, SUITES[args.suite])
    unknown = [w for w in workloads if w not in ALL_WORKLOADS]
    if unknown:
        build_parser().error(f"unknown workload(s) {unknown}; choose from {', '.join(ALL_WORKLOADS)}")
    names = _split(args.provider, [n for n, p in PROVIDERS.items() if p.by_default])
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown:
        build_parser().error(f"unknown provider(s) {unknown}; choose from {', '.join(PROVIDERS)}")
    availability = {n: PROVIDERS[n].available() for n in names}
    providers = [PROVIDERS[n] for n in names if availability[n][0]]
    cases = make_cases(workloads, quick=args.quick, tiny_heads=on_cpu)
    if args.case:
        cases = [c for c in cases if any(text in c.name for text in args.case)]

    if args.list:
        for c in cases:
            print(f"{c.workload:8s} {c.name}")
        for n, (ok, why) in availability.items():
            print(f"provider {n}: {'available' if ok else 'unavailable: ' + why}")
        for n in PROVIDERS:
            if n not in availability:
                ok, why = PROVIDERS[n].available()
                print(f"provider {n} (only when named): {'available' if ok else 'unavailable: ' + why}")
        return 0
    for n, (ok, why) in availability.items():
        if not ok and args.provider:
            print(f"warning: provider {n} unavailable: {why}", file=sys.stderr)
    if not providers:
        print("no requested provider is available", file=sys.stderr)
        return 2

    if on_cpu:
        interpreter_banner()
    ceilings = {} if args.no_ceilings else measure_ceilings(device)
    results = dict(
        machine=machine_info(device),
        config=dict(argv=list(sys.argv[1:] if argv is None else argv), dtype=dtype_name,
                    quick=args.quick, under_load=args.under_load, suite=args.suite, workloads=workloads, seed=args.seed),
        ceilings=ceilings,
        providers={n: dict(available=ok, reason=why, anchor=PROVIDERS[n].anchor,
                           description=PROVIDERS[n].description)
                   for n, (ok, why) in availability.items()},
        records=[],
    )
    progress = Progress(len(cases) * len(providers), stream=sys.stderr)
    load = None
    if args.under_load:
        from pagedattn.bench.timing import gemm_load

        load = gemm_load(device)
    try:
        for case in cases:
            results["records"] += run_case(case, providers, device, dtype, seed=args.seed,
                                           ceilings=ceilings, progress=progress, load=load)
            write_json(results, args.json)  # partial results survive a crash or a timeout
    finally:
        progress.close()

    write_outputs(results, args.json, markdown_table(results), args.markdown)
    return 1 if any(r["status"] == "fail" for r in results["records"]) else 0
