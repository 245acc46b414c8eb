"""Autotune the Helion kernels once per shape family and write the configs for ``configs.json``.

    python -m pagedattn.helion.tune --out OUT/helion_configs.json [--budget-s 60] [--effort quick]

Families: ``decode`` (its split-KV kernel on decode B=32 L=4096) and ``prefill`` (the prefill
kernel on a causal S=2048 prefill), Llama-3.1-8B's attention shape (32 q heads, 8 KV heads, head
size 128, bf16, page 16); ``--merge`` also tunes the partial-state merge. The sizes that vary
per batch stay symbolic, so one config serves every batch of its family. Each search stops at
its wall-clock budget and keeps the best config it measured.

Without scikit-learn, Helion's default search (LFBO, a random-forest surrogate) cannot run, so
PatternSearch is used unless ``HELION_AUTOTUNER`` names another.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import sys
import time

import torch

__all__ = ["tune", "main"]

SHAPE = dict(num_q_heads=32, num_kv_heads=8, head_size=128, block_size=16)
FAMILY_CASES = {"decode": [(32, 1, 4096)], "prefill": [(1, 2048, 2048)]}  # (count, query_len, seq_len)


def _inputs(segments, device, dtype):
    from pagedattn.bench.workloads import Case, build_inputs

    params = dict(SHAPE, segments=[list(s) for s in segments], sliding_window=None, softcap=None, sinks=False)
    return build_inputs(Case(name="tune", workload="tune", kind="tune", params=params), device, dtype)


def _kernel_args(name: str, inputs, plan) -> tuple:
    from pagedattn.helion.kernels import NO_LIMIT

    q = inputs.q
    scale = 1.0 / math.sqrt(q.shape[2])
    paged = inputs.paged_args()
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    if name == "prefill":
        return (*paged, plan.prefill_items, torch.empty_like(q), lse, scale, 0.0, NO_LIMIT, 1, False, False, False)
    if name == "decode":
        group = q.shape[1] // inputs.k_cache.shape[2]
        return (*paged, plan.decode_items, plan.part_out, plan.part_lse, scale, 0.0, NO_LIMIT, 1, plan.segment,
                max(16, 1 << (group - 1).bit_length()), False, False, False)
    return (plan.part_out, plan.part_lse, plan.decode_tokens, plan.item_start, torch.empty_like(q), lse)


def tune(out_path: str, *, budget_s: int = 60, effort: str = "quick", merge: bool = False,
         device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    """Tune each family's kernel(s); ``{key: config}`` (plus a ``_tuned`` note) goes to ``out_path``
    after each one. Returns the configs found."""
    import helion

    from pagedattn.helion.configs import config_key
    from pagedattn.helion.kernels import KERNELS
    from pagedattn.helion.plan import plan_attention

    if importlib.util.find_spec("sklearn") is None:
        os.environ.setdefault("HELION_AUTOTUNER", "PatternSearch")
    device = torch.device(device)
    results, notes = {}, {}
    header = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "torch": torch.__version__, "helion": importlib.metadata.version("helion"),
        "triton": importlib.metadata.version("triton"), "dtype": str(dtype).replace("torch.", ""),
        "effort": effort, "budget_s": budget_s, "search": os.environ.get("HELION_AUTOTUNER", "default"),
        "shape": SHAPE, "kernels": notes,
    }

    def save():  # after every kernel: a run cut short keeps the configs it found
        with open(out_path, "w") as f:
            json.dump({**results, "_tuned": header}, f, indent=1, sort_keys=True)
            f.write("\n")

    jobs = [("decode", "decode"), ("prefill", "prefill")] + ([("merge", "decode")] if merge else [])
    for name, family in jobs:
        inputs = _inputs(FAMILY_CASES[family], device, dtype)
        plan = plan_attention([0] + _cumsum(inputs.case.query_lens), inputs.case.seq_lens,
                              num_q_heads=SHAPE["num_q_heads"], num_kv_heads=SHAPE["num_kv_heads"],
                              head_size=SHAPE["head_size"], device=device)
        kern = helion.kernel(KERNELS[name], static_shapes=False, autotune_effort=effort,
                             autotune_budget_seconds=budget_s)
        t0 = time.perf_counter()
        try:
            cfg = kern.autotune(_kernel_args(name, inputs, plan), force=True)
        except Exception as e:  # noqa: BLE001 - report and go on: the other family may still tune
            print(f"[tune] {name}: failed: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
            continue
        key = config_key(name, SHAPE["head_size"], SHAPE["block_size"])
        results[key] = dict(cfg.config)
        notes[key] = {"case": FAMILY_CASES[family], "seconds": round(time.perf_counter() - t0, 1)}
        print(f"[tune] {key}: {json.dumps(results[key], sort_keys=True)} ({notes[key]['seconds']} s)", flush=True)
        save()
        del inputs, plan
        torch.cuda.empty_cache()
    return results


def _cumsum(xs):
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedattn.helion.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSON file to write (copy it to pagedattn/helion/configs.json)")
    p.add_argument("--budget-s", type=int, default=60, help="wall-clock budget of each kernel's search")
    p.add_argument("--effort", default="quick", choices=["quick", "full"])
    p.add_argument("--merge", action="store_true", help="also tune the merge of the partial states")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("autotuning needs a CUDA GPU", file=sys.stderr)
        return 2
    results = tune(args.out, budget_s=args.budget_s, effort=args.effort, merge=args.merge)
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
