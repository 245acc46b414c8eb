"""Time pagedattn.helion against pagedattn's Triton path on the reference workloads.

    python -m pagedattn.helion.bench [--json OUT/helion_bench.json] [--cases decode,prefill,...] [--quick]
                                     [--peers flashinfer,cudnn-paged | --no-peers]

Llama-3.1-8B's attention shape (32 q heads, 8 KV heads, head size 128, page 16), bf16, causal.
Both sides get a plan made once (as an engine step would) and write into preallocated outputs;
each call is timed by ``pagedattn.bench.timing.bench`` (CUDA-graph replays for short calls,
``triton.testing.do_bench`` medians otherwise), the eager time beside it. The table also gives
the largest |difference| between the two outputs. ``--quick``: tiny shapes (also on the CPU,
where the numbers only show that it runs; the Triton side then runs in Triton's interpreter).

Peers (``--peers``, names of :data:`pagedattn.bench.providers.PROVIDERS`; FlashInfer's paged
wrappers and cuDNN's paged SDPA graph by default) run on the same inputs through their
providers, planned in ``prepare`` outside the timing. A peer's output is checked against the
Triton output (``pagedattn.bench.check.TOLERANCE``) before it is timed; one that disagrees is
not timed. A peer that is not available (not installed, no GPU) is left out, with its reason.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

__all__ = ["CASES", "PEERS", "peer_availability", "run_case", "markdown_table", "main"]

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
PEERS = ("flashinfer", "cudnn-paged")  # provider names in pagedattn.bench.providers.PROVIDERS


def _inputs(segments, shape, device, dtype):
    from pagedattn.bench.workloads import Case, build_inputs

    params = dict(shape, segments=[list(s) for s in segments], sliding_window=None, softcap=None, sinks=False)
    return build_inputs(Case(name="helion-bench", workload="bench", kind="bench", params=params), device, dtype)


def peer_availability(names) -> dict[str, tuple[bool, str]]:
    """name -> (available, why not) of each peer provider."""
    from pagedattn.bench.providers import PROVIDERS

    out = {}
    for name in names:
        try:
            out[name] = PROVIDERS[name].available()
        except Exception as e:  # noqa: BLE001 - a peer whose probe breaks is unavailable, the run goes on
            out[name] = (False, f"{type(e).__name__}: {str(e)[:200]}")
    return out


def _time_peer(name: str, inputs, expected: torch.Tensor | None, device) -> dict:
    """Check one peer provider against ``expected`` (the Triton output), then time it.

    ``status``: ok (timed), skip (the provider does not serve the case), fail (its output
    disagrees: not timed) or error (it raised)."""
    from pagedattn.bench.check import TOLERANCE
    from pagedattn.adapters.common import NotApplicable
    from pagedattn.bench.providers import PROVIDERS
    from pagedattn.bench.timing import bench

    prov = PROVIDERS[name]
    supported, why = prov.supports(inputs.case)
    if not supported:
        return {"status": "skip", "reason": why}
    if expected is None:
        return {"status": "skip", "reason": "no Triton output to check against"}
    try:
        prepared = prov.prepare(inputs)  # plans and compiles outside the timing
        got = prepared.to_tokens(prepared())
        diff = float((got.float() - expected.float()).abs().max())
        tol = TOLERANCE[expected.dtype]
        entry = {"max_abs_diff": diff, "tolerance": tol, "note": prepared.note}
        if not diff <= tol:  # NaN fails too
            return {**entry, "status": "fail", "reason": f"max abs diff {diff:.3g} to the Triton output > {tol:g}"}
        return {**entry, **bench([prepared], device), "status": "ok"}
    except NotApplicable as e:
        return {"status": "skip", "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - a broken peer is reported, the run goes on
        return {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:200]}"}


def run_case(name: str, segments, shape, device, dtype, peers=()) -> dict:
    """Helion and the Triton path on one case, and each peer provider in ``peers`` (available ones)."""
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
    expected = None if "error" in rec["triton"] else t_out
    rec["peers"] = {p: _time_peer(p, inputs, expected, device) for p in peers}
    timed = {p: e["time_us"] for p, e in rec["peers"].items() if e["status"] == "ok"}
    if timed:
        rec["best_peer"] = min(timed, key=timed.get)
        rec["best_peer_us"] = timed[rec["best_peer"]]
    return rec


def _release(device) -> None:
    """Hand the finished case's cached blocks back before the next case allocates its cache."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _us(side: dict, key: str = "time_us") -> str:
    if "error" in side:
        return "error"
    return f"{side[key]:.1f}" if side.get(key) is not None else "-"


def _peer_cell(entry: dict | None) -> str:
    if entry is None or entry["status"] == "skip":
        return "-"
    return f"{entry['time_us']:.1f}" if entry["status"] == "ok" else entry["status"]


def _line(r: dict, peers=()) -> str:
    t, h = r["triton"], r["helion"]
    ratio = f"{h['time_us'] / t['time_us']:.2f}" if "time_us" in t and "time_us" in h else "-"
    diff = f"{r['max_abs_diff']:.1e}" if "max_abs_diff" in r else "-"
    cells = [_peer_cell(r.get("peers", {}).get(p)) for p in peers]
    vs_peer = f"{h['time_us'] / r['best_peer_us']:.2f}" if "time_us" in h and r.get("best_peer_us") else "-"
    return (f"| {r['case']} | {_us(t)} | {_us(h)} | {ratio} | " + "".join(f"{c} | " for c in cells)
            + f"{vs_peer} | {_us(t, 'eager_us')} | {_us(h, 'eager_us')} | {r['triton_path']} | {diff} |")


def _header(peers=()) -> str:
    cols = (["case", "triton us", "helion us", "helion / triton"] + [f"{p} us" for p in peers]
            + ["helion / best peer", "triton eager us", "helion eager us", "triton path", "max abs diff"])
    return "| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|"


def _peers_of(records: list[dict]) -> list[str]:
    """The peers that ran, in the order of the first record that has them."""
    return list(dict.fromkeys(p for r in records for p in r.get("peers", {})))


def markdown_table(records: list[dict], unavailable: dict | None = None) -> str:
    """The table, one column per peer that ran; below it the errors, the peers' skips and
    failures, and the peers left out (``unavailable``: name -> reason)."""
    peers = _peers_of(records)
    errors = [f"- {r['case']} {side}: {r[side]['error']}" for r in records for side in ("triton", "helion")
              if "error" in r[side]]
    notes = [f"- {r['case']} {p}: {e['status']}: {e['reason']}" for r in records
             for p, e in r.get("peers", {}).items() if e["status"] != "ok"]
    left_out = [f"- peer {p} left out: {why}" for p, why in (unavailable or {}).items()]
    return "\n".join([_header(peers)] + [_line(r, peers) for r in records] + errors + notes + left_out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedattn.helion.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the records here")
    p.add_argument("--md", help="write the markdown table (with the device line) here")
    p.add_argument("--cases", help="comma list of name prefixes (decode, prefill, extend, mixed, hetero)")
    p.add_argument("--quick", action="store_true", help="tiny shapes (runs on the CPU too)")
    p.add_argument("--peers", default=",".join(PEERS),
                   help="comma list of peer providers timed beside (default: %(default)s)")
    p.add_argument("--no-peers", action="store_true", help="time Helion and the Triton path only")
    args = p.parse_args(argv)
    from pagedattn.bench.cli import select_device
    from pagedattn.bench.providers import PROVIDERS

    device = select_device()  # the GPU, or the CPU where TRITON_INTERPRET=1 (as the kernels suite picks)
    peer_names = [] if args.no_peers else [n.strip() for n in args.peers.split(",") if n.strip()]
    unknown = [n for n in peer_names if n not in PROVIDERS]
    if unknown:
        p.error(f"unknown peer(s) {unknown}; choose from {', '.join(PROVIDERS)}")
    availability = peer_availability(peer_names)
    peers = [n for n in peer_names if availability[n][0]]
    unavailable = {n: why for n, (ok, why) in availability.items() if not ok}
    for n, why in unavailable.items():
        print(f"peer {n} left out: {why}", file=sys.stderr, flush=True)
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
    peer_info = {n: {"available": ok, "reason": why, "description": PROVIDERS[n].description}
                 for n, (ok, why) in availability.items()}
    records = []

    def save():  # after every case: a run cut short by a time limit keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": device_name, "dtype": str(dtype), "shape": shape, "helion_configs": tuned,
                           "peers": peer_info, "records": records}, f, indent=1)
        if args.md:
            with open(args.md, "w") as f:
                f.write(title + "\n\n" + markdown_table(records, unavailable) + "\n")

    print(_header(peers), flush=True)  # rows as they finish; the whole table again at the end
    for name, segments in cases.items():
        records.append(run_case(name, segments, shape, device, dtype, peers))
        _release(device)
        print(_line(records[-1], peers), flush=True)
        save()
    print("\n" + title + "\n\n" + markdown_table(records, unavailable))
    failed = any("error" in r[s] for r in records for s in ("triton", "helion"))
    return 1 if failed else 0


def _interpreter_on_cpu(argv) -> None:
    """Without a GPU the Triton side runs in Triton's interpreter, which has to be switched on
    before Triton is imported; importing this package imported it already (through Helion), so
    the command starts again with ``TRITON_INTERPRET=1``."""
    if torch.cuda.is_available() or "TRITON_INTERPRET" in os.environ:
        return
    os.execve(sys.executable, [sys.executable, "-m", "pagedattn.helion.bench", *argv],
              {**os.environ, "TRITON_INTERPRET": "1"})


if __name__ == "__main__":
    _interpreter_on_cpu(sys.argv[1:])
    sys.exit(main())
