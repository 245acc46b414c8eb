"""Where the mixed case's time goes, on a GPU:

    PYTHONPATH=. python scripts/mixed_breakdown.py [--json FILE]

The mixed batch (one 2048-token prefill + 63 decodes at 2049 keys, Llama shape, bf16) timed
as one planned call, and its parts alone: the prefill (sequence 0's metadata), the 63 decodes on
each decode path, and the two parts on two streams (the decodes forked to a side stream inside
one graph). Every variant is a CUDA-graph replay (bench.timing with prefer_graph), checked
against the one-call output.
"""

import argparse
import json

import torch

from pagedattn.api import paged_attention
from pagedattn.bench.timing import bench
from pagedattn.bench.workloads import build_inputs, make_cases
from pagedattn.plan import plan_attention


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU interpreter (a smoke test)")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.quick else "cuda")
    case = make_cases(["mixed"], quick=args.quick, tiny_heads=args.quick)[0]
    x = build_inputs(case, dev, torch.float16 if args.quick else torch.bfloat16)
    heads = dict(num_q_heads=x.q.shape[1], num_kv_heads=x.k_cache.shape[2], head_size=x.q.shape[2],
                 device=dev, dtype=x.q.dtype)
    qsl, lens = x.query_start_loc.cpu(), x.seq_lens.cpu()
    n_pre = int(qsl[1])
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = torch.empty_like(x.q)

    def call(lo, hi, path, o):
        """paged_attention on sequences [lo, hi) (their metadata as views), planned on ``path``."""
        q0 = int(qsl[lo])
        sub_qsl = x.query_start_loc[lo:hi + 1] - q0
        plan = plan_attention(qsl[lo:hi + 1] - q0, lens[lo:hi], path=path, **heads)
        q = x.q[q0:int(qsl[hi])]
        args = (q, x.k_cache, x.v_cache, x.block_table[lo:hi], x.seq_lens[lo:hi], sub_qsl)
        return lambda: paged_attention(*args, out=o, plan=plan, causal=True,
                                       max_query_len=plan.max_query_len, max_seq_len=plan.max_seq_len), plan.path

    n = len(lens)
    ref = torch.empty_like(x.q)
    full, _ = call(0, n, "auto", ref)
    full()
    sync()
    rows = []

    def row(name, fn, check=None):
        out.fill_(float("nan"))
        fn()
        sync()
        err = None
        if check is not None:
            err = float((out[check] - ref[check]).abs().max())
        t = bench([fn], dev, prefer_graph=True)
        rows.append(dict(name=name, time_us=t["time_us"], max_err=err))
        print(f"{name:44s} {t['time_us']:9.1f} us  err {err}", flush=True)

    row("mixed, one planned call (auto)", call(0, n, "auto", out)[0], slice(None))
    pre, _ = call(0, 1, "auto", out[:n_pre])
    row("prefill alone (seq 0)", pre, slice(0, n_pre))
    decs = {}
    for path in ("auto", "unified", "split_kv", "persistent"):
        fn, chosen = call(1, n, path, out[n_pre:])
        decs[path] = fn
        row(f"decodes alone ({path} -> {chosen})", fn, slice(n_pre, None))
    if dev.type == "cpu":
        return
    side = torch.cuda.Stream()

    def two_streams(dec):
        def fn():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                dec()
            pre()
            torch.cuda.current_stream().wait_stream(side)
        return fn

    for path in ("auto", "split_kv", "persistent"):
        row(f"two streams: prefill + decodes ({path})", two_streams(decs[path]), slice(None))
    row("serial: prefill then decodes (auto)", lambda: (pre(), decs["auto"]()), slice(None))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
