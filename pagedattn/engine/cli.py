"""``pagedattn generate``: generate text with the engine and report tokens/s.

The text goes to stdout (``--json``: one JSON document with every output); the progress bar,
notes and the tokens/s line go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pagedattn.engine.config import ATTENTION_BACKENDS, ENGINE_PACKAGES, PRESETS
from pagedattn.terminal import missing_packages

SAMPLING_KEYS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "stop",
                 "stop_token_ids", "seed", "ignore_eos")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedattn generate", description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("--model", required=True, help=f"a preset ({', '.join(PRESETS)}; random weights) or a Hugging "
                                                   "Face folder")
    p.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for several")
    p.add_argument("--prompts-file", help="more prompts: one per line, or JSON lines ({\"prompt\": ..., and any "
                                          "sampling field, e.g. \"seed\", \"max_tokens\", \"stop\"})")
    g = p.add_argument_group("sampling (every prompt; a JSON line's fields override them)")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set of mass >= p (1: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="keep tokens >= min_p x the most likely (0: off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeated tokens")
    g.add_argument("--stop", action="append", default=[], help="a stop string; repeat for several")
    g.add_argument("--stop-token-id", type=int, action="append", default=[], help="a stop token id")
    g.add_argument("--request-seed", type=int,
                   help="seed of each request's own generator (prompt i gets this + i): reproducible samples")
    g.add_argument("--ignore-eos", action="store_true")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap prompts in the folder's chat template (default: when the folder has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="raw prompts even if a template exists")
    p.add_argument("--json", action="store_true", help="print the outputs as JSON instead of text")
    p.add_argument("--attention", choices=ATTENTION_BACKENDS, default="pagedattn")
    p.add_argument("--device", help="default: cuda when a GPU is present, else cpu (Triton interpreter)")
    p.add_argument("--dtype", help="default: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--max-model-len", type=int, help="default: the longest prompt + max tokens (+ template room)")
    p.add_argument("--max-num-seqs", type=int, help="default: the number of prompts, at most 64")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--seed", type=int, default=0, help="random weights of a preset and the engine's sampler")
    return p


def read_requests(args) -> list[dict]:
    """One dict per prompt: ``{"prompt": str, ...sampling overrides}``."""
    requests = [{"prompt": text} for text in args.prompt]
    if args.prompts_file:
        with open(args.prompts_file) as f:
            for n, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                if line.lstrip().startswith("{"):
                    try:
                        req = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"--prompts-file line {n}: {e}") from None
                    unknown = set(req) - {"prompt", *SAMPLING_KEYS}
                    if "prompt" not in req or unknown:
                        raise ValueError(f"--prompts-file line {n}: needs \"prompt\"; unknown keys {sorted(unknown)}")
                    requests.append(req)
                else:
                    requests.append({"prompt": line})
    if not requests:
        raise ValueError("no prompt: give --prompt (repeatable) or --prompts-file")
    return requests


def sampling_params(args, requests):
    from pagedattn.engine.sequence import SamplingParams

    base = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repetition_penalty=args.repetition_penalty, stop=tuple(args.stop),
                stop_token_ids=tuple(args.stop_token_id), ignore_eos=args.ignore_eos)
    params = []
    for i, req in enumerate(requests):
        fields = dict(base, seed=None if args.request_seed is None else args.request_seed + i)
        fields.update({k: v for k, v in req.items() if k != "prompt"})
        for key in ("stop", "stop_token_ids"):
            if isinstance(fields[key], (str, int)):
                fields[key] = (fields[key],)
            fields[key] = tuple(fields[key])
        params.append(SamplingParams(**fields))
    return params


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    missing = missing_packages("pagedattn generate", "engine", ENGINE_PACKAGES)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    from pagedattn.engine.llm import LLM, default_device

    device = args.device or default_device()  # on the CPU, LLM sets TRITON_INTERPRET before any kernel import
    try:
        requests = read_requests(args)
        params = sampling_params(args, requests)
        max_len = args.max_model_len
        if max_len is None:  # bytes bound the token count of any tokenizer but odd ones; a template adds some
            room = 16 if args.model in PRESETS else 512
            max_len = max(len(r["prompt"].encode("utf-8")) + p.max_tokens for r, p in zip(requests, params)) + room
        num_seqs = args.max_num_seqs or min(len(requests), 64)
        t0 = time.perf_counter()
        llm = LLM(args.model, attention=args.attention, device=device, dtype=args.dtype, max_model_len=max_len,
                  max_num_seqs=num_seqs, enforce_eager=args.enforce_eager,
                  cuda_graph_sizes=sorted({1, num_seqs}), seed=args.seed)
        load_s = time.perf_counter() - t0
        chat = llm.has_chat_template if args.chat is None else args.chat
        if llm.random_weights:
            print(f"pagedattn generate: note: {args.model!r} is a preset with RANDOM weights: the text is gibberish "
                  "(expected); give a Hugging Face folder for real text", file=sys.stderr)
        t0 = time.perf_counter()
        outs = llm.generate([r["prompt"] for r in requests], sampling_params=params, chat=chat, progress=True)
        gen_s = time.perf_counter() - t0
    except (ValueError, OSError) as e:
        print(f"pagedattn generate: error: {e}", file=sys.stderr)
        return 2
    n = sum(len(o.token_ids) for o in outs)
    info = dict(model=args.model, model_type=llm.model_config.model_type, random_weights=llm.random_weights,
                chat_template=chat, attention=args.attention, device=llm.config.device, dtype=llm.config.dtype,
                graphs=llm.engine.runner.graph_note, load_s=load_s, generate_s=gen_s, output_tokens=n)
    if args.json:
        doc = dict(info, outputs=[dict(prompt=r["prompt"], text=o.text, token_ids=o.token_ids,
                                       finish_reason=o.finish_reason, ttft_s=o.ttft_s, latency_s=o.latency_s,
                                       sampling={k: getattr(p, k) for k in SAMPLING_KEYS})
                                  for r, o, p in zip(requests, outs, params)])
        print(json.dumps(doc, indent=1))
    else:
        for i, o in enumerate(outs):
            if len(outs) > 1:
                print(f"--- [{i}] {o.finish_reason}, {len(o.token_ids)} tokens")
            print(o.text)
    first = outs[0]
    decode_s = max(first.latency_s - first.ttft_s, 1e-9)
    print(f"{n} tokens in {gen_s:.2f} s: {n / gen_s:.1f} tokens/s ({len(outs)} prompt(s); first token "
          f"{first.ttft_s * 1e3:.0f} ms, decode {max(len(first.token_ids) - 1, 0) / decode_s:.1f} tokens/s of prompt 0; "
          f"load {load_s:.1f} s; {llm.model_config.model_type}, attention {args.attention}, {llm.config.device} "
          f"{llm.config.dtype}, {llm.engine.runner.graph_note})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
