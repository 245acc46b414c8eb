"""pagedattn bench tune: sweep the decode tile and split settings on a GPU.

For each decode case and each (path, TILE_N, num_warps, num_stages, num_splits) it checks the
output against the default configuration's and times CUDA-graph replays over rotated input
copies. Prints one line per configuration and the best per case; writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys

import torch


def case_copies_and_plan(case, device):
    """(bf16 input copies to rotate over, the default plan) of one decode case."""
    from pagedattn.bench.timing import copies_for
    from pagedattn.bench.workloads import build_inputs, work
    from pagedattn.plan import plan_attention

    inputs = build_inputs(case, device, torch.bfloat16)
    n = copies_for(work(case, torch.bfloat16)["kv_bytes"], device)
    copies = [inputs] + [build_inputs(case, device, torch.bfloat16, seed=i) for i in range(1, n)]
    q = inputs.q
    plan = plan_attention(inputs.query_start_loc.cpu(), inputs.seq_lens.cpu(), num_q_heads=q.shape[1],
                          num_kv_heads=inputs.k_cache.shape[2], head_size=q.shape[2], device=device)
    return copies, plan


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pagedattn bench tune",
                                     description="Sweep the decode tile and split settings (GPU only); each "
                                                 "configuration is checked against the default one, then timed.")
    parser.add_argument("--case", action="append", default=None,
                        help="keep decode cases whose name contains this, e.g. 'B=1 L=32768' (repeatable)")
    parser.add_argument("--json", default=None, help="also write every configuration's record to this file")
    parser.add_argument("--tile-n", default="32,64,128", help="comma list of KV tile sizes (default: %(default)s)")
    parser.add_argument("--warps", default="2,4,8", help="comma list of num_warps (default: %(default)s)")
    parser.add_argument("--stages", default="2,3,4", help="comma list of num_stages (default: %(default)s)")
    parser.add_argument("--splits", default="auto", help="comma list of split counts, or auto (default: %(default)s)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("pagedattn bench tune needs a GPU (it times CUDA-graph replays); none is available here.",
              file=sys.stderr)
        return 2

    from pagedattn.api import paged_attention
    from pagedattn.bench.timing import bench
    from pagedattn.bench.workloads import make_cases, work
    from pagedattn.plan import plan_attention

    device = torch.device("cuda")
    cases = [c for c in make_cases(["decode"]) if not args.case or any(s in c.name for s in args.case)]
    results = []
    for case in cases:
        copies, base_plan = case_copies_and_plan(case, device)
        inputs, q, nbytes = copies[0], copies[0].q, work(case, torch.bfloat16)["kv_bytes"]
        ref = paged_attention(*inputs.paged_args(), plan=base_plan, **inputs.paged_kwargs())
        split_list = [None if s == "auto" else int(s) for s in args.splits.split(",")]
        best = None
        for tile_n, warps, stages, splits in itertools.product(
            [int(x) for x in args.tile_n.split(",")], [int(x) for x in args.warps.split(",")],
            [int(x) for x in args.stages.split(",")], split_list,
        ):
            path = "auto" if splits is None else ("unified" if splits == 1 else "split_kv")
            plan = plan_attention(inputs.query_start_loc.cpu(), inputs.seq_lens.cpu(), num_q_heads=q.shape[1],
                                  num_kv_heads=inputs.k_cache.shape[2], head_size=q.shape[2], device=device,
                                  path=path, num_splits=splits)
            plan.tiles = dataclasses.replace(plan.tiles, tile_n=tile_n, num_warps=warps, num_stages=stages)
            try:
                outs = [torch.empty_like(x.q) for x in copies]
                fns = [lambda x=x, o=o: paged_attention(*x.paged_args(), out=o, plan=plan, **x.paged_kwargs())
                       for x, o in zip(copies, outs)]
                fns[0]()
                err = (outs[0].float() - ref.float()).abs().max().item()
                t = bench(fns, device, prefer_graph=True)["time_us"]
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a result too
                print(f"{case.name:22s} tile_n={tile_n} warps={warps} stages={stages} splits={splits}: {type(e).__name__}")
                torch.cuda.synchronize()
                continue
            rec = dict(case=case.name, path=plan.path, splits=plan.num_splits, tile_n=tile_n, warps=warps,
                       stages=stages, time_us=t, gbps=nbytes / t / 1e3, err=err)
            results.append(rec)
            print(f"{case.name:22s} {plan.path:8s} splits={plan.num_splits:3d} tile_n={tile_n:3d} warps={warps} "
                  f"stages={stages}: {t:9.1f} us {rec['gbps']:7.0f} GB/s err {err:.1e}", flush=True)
            if err < 5e-2 and (best is None or t < best["time_us"]):
                best = rec
        print("BEST", json.dumps(best), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
