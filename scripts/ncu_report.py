"""Nsight Compute on one bench case: the call to profile, and a summary of its exports.

Two steps, on the GPU machine (Firecracker machines read the hardware counters; pass
``--clock-control none`` so the clocks stay as the bench sees them):

    ncu --clock-control none --set full --import-source no -k regex:"prefill_gluon|device_kernel" \\
        --launch-skip 2 --launch-count 1 -o /tmp/ncu/gluon \\
        python3 scripts/ncu_report.py target --provider pagedattn-gluon --case "S=8192"
    ncu -i /tmp/ncu/gluon.ncu-rep --page details --csv > /tmp/ncu/gluon.details.csv
    ncu -i /tmp/ncu/gluon.ncu-rep --page source --csv --print-source sass > /tmp/ncu/gluon.sass.csv
    python3 scripts/ncu_report.py summarize --kernel gluon=/tmp/ncu/gluon --out ncu.json

``target`` prepares one case of ``pagedattn bench kernels`` for one provider (``vllm-fa3``
needs vLLM on the path) and makes three calls; ``-k`` and ``--launch-skip`` pick the kernel
and the call. ``summarize`` reads the details page (throughput, scheduler and warp-state
metrics) and the SASS source page of each kernel and writes, per kernel: the metrics, the
instructions executed and stall samples by opcode, the stall reasons, and the hot blocks
(consecutive instructions executed equally often, over ``--min-share`` of the kernel's
instructions: a loop body, or a branch of one) with their opcode counts and stall shares.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import re
import sys

METRICS = ("Duration", "Elapsed Cycles", "SM Active Cycles", "SM Frequency", "Compute (SM) Throughput",
           "Memory Throughput", "Issue Slots Busy", "Executed Ipc Active", "No Eligible",
           "Active Warps Per Scheduler", "Eligible Warps Per Scheduler", "Warp Cycles Per Issued Instruction",
           "Executed Instructions", "Registers Per Thread", "Dynamic Shared Memory Per Block", "Grid Size",
           "Block Size", "L2 Hit Rate")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def opcode(source: str) -> str:
    """``HGMMA`` of ``@!P1 HGMMA.64x64x16.F32.BF16 R88, ...``: the instruction without its
    predicate and modifiers."""
    text = _PREDICATE.sub("", source.strip())
    return text.split()[0].split(".")[0] if text else "?"


def read_details(path: str) -> dict:
    """The METRICS of the details page (the first kernel in it), as ``{name: (value, unit)}``."""
    out = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            name = row.get("Metric Name")
            if name in METRICS and name not in out:
                out[name] = (row["Metric Value"], row.get("Metric Unit", ""))
    return out


def read_sass(path: str) -> list[dict]:
    """The rows of a ``--page source --print-source sass`` export (its first line names the
    kernel and is skipped)."""
    with open(path, newline="") as f:
        next(f)
        return list(csv.DictReader(f))


def summarize_sass(rows: list[dict], min_share: float = 0.004) -> dict:
    stall_cols = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    executed = [_number(r["Instructions Executed"]) for r in rows]
    samples = [_number(r["Warp Stall Sampling (All Samples)"]) for r in rows]
    total, total_samples = sum(executed) or 1.0, sum(samples) or 1.0
    by_op, samples_by_op, stalls = collections.Counter(), collections.Counter(), collections.Counter()
    for r, n, s in zip(rows, executed, samples):
        op = opcode(r["Source"])
        by_op[op] += n
        samples_by_op[op] += s
        for c in stall_cols:
            stalls[c.removeprefix("stall_")] += _number(r[c])
    blocks = []
    start = 0
    for i in range(1, len(rows) + 1):
        if i < len(rows) and executed[i] == executed[start]:
            continue
        share = executed[start] * (i - start) / total
        if share > min_share:
            block_stalls = collections.Counter()
            for r in rows[start:i]:
                for c in stall_cols:
                    block_stalls[c.removeprefix("stall_")] += _number(r[c])
            block_samples = sum(samples[start:i]) or 1.0
            blocks.append(dict(rows=[start, i - 1], times=executed[start], length=i - start,
                               instruction_share=round(share, 4),
                               sample_share=round(sum(samples[start:i]) / total_samples, 4),
                               opcodes=dict(collections.Counter(opcode(r["Source"]) for r in rows[start:i])
                                            .most_common(16)),
                               stalls={k: round(v / block_samples, 4) for k, v in block_stalls.most_common(8)}))
        start = i
    return dict(instructions=total, samples=total_samples,
                by_opcode={op: dict(instructions=n, instruction_share=round(n / total, 4),
                                    sample_share=round(samples_by_op[op] / total_samples, 4))
                           for op, n in by_op.most_common(30)},
                stalls={k: round(v / total_samples, 4) for k, v in stalls.most_common()},
                hot_blocks=blocks)


def summarize(kernels: dict[str, str], min_share: float) -> dict:
    """``{label: prefix}`` -> ``{label: summary}`` from ``prefix.details.csv`` and ``prefix.sass.csv``."""
    out = {}
    for label, prefix in kernels.items():
        entry = dict(metrics=read_details(prefix + ".details.csv"))
        entry.update(summarize_sass(read_sass(prefix + ".sass.csv"), min_share))
        out[label] = entry
    return out


def print_table(summary: dict) -> None:
    for label, s in summary.items():
        m = s["metrics"]
        print(f"== {label}: {m.get('Duration', ('?', ''))[0]} {m.get('Duration', ('', ''))[1]}, "
              f"{s['instructions'] / 1e6:.1f} M instructions, issue slots busy {m.get('Issue Slots Busy', ('?',))[0]}%")
        print("   stalls: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in list(s["stalls"].items())[:8]))
        for b in s["hot_blocks"]:
            ops = " ".join(f"{k}:{v}" for k, v in list(b["opcodes"].items())[:10])
            print(f"   x{b['times']:.0f} {b['length']} instrs, {100 * b['instruction_share']:.1f}% of instructions, "
                  f"{100 * b['sample_share']:.1f}% of samples: {ops}")


def run_target(provider: str, case: str, workload: str, calls: int) -> None:
    import torch

    from pagedattn.bench.providers import PROVIDERS
    from pagedattn.bench.workloads import build_inputs, make_cases

    matches = [c for c in make_cases((workload,)) if case in c.name]
    if not matches:
        raise SystemExit(f"no {workload} case matches {case!r}")
    prepared = PROVIDERS[provider].prepare(build_inputs(matches[0], torch.device("cuda"), torch.bfloat16, seed=0))
    for _ in range(calls):
        prepared()
    torch.cuda.synchronize()
    print(f"{provider}: {matches[0].name}, {calls} calls")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("target", help="prepare one bench case for one provider and call it (run under ncu)")
    t.add_argument("--provider", required=True)
    t.add_argument("--case", required=True, help="a substring of the case's name, e.g. 'S=8192'")
    t.add_argument("--workload", default="prefill")
    t.add_argument("--calls", type=int, default=3)
    s = sub.add_parser("summarize", help="summarize ncu's details and SASS source exports")
    s.add_argument("--kernel", action="append", required=True, metavar="LABEL=PREFIX",
                   help="PREFIX.details.csv and PREFIX.sass.csv of one profiled kernel")
    s.add_argument("--min-share", type=float, default=0.004, help="smallest hot block, a share of instructions")
    s.add_argument("--out", help="write the summary as JSON here")
    args = p.parse_args(argv)
    if args.command == "target":
        run_target(args.provider, args.case, args.workload, args.calls)
        return 0
    kernels = dict(k.split("=", 1) for k in args.kernel)
    summary = summarize(kernels, args.min_share)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    print_table(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
