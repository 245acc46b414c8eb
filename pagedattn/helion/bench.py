"""Time pagedattn.helion against pagedattn's Triton path on the reference workloads.

    python -m pagedattn.helion.bench [--json OUT/helion_bench.json] [--cases decode,prefill,...] [--quick]

Llama-3.1-8B's attention shape (32 q heads, 8 KV heads, head size 128, page 16), bf16, causal.
Both sides get a plan made once (as an engine step would) and write into preallocated outputs;
each call is timed by ``pagedattn.bench.timing.bench`` (CUDA-graph replays for short calls,
``triton.testing.do_bench`` medians otherwise), the eager time beside it. The table also gives
the largest |difference| between the two outputs. ``--quick``: tiny shapes (also on the CPU,
where the numbers only show that it runs).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

__all__ = ["CASES", "run_case", "markdown_table", "main"]

SHAPE = dict(num_q_heads=32, num_kv_heads=8, head_size=128, block_size=16)
# name -> segments (count, query_len, seq_len); seq_len counts the new tokens (the workloads' convention)
CASES = {
    "decode B=8 L=4096": [(8, 1, 4096)],
    "decode B=8 L=16384": [(8, 1, 16384)],
    "decode B=32 L=4096": [(32, 1, 4096)],
    "decode B=32 L=16384": [(32, 1, 16384)],
    "prefill S=2048": [(1, 2048, 2048)],
    "prefill S=8192": [(1, 8192, 8192)],
    "extend 4x512@4096": [(4, 512, 4608)],
    "mixed 1x2048+63x1@2049": [(1, 2048, 2048), (63, 1, 2049)],
    "hetero 2x16384 + 126x512": [(2, 1, 16384), (126, 1, 512)],
}
QUICK = {
    "decode B=2 L=200": [(2, 1, 200)],
    "prefill S=64": [(1, 64, 64)],
    "mixed 1x32+3x1@33": [(1, 32, 32), (3, 1, 33)],
}
QUICK_SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_size=32, block_size=16)


def _inputs(segments, shape, device, dtype):
    from pagedattn.bench.workloads import Case, build_inputs

    params = dict(shape, segments=[list(s) for s in segments], sliding_window=None, softcap=None, sinks=False)
    return build_inputs(Case(name="helion-bench", workload="bench", kind="bench", params=params), device, dtype)


def run_case(name: str, segments, shape, device, dtype) -> dict:
    import pagedattn
    import pagedattn.helion as ph
    from pagedattn.bench.timing import bench

    inputs = _inputs(segments, shape, device, dtype)
    qsl = inputs.query_start_loc.tolist()
    lens = inputs.seq_lens.tolist()
    heads = dict(num_q_heads=shape["num_q_heads"], num_kv_heads=shape["num_kv_heads"], head_size=shape["head_size"])
    args = inputs.paged_args()
    t_plan = pagedattn.plan_attention(qsl, lens, device=device, dtype=dtype, **heads)
    h_plan = ph.plan_attention(qsl, lens, device=device, **heads)
    t_out, h_out = torch.empty_like(inputs.q), torch.empty_like(inputs.q)

    def triton_call():
        return pagedattn.paged_attention(*args, max_query_len=inputs.max_query_len, max_seq_len=inputs.max_seq_len,
                                         plan=t_plan, out=t_out)

    def helion_call():
        return ph.paged_attention(*args, plan=h_plan, out=h_out)

    rec = {"case": name, "segments": segments, "triton_path": t_plan.path, "helion_plan": h_plan.stats}
    for side, fn in (("triton", triton_call), ("helion", helion_call)):
        try:
            fn()  # compiles (and, for Helion, binds) outside the timing
            rec[side] = bench([fn], device)
        except Exception as e:  # noqa: BLE001 - one side failing leaves the other's number
            rec[side] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    if "error" not in rec["triton"] and "error" not in rec["helion"]:
        rec["max_abs_diff"] = float((t_out.float() - h_out.float()).abs().max())
    del inputs, t_plan, h_plan, t_out, h_out
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def _us(side: dict, key: str = "time_us") -> str:
    if "error" in side:
        return "error"
    return f"{side[key]:.1f}" if side.get(key) is not None else "-"


def _line(r: dict) -> str:
    t, h = r["triton"], r["helion"]
    ratio = f"{h['time_us'] / t['time_us']:.2f}" if "time_us" in t and "time_us" in h else "-"
    diff = f"{r['max_abs_diff']:.1e}" if "max_abs_diff" in r else "-"
    return (f"| {r['case']} | {_us(t)} | {_us(h)} | {ratio} | {_us(t, 'eager_us')} | {_us(h, 'eager_us')} | "
            f"{r['triton_path']} | {diff} |")


HEADER = ("| case | triton us | helion us | helion / triton | triton eager us | helion eager us | triton path "
          "| max abs diff |\n|---|---|---|---|---|---|---|---|")


def markdown_table(records: list[dict]) -> str:
    errors = [f"- {r['case']} {side}: {r[side]['error']}" for r in records for side in ("triton", "helion")
              if "error" in r[side]]
    return "\n".join([HEADER] + [_line(r) for r in records] + errors)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedattn.helion.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the records here")
    p.add_argument("--md", help="write the markdown table (with the device line) here")
    p.add_argument("--cases", help="comma list of name prefixes (decode, prefill, extend, mixed, hetero)")
    p.add_argument("--quick", action="store_true", help="tiny shapes (runs on the CPU too)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases, shape = (QUICK, QUICK_SHAPE) if args.quick else (CASES, SHAPE)
    if args.cases:
        prefixes = tuple(c.strip() for c in args.cases.split(",") if c.strip())
        cases = {k: v for k, v in cases.items() if k.startswith(prefixes)}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from pagedattn.helion.configs import stored_configs

    tuned = sorted(stored_configs())
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    title = (f"{device_name}, {str(dtype).replace('torch.', '')}, heads {shape['num_q_heads']}/{shape['num_kv_heads']}, "
             f"head size {shape['head_size']}, page {shape['block_size']}; Helion configs: "
             f"{', '.join(tuned) if tuned else 'defaults'}")
    records = []

    def save():  # after every case: a run cut short by a time limit keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": device_name, "dtype": str(dtype), "shape": shape, "helion_configs": tuned,
                           "records": records}, f, indent=1)
        if args.md:
            with open(args.md, "w") as f:
                f.write(title + "\n\n" + markdown_table(records) + "\n")

    print(HEADER, flush=True)  # rows as they finish; the whole table again at the end
    for name, segments in cases.items():
        records.append(run_case(name, segments, shape, device, dtype))
        print(_line(records[-1]), flush=True)
        save()
    print("\n" + title + "\n\n" + markdown_table(records))
    failed = any("error" in r[s] for r in records for s in ("triton", "helion"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
