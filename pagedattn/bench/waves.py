"""pagedattn bench waves: one CUDA graph captured at the maximum batch, replayed for small ones.

pagedattn bench waves [--json PATH] [--plot DIR] (GPU only). Captures decode attention
at batch 256 x context 8192 and replays at 1 x 500, 8 x 4096 and 64 x 2048:

* ``variable-grid@max``: the automatic (unified / split-KV) plan of the maximum batch, captured
  once; at replay the unused sequences have no queries, so their programs start and exit.
* ``persistent@max``: the persistent plan captured once; per replay ``plan.update`` rewrites
  its work list in place (the grid stays fixed, no program is empty).
* ``best@true-size``: the automatic plan made for the true batch and captured at that size
  (what an engine would get with one graph per batch size); ``best_true_size_eager_us`` is the
  same call launched eagerly (host launch overhead included).

Target: persistent@max within 10% of best@true-size.

Writes ``{"machine", "capture", "rows"}`` to ``--json`` (default bench_out/waves.json); each row
is one (batch, context, schedule) with ``persistent_us`` and, on the static rows,
``variable_grid_us``, ``best_true_size_us``, ``best_true_size_eager_us`` and ``true_size_path``.
``pagedattn bench plot bench_out/waves.json --out DIR`` (or ``--plot DIR`` here)
draws DIR/waves.png.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

MAX_SEQS, MAX_CONTEXT = 256, 8192
REPLAYS = [(1, 500), (8, 4096), (64, 2048)]
SHAPE = dict(num_q_heads=32, num_kv_heads=8, head_size=128, block_size=16)


def _graph_us(fn, iters: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return _replay_us(g, iters)


def _replay_us(g, iters: int = 50) -> float:
    return _eager_us(g.replay, iters)


def _eager_us(fn, iters: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pagedattn bench waves",
                                     description="One CUDA graph captured at the maximum batch, replayed for small "
                                                 "ones (GPU only).")
    parser.add_argument("--json", default="bench_out/waves.json", help="results file (default: %(default)s)")
    parser.add_argument("--plot", default=None, help="also draw DIR/waves.png")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("pagedattn bench waves needs a GPU (it captures and replays CUDA graphs); none is available here.",
              file=sys.stderr)
        return 2

    from pagedattn import paged_attention, plan_attention
    from pagedattn.reference import paged_attention_ref
    from pagedattn.testing import make_paged_batch

    dev = "cuda"
    big = make_paged_batch([(1, MAX_CONTEXT)] * MAX_SEQS, dtype=torch.bfloat16, device=dev, **SHAPE)
    q, kc, vc = big.q, big.k_cache, big.v_cache
    bt, sl, qsl = big.block_table, big.seq_lens.clone(), big.query_start_loc.clone()
    out = torch.empty_like(q)
    heads = dict(num_q_heads=32, num_kv_heads=8, head_size=128, device=dev)
    host_qsl, host_sl = qsl.cpu(), sl.cpu()

    def call(plan):
        return paged_attention(q, kc, vc, bt, sl, qsl, plan=plan, out=out, max_query_len=1, max_seq_len=MAX_CONTEXT)

    def set_batch(b, ctx):
        """Write a batch of b decodes at context ctx into the static buffers (the rest: empty)."""
        lens = torch.zeros(MAX_SEQS, dtype=torch.int32)
        lens[:b] = ctx
        starts = torch.arange(MAX_SEQS + 1, dtype=torch.int32).clamp(max=b)
        sl.copy_(lens)
        qsl.copy_(starts)
        return starts[: b + 1], lens[:b]

    variable_plan = plan_attention(host_qsl, host_sl, **heads)
    g_var = torch.cuda.CUDAGraph()
    call(variable_plan)
    torch.cuda.synchronize()
    with torch.cuda.graph(g_var):
        call(variable_plan)
    rows = []
    for schedule in ("static", "atomic", "auto"):
        pers_plan = plan_attention(host_qsl, host_sl, path="persistent", schedule=schedule,
                                   max_num_seqs=MAX_SEQS, max_num_tokens=MAX_SEQS, max_context_len=MAX_CONTEXT, **heads)
        call(pers_plan)
        torch.cuda.synchronize()
        g_pers = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_pers):
            call(pers_plan)
        for b, ctx in REPLAYS:
            starts, lens = set_batch(b, ctx)
            pers_plan.update(starts, lens)
            t_pers = _replay_us(g_pers)
            # correctness of the replayed persistent graph on this batch
            out.fill_(float("nan"))
            g_pers.replay()
            torch.cuda.synchronize()
            ref, _ = paged_attention_ref(q[:b], kc, vc, bt[:b], sl[:b], qsl[: b + 1], compute_dtype=torch.float32)
            err = (out[:b].float() - ref).abs().max().item()
            row = dict(batch=b, context=ctx, schedule=schedule, persistent_us=t_pers, persistent_err=err)
            if schedule == "static":
                row["variable_grid_us"] = _replay_us(g_var)
                true_plan = plan_attention(starts, lens, **heads)
                qb, btb, slb, qslb = q[:b], bt[:b], sl[:b].clone(), qsl[: b + 1].clone()
                outb = torch.empty_like(qb)
                def true_size_call():
                    return paged_attention(qb, kc, vc, btb, slb, qslb, plan=true_plan, out=outb,
                                           max_query_len=1, max_seq_len=ctx)

                row["best_true_size_us"] = _graph_us(true_size_call)
                row["best_true_size_eager_us"] = _eager_us(true_size_call)
                row["true_size_path"] = f"{true_plan.path} x{true_plan.num_splits}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    set_batch(MAX_SEQS, MAX_CONTEXT)
    print("\n| replay (B x L) | variable grid @256x8192 | persistent @256x8192 (static) | persistent (atomic) "
          "| persistent (auto: the plan's choice) | best @ true size | same, eager | auto / best |")
    print("|---|---|---|---|---|---|---|---|")
    for b, ctx in REPLAYS:
        st, at, au = (next(r for r in rows if r["batch"] == b and r["schedule"] == s)
                      for s in ("static", "atomic", "auto"))
        best = st["best_true_size_us"]
        print(f"| {b} x {ctx} | {st['variable_grid_us']:.1f} us | {st['persistent_us']:.1f} us | "
              f"{at['persistent_us']:.1f} us | {au['persistent_us']:.1f} us | {best:.1f} us ({st['true_size_path']}) | "
              f"{st['best_true_size_eager_us']:.1f} us | {au['persistent_us'] / best:.2f} |")
    from pagedattn.bench.report import machine_info, write_json

    results = dict(machine=machine_info(torch.device(dev)),
                   capture=dict(max_seqs=MAX_SEQS, max_context=MAX_CONTEXT, **SHAPE), rows=rows)
    print(f"results: {write_json(results, args.json)}")
    if args.plot:
        from pathlib import Path

        from pagedattn.bench.plot import plot_waves

        print(f"plot: {plot_waves(results, Path(args.plot) / 'waves.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
