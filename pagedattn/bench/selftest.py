"""``python -m pagedattn.bench.selftest``: every peer provider once, on small cases.

Builds one small decode, prefill, extend and mixed batch (plus a mixed batch whose decodes are
interleaved with the prefills, and two MLA decode batches), runs every requested provider on
each, compares its output with the float64 reference (``pagedattn.bench.check``, the bench's
own gate) and prints one line per provider and case: status, max error, tolerance, the time of
the first call (plan + FlashInfer's JIT build), host µs (50 back-to-back calls without
synchronizing, wall / 50) and GPU µs (the bench's own timing). A provider's exception is
printed with its traceback and the run goes on, so one broken adapter hides none of the others.
Exit status 0 when nothing failed or raised.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import traceback

import torch

PEERS = ("flashinfer", "flashinfer-prefill", "cudnn-paged")
LLAMA = dict(num_q_heads=32, num_kv_heads=8, head_size=128)
MLA_LATENT, MLA_ROPE, MLA_SCALE = 512, 64, 192**-0.5


def _case(name, kind, segments, shape=LLAMA, block_size=16, **features):
    from pagedattn.bench.workloads import Case

    params = dict(shape, block_size=block_size, segments=[list(s) for s in segments],
                  sliding_window=features.get("sliding_window"), softcap=features.get("softcap"),
                  sinks=bool(features.get("sinks", False)))
    return Case(name=name, workload=kind, kind=kind, params=params)


def cases(with_features: bool):
    out = [
        _case("decode B=3 L=200,75,16", "decode", [(1, 1, 200), (1, 1, 75), (1, 1, 16)]),
        _case("prefill S=96", "prefill", [(1, 96, 96)]),
        _case("extend 2x16@80", "extend", [(2, 16, 80)]),
        _case("mixed 1x40 + 3x1@41", "mixed", [(1, 40, 40), (3, 1, 41)]),
        _case("mixed D2@64 + P1x24 + E1x8@72 + D1@33", "mixed",
              [(2, 1, 64), (1, 24, 24), (1, 8, 72), (1, 1, 33)]),
    ]
    if with_features:
        gemma = dict(num_q_heads=8, num_kv_heads=4, head_size=256)
        out += [
            _case("gemma decode B=2 L=64 (window 32, softcap 50)", "decode", [(2, 1, 64)], gemma,
                  sliding_window=32, softcap=50.0),
            _case("gemma prefill S=64 (window 32, softcap 50)", "prefill", [(1, 64, 64)], gemma,
                  sliding_window=32, softcap=50.0),
        ]
    return out


def _environment(device) -> list[str]:
    lines = [f"torch {torch.__version__} (CUDA {torch.version.cuda}), device {torch.cuda.get_device_name(device)} "
             f"sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"]
    lines.append(f"CUDA_HOME={os.environ.get('CUDA_HOME', '')!r}, ninja={shutil.which('ninja')}, "
                 f"nvcc={shutil.which('nvcc')}")
    from pagedattn.adapters import cudnn, flashinfer

    for name, mod in (("flashinfer", flashinfer), ("cudnn", cudnn)):
        try:
            ok, why = mod.availability()
            lines.append(f"{name}: {mod.version() if ok else 'unavailable: ' + why}")
        except Exception as e:  # noqa: BLE001 - report and go on
            lines.append(f"{name}: {type(e).__name__}: {e}")
    return lines


def _print_error(label: str, e: BaseException, verbose: bool):
    print(f"ERROR {label}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    frames = traceback.format_exception(type(e), e, e.__traceback__)
    text = "".join(frames if verbose else frames[-6:])
    print("      " + text.replace("\n", "\n      ").rstrip(), flush=True)


def _timings(prepared_call, device) -> str:
    from pagedattn.bench.timing import bench, host_time_us

    host = host_time_us(prepared_call)
    t = bench([prepared_call], device)
    return f"host={host:.1f}us gpu={t['time_us']:.1f}us ({t['method']})"


def run_paged(names, device, dtype, args) -> list[str]:
    from pagedattn.bench.check import compare, reference
    from pagedattn.bench.providers import PROVIDERS
    from pagedattn.bench.workloads import build_inputs

    statuses = []
    for case in cases(args.features):
        inputs = build_inputs(case, device, dtype, seed=args.seed)
        ref = reference(inputs)
        for name in names:
            prov = PROVIDERS[name]
            label = f"{name:18s} {case.name:44s}"
            ok, why = prov.available()
            if not ok:
                print(f"SKIP  {label} unavailable: {why}", flush=True)
                statuses.append("skip")
                continue
            ok, why = prov.supports(case)
            if not ok:
                print(f"SKIP  {label} {why}", flush=True)
                statuses.append("skip")
                continue
            try:
                print(f"...   {label} planning + first call (a FlashInfer kernel variant compiles on first use)",
                      flush=True)
                t0 = time.perf_counter()
                prepared = prov.prepare(inputs)
                out = prepared.to_tokens(prepared())
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                err, good, tol = compare(out, ref)
                status = "PASS" if good else "FAIL"
                timing = _timings(prepared, device) if good and not args.no_timing else ""
                print(f"{status:5s} {label} max_err={err:.3g} tol={tol:g} first_call={first:.1f}s {timing} "
                      f"| {prepared.note}", flush=True)
                statuses.append(status.lower())
            except Exception as e:  # noqa: BLE001 - one adapter failing must not hide the others
                _print_error(label, e, args.verbose)
                statuses.append("error")
                torch.cuda.synchronize()
    return statuses


def _mla_inputs(seq_lens, query_len, heads, block_size, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + 3
    kv = torch.randn(num_blocks, block_size, MLA_LATENT + MLA_ROPE, generator=g).to(device, dtype)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    start = 0
    for s, n in enumerate(pages):
        table[s, :n] = perm[start:start + n]
        start += n
    q = torch.randn(len(seq_lens) * query_len, heads, MLA_LATENT + MLA_ROPE, generator=g).to(device, dtype)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32) * query_len
    return q, kv, table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device), qsl.to(device)


def run_mla(device, dtype, args) -> list[str]:
    from pagedattn.bench.check import TOLERANCE
    from pagedattn.adapters import flashinfer
    from pagedattn.reference import mla_decode_ref

    statuses = []
    for seq_lens, query_len in (([200, 37, 129], 1), ([96, 64], 2)):
        label = f"{'flashinfer-mla':18s} {f'MLA 128 heads L={seq_lens} q={query_len}':44s}"
        ok, why = flashinfer.availability()
        if not ok:
            print(f"SKIP  {label} unavailable: {why}", flush=True)
            statuses.append("skip")
            continue
        try:
            q, kv, table, lens, qsl = _mla_inputs(seq_lens, query_len, 128, 16, dtype, device, args.seed)
            ref, _ = mla_decode_ref(q[..., :MLA_LATENT], q[..., MLA_LATENT:], kv, table, lens, qsl,
                                    scale=MLA_SCALE)
            out = torch.full((q.shape[0], 128, MLA_LATENT), float("nan"), dtype=dtype, device=device)
            print(f"...   {label} planning + first call (FlashInfer builds its MLA kernel here)", flush=True)
            t0 = time.perf_counter()
            run, note = flashinfer.mla_call(q, kv, table, lens, qsl, scale=MLA_SCALE, latent_dim=MLA_LATENT,
                                               out=out)
            run()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            err = float((out.double() - ref).abs().max())
            tol = TOLERANCE[dtype]
            good = err == err and err <= tol
            status = "PASS" if good else "FAIL"
            timing = _timings(run, device) if good and not args.no_timing else ""
            print(f"{status:5s} {label} max_err={err:.3g} tol={tol:g} first_call={first:.1f}s {timing} | {note}",
                  flush=True)
            statuses.append(status.lower())
        except Exception as e:  # noqa: BLE001
            _print_error(label, e, args.verbose)
            statuses.append("error")
            torch.cuda.synchronize()
    return statuses


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagedattn.bench.selftest", description=__doc__.splitlines()[0])
    p.add_argument("--provider", help=f"comma list (default {','.join(PEERS)}; add pagedattn as a control)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--features", action="store_true", help="also gemma-shaped cases (window + softcap, head 256)")
    p.add_argument("--no-mla", action="store_true")
    p.add_argument("--no-timing", action="store_true", help="check only (no host / GPU timing)")
    p.add_argument("--verbose", action="store_true", help="full tracebacks")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("the self-test runs the peers on a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    names = [n.strip() for n in (args.provider or ",".join(PEERS)).split(",") if n.strip()]
    from pagedattn.bench.providers import PROVIDERS

    unknown = [n for n in names if n not in PROVIDERS]
    if unknown:
        print(f"unknown provider(s) {unknown}; choose from {', '.join(PROVIDERS)}", file=sys.stderr)
        return 2
    for line in _environment(device):
        print(line, flush=True)
    statuses = run_paged(names, device, dtype, args)
    if not args.no_mla:
        statuses += run_mla(device, dtype, args)
    counts = {s: statuses.count(s) for s in ("pass", "fail", "error", "skip")}
    print("summary: " + ", ".join(f"{v} {k}" for k, v in counts.items()), flush=True)
    return 0 if counts["fail"] == 0 and counts["error"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
