"""A short table of every result file in a folder: ``python scripts/results_table.py DIR [DIR ...]``.

Reads the JSON that ``pagedattn bench`` (kernels), ``bench e2e``, ``bench host``,
``pagedattn.bench.mla``, ``pagedattn.bench.waves``, ``scripts/gpu_prefill_sweep.py`` and ``scripts/mixed_breakdown.py``
write (and ``scripts/gpu_run.sh`` collects), in the folder and its ``cur/`` and ``ab/``
subfolders, and prints one markdown table per file: times per case and provider. Files of
another shape are named and skipped. ``docs/bench/results`` is such a folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _t(us) -> str:
    if us is None:
        return "-"
    return f"{us / 1000:.2f} ms" if us >= 10000 else f"{us:.1f} us"


def _pivot(rows: list[tuple[str, str, str]]) -> list[str]:
    """rows of (row label, column label, cell) -> markdown lines, in first-seen order."""
    labels, cols, cells = [], [], {}
    for r, c, v in rows:
        if r not in labels:
            labels.append(r)
        if c not in cols:
            cols.append(c)
        cells[r, c] = v
    out = ["| case | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    out += ["| " + r + " | " + " | ".join(cells.get((r, c), "-") for c in cols) + " |" for r in labels]
    return out


def table(data) -> list[str] | None:
    if isinstance(data, dict) and data.get("records") and "case" in data["records"][0]:  # bench kernels
        rows = []
        for r in data["records"]:
            if r.get("status") == "ok":
                cell = _t(r["time_us"])
            else:
                cell = r.get("status", "?")
            rows.append((r["case"], r["provider"], cell))
        return _pivot(rows)
    if isinstance(data, dict) and data.get("records") and "B" in data["records"][0]:  # MLA
        return _pivot([(f"B={r['B']} L={r['L']}", r["provider"],
                        f"{_t(r['time_us'])}, {r['tflops']:.0f} TF/s" if r.get("time_us") else "-")
                       for r in data["records"]])
    if isinstance(data, dict) and data.get("records") and "tpot_ms" in data["records"][0]:  # e2e
        return _pivot([(f"batch {r['batch']}, {r['prompt_len']} + {r['output_len']}", r["attention"],
                        f"TTFT {r['ttft_ms']:.1f} ms, TPOT {r['tpot_ms']:.2f} ms") for r in data["records"]])
    if isinstance(data, dict) and data.get("rows") and "persistent_us" in data["rows"][0]:  # waves
        rows = []
        for r in data["rows"]:
            case = f"replay {r['batch']} x {r['context']}"
            rows.append((case, f"persistent {r['schedule']}", _t(r["persistent_us"])))
            rows.append((case, "variable grid", _t(r["variable_grid_us"])))
            rows.append((case, "best at the true size", f"{_t(r['best_true_size_us'])} ({r['true_size_path']})"))
        return _pivot(rows)
    if isinstance(data, dict) and data.get("rows") and "host_us" in data["rows"][0]:  # bench host
        rows = []
        for r in data["rows"]:
            case = f"{r['call']} {r['case']} ({r.get('path') or r.get('plan') or '-'})"
            rows.append((case, "host", _t(r["host_us"])))
            rows.append((case, "GPU", _t(r.get("gpu_us"))))
        return _pivot(rows)
    if isinstance(data, dict) and data.get("rows") and "us" in data["rows"][0]:  # prefill sweep
        return _pivot([(f"head {r['d']} S={r['s']}", f"{r['provider']} {r['cfg']}".strip(), _t(r["us"]))
                       for r in data["rows"]])
    if isinstance(data, list) and data and "name" in data[0] and "time_us" in data[0]:  # mixed parts
        return _pivot([(r["name"], "time", _t(r["time_us"])) for r in data])
    return None


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    for folder in map(Path, argv):
        files = sorted(folder.glob("*.json")) + sorted(folder.glob("cur/*.json")) + sorted(folder.glob("ab/*.json"))
        if not files:
            print(f"{folder}: no result files")
        for f in files:
            try:
                lines = table(json.loads(f.read_text()))
            except (ValueError, KeyError, TypeError, IndexError) as e:
                lines, why = None, f"{type(e).__name__}: {e}"
            else:
                why = "not a known result format"
            if lines is None:
                print(f"{f.relative_to(folder)}: skipped ({why})\n")
                continue
            print(f"**{f.relative_to(folder)}**\n")
            print("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
