"""``pagedattn bench serve``: a synthetic serving trace through the engine, one run per attention.

The trace: ``--num-requests`` requests (default 256) with prompt lengths drawn log-uniformly from
``--prompt-len`` (default 128:8192 tokens) and output lengths uniformly from ``--output-len``
(default 32:512; end-of-sequence ignored), all arriving at once or as a Poisson process of
``--request-rate`` requests/s. The engine runs it with continuous batching: at most
``--max-num-seqs`` sequences at a time and ``--max-num-batched-tokens`` tokens a step, so long
prompts are prefilled in chunks beside the running decodes. Pure-decode steps replay CUDA graphs
(one per batch-size bucket); steps with prefill or extend tokens (mixed) run eagerly, with one
attention plan per step.

Reported per attention: output tokens/s over the trace's wall time; TTFT (arrival to first
token) and TPOT (a request's mean time per output token after its first) at p50 and p99; the
host share: the part of the steps' wall time in which the host was not waiting for the device
(scheduling, metadata, planning and launching until the forward is queued, and the bookkeeping
after the sampled tokens arrive), for all steps, decode steps and mixed steps. A host share
near 1 means the device waited for Python.

Attentions: ``pagedattn`` (automatic path, persistent kernel in the decode graphs), ``pagedattn-2d``
(the unified kernel everywhere), ``sdpa`` (torch SDPA over a contiguous static cache; cuDNN when
it takes the shape) and ``flashinfer`` (FlashInfer's decode and prefill wrappers over the same
paged cache, decode wrappers in the graphs; needs the package and a CUDA device, else it is
reported as not available, with the reason). An attention that fails during the trace is
reported as failed and the others still run.

``--quick``: the tiny preset and a handful of short requests (seconds on the CPU). On the CPU
the kernels run in Triton's interpreter: those numbers say the benchmark works, not how fast
anything is.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import os
import sys
import time
import traceback
from collections import deque

import torch

ATTENTIONS = ("pagedattn", "pagedattn-2d", "sdpa", "flashinfer")
DEFAULT_ATTENTIONS = ("pagedattn", "sdpa", "flashinfer")
FULL = dict(model="llama-3.1-8b", num_requests=256, prompt_len=(128, 8192), output_len=(32, 512),
            max_num_seqs=64, max_num_batched_tokens=2048, warmup_requests=8)
QUICK = dict(model="tiny", num_requests=4, prompt_len=(4, 24), output_len=(2, 5), max_num_seqs=3,
             max_num_batched_tokens=24, warmup_requests=0)
INTERPRETER_NOTE = ("CPU: the kernels ran in Triton's interpreter; these are interpreter numbers, which show the "
                    "benchmark runs, not how fast anything is")


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``pagedattn bench serve`` (see the module docstring)."""
    p.add_argument("--attention", action="append",
                   help=f"comma list of {', '.join(ATTENTIONS)} (default: {','.join(DEFAULT_ATTENTIONS)})")
    p.add_argument("--quick", action="store_true", help="tiny preset, a few short requests (seconds on the CPU)")
    p.add_argument("--model", help="a preset or a Hugging Face folder (default: llama-3.1-8b; tiny with --quick)")
    p.add_argument("--num-requests", type=int, help="requests in the trace (default 256; 4 with --quick)")
    p.add_argument("--prompt-len", type=_range, help="LO:HI prompt tokens, log-uniform (default 128:8192)")
    p.add_argument("--output-len", type=_range, help="LO:HI output tokens, uniform (default 32:512)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals of this many requests/s (default: all at once)")
    p.add_argument("--max-num-seqs", type=int, help="sequences running at once (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget of a step (default 2048)")
    p.add_argument("--num-blocks", type=int, help="KV-cache pages (default: room for max-num-seqs full sequences)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    p.add_argument("--dtype", help="default: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--json", default="bench_out/serve.json", help="results file (default: %(default)s)")
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument("--seed", type=int, default=0)


def select_device() -> torch.device:
    """CUDA when present (and the interpreter not forced), else the CPU under the interpreter
    (set before anything imports a Triton kernel)."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return torch.device("cuda", torch.cuda.current_device())
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return torch.device("cpu")


def make_trace(num_requests: int, prompt_len, output_len, rate: float, vocab_size: int, seed: int) -> list[dict]:
    """Requests ``{"prompt": ids, "output_len": n, "offset_s": arrival after the start}``."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = prompt_len
    u = torch.rand(num_requests, generator=g, dtype=torch.float64)
    lens = torch.exp(math.log(lo) + u * (math.log(hi + 1) - math.log(lo))).floor().clamp(lo, hi).long().tolist()
    outs = torch.randint(output_len[0], output_len[1] + 1, (num_requests,), generator=g).tolist()
    if math.isinf(rate):
        offsets = [0.0] * num_requests
    else:
        gaps = torch.empty(num_requests, dtype=torch.float64).exponential_(rate, generator=g)
        offsets = (gaps.cumsum(0) - gaps[0]).tolist()
    return [dict(prompt=torch.randint(0, vocab_size, (n,), generator=g).tolist(), output_len=m, offset_s=t)
            for n, m, t in zip(lens, outs, offsets)]


def warmup_traces(num_requests: int, prompt_len, vocab_size: int, seed: int) -> list[list[dict]]:
    """The traces run before the measured one, so that it compiles no kernel: ``num_requests``
    prompts of the trace's lengths at once (prefill and mixed steps, graph replays), then one
    short prompt and two of the longest: the long ones' chunks are prefilled beside the short
    one's decodes, a mixed step whose other sequences are all decodes (the unified kernel's
    decode tiles, which the first trace, whose short chunks join the decodes, may not reach)."""
    lo, hi = prompt_len
    g = torch.Generator().manual_seed(seed)
    pair = [dict(prompt=torch.randint(0, vocab_size, (n,), generator=g).tolist(), output_len=m, offset_s=0.0)
            for n, m in ((lo, 8), (hi, 4), (hi, 4))]
    return [make_trace(num_requests, prompt_len, (4, 4), math.inf, vocab_size, seed), pair]


def percentile(xs, q: float):
    """Linear-interpolated ``q``-th percentile (0..100) of ``xs``; None when empty."""
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100.0
    f = math.floor(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def run_trace(engine, trace: list[dict]) -> tuple[list, list, float]:
    """Feed ``trace`` to ``engine`` as its requests arrive and step until all are done.
    Returns (sequences, step records, wall seconds)."""
    from pagedattn.engine.sequence import SamplingParams

    device = engine.runner.device
    pending = deque(sorted(trace, key=lambda r: r["offset_s"]))
    engine.step_records, engine.time_gpu = [], False
    seqs = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    while pending or engine.scheduler.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0]["offset_s"] <= now:
            req = pending.popleft()
            params = SamplingParams(max_tokens=req["output_len"], ignore_eos=True)
            seqs.append(engine.add(req["prompt"], params, arrival_time=start + req["offset_s"]))
        if not engine.scheduler.has_unfinished():
            time.sleep(min(max(pending[0]["offset_s"] - now, 0.0), 0.01))
            continue
        engine.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    steps, engine.step_records, engine.time_gpu = engine.step_records, None, True
    return seqs, steps, wall


def summarize(seqs, steps, wall_s: float) -> dict:
    ttft = [(s.first_token_time - s.arrival_time) * 1e3 for s in seqs]
    tpot = [(s.finish_time - s.first_token_time) * 1e3 / (len(s.output_ids) - 1) for s in seqs
            if len(s.output_ids) > 1]
    out_tokens = sum(len(s.output_ids) for s in seqs)
    prompt_tokens = sum(s.num_prompt_tokens for s in seqs)

    def share(rows):
        wall = sum(r["wall_ms"] for r in rows)
        return sum(r["host_ms"] for r in rows) / wall if wall else None

    def mean(xs):
        return sum(xs) / len(xs) if xs else None

    decode = [r for r in steps if r["decode"]]
    mixed = [r for r in steps if not r["decode"]]
    return dict(
        requests=len(seqs), prompt_tokens=prompt_tokens, output_tokens=out_tokens, wall_s=wall_s,
        output_tok_s=out_tokens / wall_s, total_tok_s=(out_tokens + prompt_tokens) / wall_s,
        ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
        tpot_p50_ms=percentile(tpot, 50), tpot_p99_ms=percentile(tpot, 99),
        host_share=share(steps), host_share_decode=share(decode), host_share_mixed=share(mixed),
        steps=len(steps), decode_steps=len(decode), graph_steps=sum(r["graph"] for r in decode),
        mixed_steps=len(mixed), decode_step_ms=mean([r["wall_ms"] for r in decode]),
        mixed_step_ms=mean([r["wall_ms"] for r in mixed]),
        mean_decode_batch=mean([r["num_seqs"] for r in decode]),
    )


def flashinfer_installed() -> str:
    return f"flashinfer is {'installed' if importlib.util.find_spec('flashinfer') else 'not installed'} here"


def run_attention(attention: str, model, mcfg, s: dict, trace, warmups, args, device, dtype) -> dict:
    from pagedattn.engine.config import EngineConfig
    from pagedattn.engine.llm import Engine

    rec = dict(attention=attention)
    max_len = max(len(r["prompt"]) + r["output_len"] for r in trace + [r for w in warmups for r in w])
    ecfg = EngineConfig(max_model_len=max_len, max_num_seqs=s["max_num_seqs"],
                        max_num_batched_tokens=s["max_num_batched_tokens"], num_blocks=args.num_blocks,
                        attention=attention, device=str(device), dtype=str(dtype).removeprefix("torch."),
                        enforce_eager=args.enforce_eager, seed=args.seed)
    try:
        engine = Engine(model, mcfg, ecfg, eos_token_ids=())
    except (ValueError, RuntimeError, torch.OutOfMemoryError) as e:
        reason = str(e)[:300]
        if attention == "flashinfer":
            reason += f" ({flashinfer_installed()})"
        rec["status"] = f"not available: {reason}"
        return rec
    rec.update(status="ok", attention_note=engine.runner.attn.note, graph_note=engine.runner.graph_note)
    try:
        for warmup in warmups:
            run_trace(engine, warmup)  # compiles and autotunes the kernels of every kind of step
        seqs, steps, wall = run_trace(engine, trace)
        rec.update(summarize(seqs, steps, wall), preemptions=engine.scheduler.num_preemptions)
    except Exception as e:  # noqa: BLE001 - a failed attention is a row of the table; the others still run
        traceback.print_exc()
        rec["status"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def _line(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['attention']:>12s}: {r['status']}"
    return (f"{r['attention']:>12s}: {r['output_tok_s']:.1f} output tok/s, TTFT p50 {_fmt(r['ttft_p50_ms'])} / p99 "
            f"{_fmt(r['ttft_p99_ms'])} ms, TPOT p50 {_fmt(r['tpot_p50_ms'], '.2f')} / p99 {_fmt(r['tpot_p99_ms'], '.2f')} "
            f"ms, host share {_fmt(r['host_share'], '.2f')} (decode {_fmt(r['host_share_decode'], '.2f')}, mixed "
            f"{_fmt(r['host_share_mixed'], '.2f')}), {r['graph_steps']}/{r['decode_steps']} decode steps as graph "
            f"replays, {r['mixed_steps']} mixed, {r['wall_s']:.1f} s")


def markdown_table(results: dict) -> str:
    m, c = results["machine"], results["config"]
    arrivals = "all arriving at once" if c["request_rate"] is None else f"{c['request_rate']} requests/s (Poisson)"
    lines = [
        f"**{m.get('gpu') or m['device']}**, torch {m['torch']}, triton {m['triton']}, {c['model']} ({c['dtype']}"
        f"{', random weights' if c['random_weights'] else ''}), {m['date']}",
        "",
        f"{c['num_requests']} requests, prompts {c['prompt_len'][0]}-{c['prompt_len'][1]} tokens (log-uniform), "
        f"outputs {c['output_len'][0]}-{c['output_len'][1]} (uniform), "
        f"{arrivals}; "
        f"at most {c['max_num_seqs']} sequences and {c['max_num_batched_tokens']} tokens a step (chunked prefill); "
        "decode steps as CUDA-graph replays, mixed steps eager. Host share: the part of the step wall time in "
        "which the host was not waiting for the device.",
        "",
    ]
    if results.get("note"):
        lines += [f"**{results['note']}.**", ""]
    lines += [
        "| attention | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | host share (all / decode "
        "/ mixed) | decode steps (graph) | mixed steps | mean decode step ms | mean mixed step ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for r in results["records"]:
        if r["status"] != "ok":
            lines.append(f"| {r['attention']} | {r['status']} | | | | | | | | | |")
            continue
        lines.append(
            f"| {r['attention']} | {r['output_tok_s']:.1f} | {_fmt(r['ttft_p50_ms'])} | {_fmt(r['ttft_p99_ms'])} "
            f"| {_fmt(r['tpot_p50_ms'], '.2f')} | {_fmt(r['tpot_p99_ms'], '.2f')} | {_fmt(r['host_share'], '.2f')} / "
            f"{_fmt(r['host_share_decode'], '.2f')} / {_fmt(r['host_share_mixed'], '.2f')} | {r['decode_steps']} "
            f"({r['graph_steps']}) | {r['mixed_steps']} | {_fmt(r['decode_step_ms'], '.2f')} "
            f"| {_fmt(r['mixed_step_ms'], '.2f')} |")
        notes.append(f"- {r['attention']}: {r['attention_note']}; {r['graph_note']}")
    return "\n".join(lines + [""] + notes) + "\n"


def main(args: argparse.Namespace) -> int:
    from pagedattn.engine.config import ENGINE_PACKAGES
    from pagedattn.terminal import missing_packages

    missing = missing_packages("pagedattn bench serve", "engine", ENGINE_PACKAGES)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    device = select_device()  # before anything imports a Triton kernel
    from pagedattn.bench.report import comma_list, machine_info, write_json, write_outputs
    from pagedattn.engine.config import resolve_model
    from pagedattn.engine.llm import parse_dtype
    from pagedattn.engine.weights import load_model

    names = comma_list(args.attention, DEFAULT_ATTENTIONS)
    unknown = [n for n in names if n not in ATTENTIONS]
    if unknown:
        print(f"pagedattn bench serve: error: unknown attention(s) {unknown}; choose from {', '.join(ATTENTIONS)}",
              file=sys.stderr)
        return 2
    s = dict(QUICK if args.quick else FULL)
    for key in ("model", "num_requests", "prompt_len", "output_len", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    if device.type == "cpu" and not args.quick and args.model is None:
        print("pagedattn bench serve: error: the full run needs a GPU (Llama-3.1-8B shape); use --quick on the CPU",
              file=sys.stderr)
        return 2
    try:
        dtype = parse_dtype(args.dtype, device)
        if device.type == "cpu" and dtype == torch.bfloat16:
            raise ValueError("dtype bfloat16 does not run on the Triton interpreter (CPU); use float32 or float16")
        mcfg, folder = resolve_model(s["model"])
        if s["num_requests"] < 1:
            raise ValueError(f"--num-requests must be >= 1, got {s['num_requests']}")
    except ValueError as e:
        print(f"pagedattn bench serve: error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    model = load_model(mcfg, folder, device=device, dtype=dtype, seed=args.seed)
    print(f"{s['model']}: {model.weight_bytes() / 1e9:.2f} GB of {'random ' if folder is None else ''}weights in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    trace = make_trace(s["num_requests"], s["prompt_len"], s["output_len"], args.request_rate, mcfg.vocab_size,
                       args.seed)
    warmups = warmup_traces(s["warmup_requests"], s["prompt_len"], mcfg.vocab_size, args.seed + 1) if s["warmup_requests"] else []
    note = INTERPRETER_NOTE if device.type == "cpu" else None
    if note:
        print(f"note: {note}", file=sys.stderr)
    results = dict(
        machine=machine_info(device), note=note,
        config=dict(model=s["model"], random_weights=folder is None, dtype=str(dtype).removeprefix("torch."),
                    num_requests=s["num_requests"], prompt_len=list(s["prompt_len"]),
                    output_len=list(s["output_len"]),
                    request_rate=None if math.isinf(args.request_rate) else args.request_rate,
                    max_num_seqs=s["max_num_seqs"], max_num_batched_tokens=s["max_num_batched_tokens"],
                    warmup_requests=s["warmup_requests"], quick=args.quick, seed=args.seed,
                    enforce_eager=args.enforce_eager),
        records=[])
    for attention in names:
        rec = run_attention(attention, model, mcfg, s, trace, warmups, args, device, dtype)
        results["records"].append(rec)
        print(_line(rec), file=sys.stderr, flush=True)
        write_json(results, args.json)  # partial results survive a crash or a timeout
    write_outputs(results, args.json, markdown_table(results), args.markdown)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedattn bench serve", description=__doc__.split("\n\n")[0].replace("``", ""))
    add_arguments(p)
    return p


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
