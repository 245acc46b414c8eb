"""Results: the machine line, the JSON file and the short markdown table."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
from pathlib import Path

import torch


def machine_info(device: torch.device) -> dict:
    import triton

    info = {
        "device": str(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0") == "1",
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, sm_count=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    else:
        info.update(gpu=None, sm_count=None, cpu=platform.processor() or platform.machine())
    return info


def compiled_kernels(kernel) -> list[tuple]:
    """``(device, key, compiled)`` for each kernel this process compiled from a Triton JIT
    function (wrappers such as heuristics unwrapped): its registers (``n_regs``), spills
    (``n_spills``), ``metadata`` and code (``asm``). None on the interpreter, which compiles nothing."""
    fn = kernel
    while not hasattr(fn, "device_caches"):
        fn = getattr(fn, "fn", None)
        if fn is None:
            return []
    return [(device, key, k) for device, (cache, *_) in fn.device_caches.items() for key, k in cache.items()]


def _clean(x):
    """JSON without NaN/inf (strict parsers reject them): non-finite floats become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(results: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(results), indent=1) + "\n")
    return path


def write_outputs(results: dict, json_path, table: str, markdown_path=None) -> Path:
    """The end of a benchmark: results to JSON, the table to stdout (and to ``markdown_path``)."""
    path = write_json(results, json_path)
    print(table)
    if markdown_path:
        md = Path(markdown_path)
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(table)
    print(f"results: {path}", file=sys.stderr)
    return path


def _metric(rec: dict) -> str:
    """The main number of a record: GB/s for decode, TFLOP/s for prefill, % of floor otherwise."""
    kind = rec["kind"]
    if kind == "decode":
        return f"{rec['gbps']:.4g} GB/s"
    if kind == "prefill" or rec.get("pct_of_ceiling") is None:
        return f"{rec['tflops']:.4g} TF/s"
    return f"{rec['pct_of_ceiling']:.0f}% of floor"


def _time(us: float) -> str:
    return f"{us:.1f} us" if us < 10_000 else f"{us / 1e3:.1f} ms"


def _capture_failed(rec: dict) -> bool:
    return "graph capture failed" in (rec.get("method") or "")


def interpreted(results: dict) -> bool:
    """Whether the results come from Triton's interpreter (a correctness run, no speed)."""
    m = results["machine"]
    return bool(m.get("triton_interpret")) or m.get("device") == "cpu"


def header_line(results: dict, *, sms: bool = False) -> str:
    """The first line of a results table: the machine (its SM count with ``sms``), torch, triton,
    dtype and date."""
    m = results["machine"]
    where = f"**{m['device']}**"
    if m.get("gpu"):
        where = f"**{m['gpu']}** (SMs {m.get('sm_count')})" if sms else f"**{m['gpu']}**"
    return f"{where}, torch {m['torch']}, triton {m['triton']}, {results['config']['dtype']}, {m['date']}"


def _check_cell(rec: dict | None) -> str:
    """Interpreter runs: pass/fail and the error instead of speed figures."""
    if rec is None:
        return ""
    status = rec["status"]
    if status in ("ok", "fail"):
        verdict = "PASS" if status == "ok" else "FAIL"
        return f"{verdict}, err {rec['max_err']:.1e}" if rec.get("max_err") is not None else verdict
    return {"error": "ERROR", "skip": "-"}.get(status, status)


def _cell(rec: dict | None) -> str:
    if rec is None:
        return ""
    status = rec["status"]
    if status == "ok":
        cell = f"{_time(rec['time_us'])}, {_metric(rec)}"
        if rec.get("ratio_to_best_anchor") is not None and not rec.get("anchor"):
            cell += f", x{rec['ratio_to_best_anchor']:.2f}"
        if rec["kind"] == "decode" and rec.get("x_bytes_floor") is not None:
            cell += f", {rec['x_bytes_floor']:.2f}x floor"
        if _capture_failed(rec):
            cell += " (eager: no graph)"
        return cell
    return {"fail": "WRONG", "error": "error", "skip": "-"}.get(status, status)


def markdown_table(results: dict) -> str:
    """One row per case, one column per provider: ``time, metric[, xR vs best anchor][, Nx floor]``.

    Decode cases also show their bytes floor (KV bytes read at the floor bandwidth). From the
    interpreter the cells are pass/fail and the error, with no speed figures.
    """
    from pagedattn.bench.workloads import BYTES_FLOOR_TBPS

    records = results["records"]
    providers = list(dict.fromkeys(r["provider"] for r in records))
    cases = list(dict.fromkeys(r["case"] for r in records))
    by_key = {(r["case"], r["provider"]): r for r in records}
    first = {r["case"]: r for r in reversed(records)}
    c = results.get("ceilings") or {}
    check_only = interpreted(results)
    lines = [header_line(results, sms=True), ""]
    if check_only:
        lines += ["Triton interpreter on the CPU: a correctness run on small shapes. Each cell is the check "
                  "against the reference (max abs error); the interpreter's times mean nothing about speed "
                  "and are not shown.", ""]
    elif c:
        lines += [f"Ceilings: read {c['read_gbps']:.0f} GB/s, bf16 matmul {c['matmul_tflops']:.0f} TFLOP/s. "
                  "xR = best anchor's time / this time (> 1: faster).", ""]
    with_floor = not check_only and any(r["kind"] == "decode" for r in records)
    if with_floor:
        lines += [f"Bytes floor: KV bytes read at {BYTES_FLOOR_TBPS:g} TB/s; Nx floor = time / floor.", ""]
    floor_col = " bytes floor |" if with_floor else ""
    lines.append("| case |" + floor_col + " " + " | ".join(providers) + " |")
    lines.append("|---|" + ("---|" if with_floor else "") + "---|" * len(providers))
    cell = _check_cell if check_only else _cell
    for case in cases:
        floor = ""
        if with_floor:
            rec = first[case]
            floor = f" {_time(rec['bytes_floor_us'])} |" if rec["kind"] == "decode" and rec.get("bytes_floor_us") else " |"
        lines.append(f"| {case} |{floor} " + " | ".join(cell(by_key.get((case, p))) for p in providers) + " |")
    problems = [r for r in records if r["status"] in ("fail", "error")]
    eager = [r for r in records if r["status"] == "ok" and _capture_failed(r)]
    if problems or eager:
        lines.append("")
        for r in problems:
            lines.append(f"- {r['provider']} on {r['case']}: {r['status']}: {r.get('reason', '')}")
        for r in eager:
            lines.append(f"- {r['provider']} on {r['case']}: timed eagerly, {r['method']}")
    return "\n".join(lines) + "\n"


def comma_list(values, default) -> list[str]:
    """Names from repeatable comma-list options (``--attention a,b --attention c``), or ``default``."""
    names = []
    for v in values or [",".join(default)]:
        names += [x.strip() for x in v.split(",") if x.strip()]
    return names
