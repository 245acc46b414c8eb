"""``pagedattn generate``: generate text with the engine and report tokens/s.

The text goes to stdout; the progress bar and the tokens/s line go to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

from pagedattn.engine.config import ATTENTION_BACKENDS, PRESETS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedattn generate", description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("--model", required=True, help=f"a preset ({', '.join(PRESETS)}) or a Hugging Face folder")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--attention", choices=ATTENTION_BACKENDS, default="pagedattn")
    p.add_argument("--device", help="default: cuda when a GPU is present, else cpu (Triton interpreter)")
    p.add_argument("--dtype", help="default: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--max-model-len", type=int, help="default: prompt + max tokens")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from pagedattn.engine.llm import LLM, default_device

    device = args.device or default_device()  # on the CPU, LLM sets TRITON_INTERPRET before any kernel import
    try:
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        max_len = args.max_model_len
        if max_len is None:  # room for the prompt (bytes bound the token count of any tokenizer but odd ones)
            max_len = len(args.prompt.encode("utf-8")) + args.max_tokens + 16
        t0 = time.perf_counter()
        llm = LLM(args.model, attention=args.attention, device=device, dtype=args.dtype, max_model_len=max_len,
                  max_num_seqs=1, enforce_eager=args.enforce_eager, cuda_graph_sizes=[1], seed=args.seed)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = llm.generate([args.prompt], max_tokens=args.max_tokens, temperature=args.temperature,
                           ignore_eos=args.ignore_eos, progress=True)[0]
        gen_s = time.perf_counter() - t0
    except ValueError as e:
        print(f"pagedattn generate: error: {e}", file=sys.stderr)
        return 2
    print(out.text)
    n = len(out.token_ids)
    decode_s = max(out.latency_s - out.ttft_s, 1e-9)
    print(f"{n} tokens in {gen_s:.2f} s: {n / gen_s:.1f} tokens/s (first token {out.ttft_s * 1e3:.0f} ms, "
          f"decode {max(n - 1, 0) / decode_s:.1f} tokens/s; load {load_s:.1f} s; {llm.model_config.model_type}, "
          f"attention {args.attention}, {llm.config.device} {llm.config.dtype}, {llm.engine.runner.graph_note})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
