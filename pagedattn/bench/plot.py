"""Plots from a results JSON: ``python -m pagedattn.bench.plot results.json --out DIR``.

decode.png: GB/s against context, one panel per batch size, one line per provider (the read
ceiling dashed). prefill.png: TFLOP/s against sequence length (the matmul ceiling dashed).
Needs matplotlib (``pip install pagedattn[bench]``); without it, says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections import defaultdict
from pathlib import Path


def _series(records, workload, x_key, y_key, group_key=None):
    """{group: {provider: [(x, y), ...]}} over the records that passed and were timed."""
    out = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r["workload"] != workload or r["status"] != "ok" or r.get(y_key) is None:
            continue
        group = r["params"].get(group_key) if group_key else None
        out[group][r["provider"]].append((r["params"][x_key], r[y_key]))
    return out


def _title(results) -> str:
    m = results["machine"]
    device = m.get("gpu") or m["device"]
    return f"{device}, {results['config']['dtype']}, torch {m['torch']}, triton {m['triton']}"


def plot(results: dict, out_dir) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ceilings = results.get("ceilings") or {}
    written = []

    decode = _series(results["records"], "decode", "context", "gbps", "batch")
    if decode:
        batches = sorted(decode)
        fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.6), squeeze=False)
        for ax, b in zip(axes[0], batches):
            for provider, pts in decode[b].items():
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, marker="o", label=provider)
            if ceilings.get("read_gbps"):
                ax.axhline(ceilings["read_gbps"], ls="--", c="gray", label="read ceiling")
            ax.set(xscale="log", xlabel="context L (tokens)", ylabel="KV GB/s", title=f"decode B={b}")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(_title(results), fontsize=9)
        fig.tight_layout()
        written.append(out_dir / "decode.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

    prefill = _series(results["records"], "prefill", "seq_len", "tflops")
    if prefill:
        fig, ax = plt.subplots(figsize=(5, 3.6))
        for provider, pts in prefill[None].items():
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, marker="o", label=provider)
        if ceilings.get("matmul_tflops"):
            ax.axhline(ceilings["matmul_tflops"], ls="--", c="gray", label="bf16 matmul")
        ax.set(xscale="log", xlabel="sequence length S", ylabel="TFLOP/s (causal)", title="prefill")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.suptitle(_title(results), fontsize=9)
        fig.tight_layout()
        written.append(out_dir / "prefill.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedattn.bench.plot", description=__doc__.splitlines()[0])
    p.add_argument("results", help="results JSON written by python -m pagedattn.bench")
    p.add_argument("--out", default="bench_out/plots", help="output folder (default: %(default)s)")
    args = p.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed; skipping plots (pip install matplotlib)", file=sys.stderr)
        return 0
    results = json.loads(Path(args.results).read_text())
    written = plot(results, args.out)
    if not written:
        print("no decode or prefill records that passed; nothing to plot", file=sys.stderr)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
