"""``pagedattn bench e2e``: the engine end to end, attention swapped between pagedattn (auto),
pagedattn 2D only and torch SDPA (cuDNN) over a contiguous static cache.

Llama-3.1-8B's shape (or ``--model``, another preset: gemma3-4b, gemma2-9b, gpt-oss-20b, ...) with
random bf16 weights: batch 1 with a 500-token prompt and 128 / 1024
output tokens (TTFT, TPOT = mean decode step, total latency), and batch 64 at 2048 tokens of
context (one prefill step, then a few timed decode steps). On a GPU, decode steps are CUDA-graph
replays for all three attentions and each step is timed with CUDA events: ``tpot_ms`` is the
whole step (scheduling, metadata, plan update, replay, sampling); ``forward_ms`` the model
forward alone. On the CPU (Triton's interpreter, eager steps) ``tpot_ms`` is wall time and
``forward_ms`` is not measured; nothing is compared with a reference (the rows show that the
engine runs with each attention, not how fast).
The floor is the bytes a decode step must read (the weights without the input-embedding table,
plus the KV cache at the mean context) over ``--bandwidth`` (default 4.6e12 B/s, the H200's
measured read bandwidth). ``--quick`` runs the tiny preset (seconds on the CPU interpreter). An
attention that cannot compute the model (SDPA has no softcap) is reported as not
available.

The MLA presets (``--model deepseek-v2-lite``, ``tiny-mla`` with ``--quick``) compare pagedattn's
``mla`` backend (``pagedattn``: absorbed ``mla_decode`` in the decode graphs, decompressed
``varlen_attention`` for prefill) with SDPA over K/V decompressed from the same latent cache
every step (``sdpa``; its decode graphs decompress each row of the block table to its width and
mask the keys past the sequence); their floor counts the latent cache's bytes.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from pagedattn.bench.serve import select_device

ATTENTIONS = ("pagedattn", "pagedattn-2d", "sdpa", "flashinfer")
DEFAULT_ATTENTIONS = ("pagedattn", "pagedattn-2d", "sdpa")
MLA_ATTENTIONS = ("pagedattn", "sdpa")  # what serves an MLA model, and its default
FULL = dict(model="llama-3.1-8b", prompt_len=500, output_lens=(128, 1024), batch=64, batch_context=2048,
            batch_decode_steps=16, warmup_tokens=4)
QUICK = dict(model="tiny", prompt_len=12, output_lens=(2, 4), batch=4, batch_context=16, batch_decode_steps=2,
             warmup_tokens=0)


def build_parser() -> argparse.ArgumentParser:
    summary = " ".join(__doc__.split("\n\n")[0].split()).replace("``", "")
    p = argparse.ArgumentParser(prog="pagedattn bench e2e", description=summary)
    p.add_argument("--attention", action="append",
                   help=f"comma list of {', '.join(ATTENTIONS)} (default: {','.join(DEFAULT_ATTENTIONS)}; "
                        f"an MLA model: {','.join(MLA_ATTENTIONS)})")
    p.add_argument("--quick", action="store_true", help="tiny preset and short runs (seconds on the CPU)")
    p.add_argument("--model", help="a preset, e.g. gemma3-4b, gemma2-9b, gpt-oss-20b, mistral-7b, deepseek-v2-lite "
                                   "(default: llama-3.1-8b; tiny with --quick); random weights")
    p.add_argument("--json", default="bench_out/e2e.json", help="results file (default: %(default)s)")
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument("--bandwidth", type=float, default=4.6e12, help="bytes/s of the floor (default: %(default)g)")
    p.add_argument("--batch-decode-steps", type=int, help="timed decode steps of the batch run")
    p.add_argument("--no-batch", action="store_true", help="skip the batch run")
    p.add_argument("--seed", type=int, default=0)
    return p


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed_generate(engine, prompts, max_tokens: int) -> dict:
    """Generate ``max_tokens`` per prompt (EOS ignored) and summarize the per-step timings."""
    from pagedattn.engine.sequence import SamplingParams

    device = engine.runner.device
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * len(prompts)
    engine.step_records = []
    _sync(device)
    t0 = time.perf_counter()
    seqs = engine.generate(prompts, params)
    _sync(device)
    total_s = time.perf_counter() - t0
    steps, engine.step_records = engine.step_records, None
    decode = [r for r in steps if r["decode"]]

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return statistics.fmean(xs) if xs else None

    return dict(
        ttft_ms=mean([(s.first_token_time - s.arrival_time) * 1e3 for s in seqs]),
        tpot_ms=mean([r["step_ms"] for r in decode]),
        forward_ms=mean([r["forward_ms"] for r in decode]),
        prefill_steps=len(steps) - len(decode), decode_steps=len(decode),
        graph_steps=sum(r["graph"] for r in decode), total_s=total_s,
        output_tokens=sum(len(s.output_ids) for s in seqs),
    )


def floor_ms(model, mcfg, *, batch: int, mean_context: float, bandwidth: float) -> dict:
    kv_per_token = mcfg.kv_bytes_per_token(model.embed.element_size())  # K and V, or the MLA latent row
    weights = model.weight_bytes(read_per_decode_step=True)
    kv = batch * mean_context * kv_per_token
    return dict(weights_gb=weights / 1e9, kv_gb=kv / 1e9, floor_weights_ms=weights / bandwidth * 1e3,
                floor_ms=(weights + kv) / bandwidth * 1e3)


def run_attention(attention: str, model, mcfg, s: dict, args, device, dtype, rng) -> list[dict]:
    """The batch-1 runs and the batch run of one attention backend (each with its own engine)."""
    from pagedattn.engine.config import EngineConfig
    from pagedattn.engine.llm import Engine

    records = []
    prompt = torch.randint(0, mcfg.vocab_size, (s["prompt_len"],), generator=rng).tolist()
    longest = max(s["output_lens"])
    ecfg = EngineConfig(max_model_len=s["prompt_len"] + longest, max_num_seqs=1,
                        max_num_batched_tokens=max(2048, s["prompt_len"]), attention=attention, device=str(device),
                        dtype=str(dtype).removeprefix("torch."), cuda_graph_sizes=[1], seed=args.seed)
    try:
        engine = Engine(model, mcfg, ecfg, eos_token_ids=())
    except ValueError as e:  # an attention that cannot compute this model (SDPA: softcap) or is absent
        print(f"{attention:>12s}: not available: {e}", file=sys.stderr, flush=True)
        return [dict(attention=attention, batch=1, prompt_len=s["prompt_len"], output_len=0,
                     status=f"not available: {e}")]
    notes = dict(attention_note=engine.runner.attn.note, graph_note=engine.runner.graph_note)
    if s["warmup_tokens"]:
        timed_generate(engine, [prompt], s["warmup_tokens"])
    for out_len in s["output_lens"]:
        rec = dict(attention=attention, batch=1, prompt_len=s["prompt_len"], output_len=out_len, **notes)
        rec.update(timed_generate(engine, [prompt], out_len))
        rec.update(floor_ms(model, mcfg, batch=1, mean_context=s["prompt_len"] + out_len / 2,
                            bandwidth=args.bandwidth))
        records.append(rec)
        print(_line(rec), file=sys.stderr, flush=True)
    del engine
    _free(device)
    if args.no_batch:
        return records

    b, ctx = s["batch"], s["batch_context"]
    steps = args.batch_decode_steps or s["batch_decode_steps"]
    prompts = torch.randint(0, mcfg.vocab_size, (b, ctx), generator=rng).tolist()
    ecfg = EngineConfig(max_model_len=ctx + steps + 1, max_num_seqs=b, max_num_batched_tokens=b * ctx,
                        attention=attention, device=str(device), dtype=str(dtype).removeprefix("torch."),
                        cuda_graph_sizes=[b], seed=args.seed)
    engine = Engine(model, mcfg, ecfg, eos_token_ids=())
    notes = dict(attention_note=engine.runner.attn.note, graph_note=engine.runner.graph_note)
    if s["warmup_tokens"]:
        timed_generate(engine, [p[:min(ctx, 128)] for p in prompts], 2)
    rec = dict(attention=attention, batch=b, prompt_len=ctx, output_len=steps + 1, **notes)
    rec.update(timed_generate(engine, prompts, steps + 1))
    rec.update(floor_ms(model, mcfg, batch=b, mean_context=ctx + steps / 2, bandwidth=args.bandwidth))
    records.append(rec)
    print(_line(rec), file=sys.stderr, flush=True)
    del engine
    _free(device)
    return records


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def _line(r: dict) -> str:
    return (f"{r['attention']:>12s} batch {r['batch']:>3d} prompt {r['prompt_len']:>5d} out {r['output_len']:>5d}: "
            f"TTFT {_fmt(r['ttft_ms'])} ms, TPOT {_fmt(r['tpot_ms'])} ms (forward {_fmt(r['forward_ms'])} ms, "
            f"floor {r['floor_ms']:.3g} ms), total {r['total_s']:.2f} s, {r['graph_steps']}/{r['decode_steps']} "
            "decode steps as graph replays")


def markdown_table(results: dict) -> str:
    m, c = results["machine"], results["config"]
    timed = [r for r in results["records"] if "status" not in r]
    on_gpu = bool(m.get("gpu"))
    clock = "CUDA events" if on_gpu else "wall time, Triton's interpreter: not a speed"
    forward_note = "" if on_gpu else " (measured on a GPU only)"
    lines = [
        f"**{m.get('gpu') or m['device']}**, torch {m['torch']}, triton {m['triton']}, {c['model']} "
        f"({c['dtype']}, random weights), {m['date']}",
        "",
        f"TPOT = mean decode step ({clock}; scheduling, metadata, plan update, replay and sampling); "
        f"forward = the model forward alone{forward_note}. Floor = bytes a decode step reads (weights without the input "
        f"embedding: {timed[0]['weights_gb']:.2f} GB, plus the KV cache at the mean context) / "
        f"{c['bandwidth']:.3g} B/s." if timed else "",
        "",
        "| attention | batch | prompt | output | TTFT ms | TPOT ms | forward ms | total s | floor ms | TPOT / floor "
        "| sdpa TPOT / TPOT | graph steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    sdpa = {(r["batch"], r["prompt_len"], r["output_len"]): r["tpot_ms"] for r in results["records"]
            if r["attention"] == "sdpa" and "status" not in r}
    for r in results["records"]:
        if "status" in r:
            lines.append(f"| {r['attention']} | {r['status']} | | | | | | | | | | |")
            continue
        ratio = r["tpot_ms"] / r["floor_ms"] if r["tpot_ms"] else None
        base = sdpa.get((r["batch"], r["prompt_len"], r["output_len"]))
        vs = base / r["tpot_ms"] if base and r["tpot_ms"] else None
        lines.append(
            f"| {r['attention']} | {r['batch']} | {r['prompt_len']} | {r['output_len']} | {_fmt(r['ttft_ms'], '.1f')} "
            f"| {_fmt(r['tpot_ms'])} | {_fmt(r['forward_ms'])} | {r['total_s']:.2f} | {r['floor_ms']:.3g} "
            f"| {_fmt(ratio)} | {_fmt(vs)} | {r['graph_steps']}/{r['decode_steps']} |")
    notes = {(r["attention"], r["attention_note"], r["graph_note"]) for r in results["records"] if "status" not in r}
    lines += [""] + [f"- {a}: {n}; {g}" for a, n, g in sorted(notes)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from pagedattn.engine.config import ENGINE_PACKAGES
    from pagedattn.terminal import missing_packages

    missing = missing_packages("pagedattn bench e2e", "engine", ENGINE_PACKAGES)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    device = select_device()  # before anything imports a Triton kernel
    from pagedattn.bench.report import comma_list, machine_info, write_json, write_outputs
    from pagedattn.engine.config import PRESETS, MLAModelConfig
    from pagedattn.engine.weights import random_model

    s = dict(QUICK if args.quick else FULL)
    if args.model:
        if args.model not in PRESETS:
            build_parser().error(f"--model must be a preset ({', '.join(PRESETS)}), got {args.model!r}")
        s["model"] = args.model
    names = comma_list(args.attention, MLA_ATTENTIONS if isinstance(PRESETS[s["model"]], MLAModelConfig)
                       else DEFAULT_ATTENTIONS)
    unknown = [n for n in names if n not in ATTENTIONS]
    if unknown:
        build_parser().error(f"unknown attention(s) {unknown}; choose from {', '.join(ATTENTIONS)}")
    if device.type == "cpu" and not args.quick:
        build_parser().error("the full run needs a GPU (Llama-3.1-8B shape); use --quick on the CPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mcfg = PRESETS[s["model"]]
    t0 = time.perf_counter()
    model = random_model(mcfg, device=device, dtype=dtype, seed=args.seed)
    _sync(device)
    print(f"{s['model']}: {model.weight_bytes() / 1e9:.2f} GB of random weights in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    results = dict(machine=machine_info(device),
                   config=dict(argv=list(sys.argv[1:] if argv is None else argv), model=s["model"],
                               dtype=str(dtype).removeprefix("torch."), bandwidth=args.bandwidth, quick=args.quick,
                               settings={k: list(v) if isinstance(v, tuple) else v for k, v in s.items()},
                               seed=args.seed),
                   records=[])
    rng = torch.Generator().manual_seed(args.seed)
    for attention in names:
        results["records"] += run_attention(attention, model, mcfg, s, args, device, dtype, rng)
        write_json(results, args.json)  # partial results survive a crash or a timeout
    write_outputs(results, args.json, markdown_table(results), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
