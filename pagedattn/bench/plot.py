"""Plots from a results JSON: pagedattn bench plot results.json --out DIR.

decode.png: GB/s against context, one panel per batch size, one line per provider (the read
ceiling dashed). prefill.png: TFLOP/s against sequence length (the matmul ceiling dashed).

waves.png, from what ``python -m pagedattn.bench.waves`` writes (its JSON, or the JSON lines it
prints, e.g. docs/bench/results/waves.json): one panel per replayed batch (1 x 500, 8 x 4096,
64 x 2048), bars for the variable grid captured at the maximum, the persistent kernel
captured at the maximum (static and atomic schedules) and the best plan at the true size, with
the target (persistent within 10% of the true-size time) dashed.

Needs matplotlib (``pip install -e ".[bench]"`` from the checkout); without it, says so and exits 0.
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


WAVES_BARS = (
    ("variable_grid_us", "variable grid\ncaptured @ max"),
    ("persistent_static_us", "persistent\nstatic @ max"),
    ("persistent_atomic_us", "persistent\natomic @ max"),
    ("persistent_auto_us", "persistent\nauto @ max\n(default)"),
    ("best_true_size_us", "best plan\n@ true size"),
    ("best_true_size_eager_us", "best plan\neager, true size"),
)


def load_waves(text: str) -> dict:
    """The waves results as ``{"rows": [...], ...}`` from waves.py's JSON (a dict with "rows", or
    the bare list of rows of older runs) or from its printed log (one JSON row per line)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        rows = [json.loads(line) for line in text.splitlines() if line.lstrip().startswith("{")]
        return {"rows": rows}
    return {"rows": data} if isinstance(data, list) else data


def is_waves(data) -> bool:
    rows = data if isinstance(data, list) else data.get("rows") if isinstance(data, dict) else None
    return bool(rows) and all(isinstance(r, dict) and "persistent_us" in r for r in rows)


def waves_cases(rows: list) -> list[dict]:
    """One dict per replayed (batch, context), in first-seen order, with the four bar values
    (None where the run did not measure one) and the true-size plan's name."""
    cases: dict = {}
    for r in rows:
        c = cases.setdefault((r["batch"], r["context"]), {"batch": r["batch"], "context": r["context"]})
        c[f"persistent_{r.get('schedule', 'static')}_us"] = r["persistent_us"]
        for key in ("variable_grid_us", "best_true_size_us", "best_true_size_eager_us", "true_size_path"):
            if r.get(key) is not None:
                c[key] = r[key]
    return list(cases.values())


def plot_waves(data: dict, out_path) -> Path:
    """Bar plot of the waves experiment (module docstring) saved as ``out_path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = waves_cases(data["rows"])
    if not cases:
        raise ValueError("no waves rows to plot")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    colors = dict(zip((key for key, _ in WAVES_BARS), ("tab:gray", "tab:blue", "tab:cyan", "tab:purple", "tab:green", "tab:olive")))
    shown = [(key, label) for key, label in WAVES_BARS if any(c.get(key) is not None for c in cases)]
    fig, axes = plt.subplots(1, len(cases), figsize=(0.9 * len(shown) * len(cases) + 0.8, 3.8), squeeze=False)
    for ax, case in zip(axes[0], cases):
        labels = [label for _, label in shown]
        values = [case.get(key) for key, _ in shown]
        xs = range(len(values))
        bars = ax.bar(xs, [v or 0.0 for v in values], color=[colors[key] for key, _ in shown])
        for bar, v in zip(bars, values):
            text = "n/a" if v is None else f"{v:.1f}"
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=7)
        best = case.get("best_true_size_us")
        if best:
            ax.axhline(1.1 * best, ls="--", c="tab:red", lw=1, label="target: 1.1 x true size")
            ax.legend(fontsize=6, loc="upper right")
        title = f"replay B={case['batch']} x L={case['context']}"
        if case.get("true_size_path"):
            title += f"\n(true size: {case['true_size_path']})"
        ax.set_title(title, fontsize=8)
        ax.set_xticks(list(xs), labels, fontsize=6)
        ax.set_ylabel("µs per replay")
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.15)
    capture = data.get("capture") or {}
    suptitle = "one CUDA graph captured at the maximum batch, replayed at smaller ones"
    if capture:
        suptitle += f" (max {capture.get('max_seqs')} x {capture.get('max_context')})"
    machine = data.get("machine") or {}
    if machine.get("gpu"):
        suptitle += f"\n{machine['gpu']}, torch {machine.get('torch')}, triton {machine.get('triton')}"
    fig.suptitle(suptitle, fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pagedattn bench plot", description=__doc__.splitlines()[0])
    p.add_argument("results", help="results JSON written by pagedattn bench kernels, or the waves JSON / log "
                                   "written by pagedattn bench waves")
    p.add_argument("--out", default="bench_out/plots", help="output folder (default: %(default)s)")
    args = p.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed; skipping plots (pip install matplotlib)", file=sys.stderr)
        return 0
    text = Path(args.results).read_text()
    waves = load_waves(text)
    if is_waves(waves):
        print(plot_waves(waves, Path(args.out) / "waves.png"))
        return 0
    results = json.loads(text)
    written = plot(results, args.out)
    if not written:
        print("no decode or prefill records that passed; nothing to plot", file=sys.stderr)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
