"""``python -m pagedattn.bench.mla``: MLA decode (SPEC workloads) beside torch ops on a contiguous latent.

Cases: 128 heads, 512 latent + 64 rope, bf16, page 16, B in {1, 32, 128} x L in {4096, 32768}
(skipping B*L > 4M). Bytes = B*L*576*2 (the latent a call must read, at bf16). Both providers
run in the same process and are timed by :func:`pagedattn.bench.timing.bench` (CUDA-graph
replays rotating over input copies for short calls, ``do_bench`` otherwise):

* ``pagedattn``: :func:`pagedattn.mla_decode` over the paged cache (host maxima given: no sync);
* ``torch``: ``einsum`` scores + fp32 softmax + ``einsum`` output over a contiguous
  ``[B, L, 576]`` copy of the same latents.

Without a GPU the Triton interpreter runs a tiny ``--quick`` configuration; those times only
show that the script runs. ``--tiles`` and ``--num-splits`` fix the kernel's choices for sweeps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

PEAK_TBPS = 4.6  # H200 decode ceiling used in PERFORMANCE.md (cuDNN reads at 4.64 TB/s)
MAX_TOKENS = 4 * 1024 * 1024
LATENT, ROPE = 512, 64


def select_device() -> torch.device:
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return torch.device("cuda", torch.cuda.current_device())
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    return torch.device("cpu")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagedattn.bench.mla", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", help="batch sizes (default 1 32 128; --quick: 1 2)")
    p.add_argument("--seq-len", type=int, nargs="+", help="context lengths (default 4096 32768; --quick: 64 200)")
    p.add_argument("--heads", type=int, help="query heads (default 128; --quick: 16)")
    p.add_argument("--query-len", type=int, default=1, help="query tokens per sequence (speculative: up to 8)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--fp8", action="store_true", help="fp8 e4m3 latent cache for pagedattn (bytes still at bf16)")
    p.add_argument("--num-splits", type=int, help="force the split count (default: the launcher's rule)")
    p.add_argument("--tiles", help="force tiles: BLOCK_H,BLOCK_Q,TILE_N,NUM_WARPS,NUM_STAGES")
    p.add_argument("--no-baseline", action="store_true", help="skip the torch provider")
    p.add_argument("--quick", action="store_true", help="tiny shapes (the default without a GPU)")
    p.add_argument("--json", help="also write the records to this file")
    p.add_argument("--seed", type=int, default=0)
    return p


def _paged_inputs(batch, seq_len, query_len, heads, block_size, dtype, cache_dtype, device, g):
    """(q, kv_cache, block_table, seq_lens, query_start_loc, latent): latent is the contiguous copy."""
    pages = -(-seq_len // block_size)
    num_blocks = batch * pages + 1
    kv = torch.randn(num_blocks, block_size, LATENT + ROPE, generator=g, dtype=torch.float32).to(device, dtype)
    block_table = torch.randperm(num_blocks, generator=g)[: batch * pages].view(batch, pages).to(device, torch.int32)
    latent = kv[block_table.long()].reshape(batch, pages * block_size, LATENT + ROPE)[:, :seq_len].contiguous()
    q = torch.randn(batch * query_len, heads, LATENT + ROPE, generator=g).to(device, dtype)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    qsl = (torch.arange(batch + 1, dtype=torch.int32) * query_len).to(device)
    return q, kv.to(cache_dtype), block_table, seq_lens, qsl, latent


def torch_mla(q, latent, scale, query_len):
    """Composed torch decode over a contiguous latent [B, L, 576]; causal within the new tokens."""
    batch, seq_len = latent.shape[:2]
    qb = q.view(batch, query_len * q.shape[1], q.shape[2])  # [B, q_len * H, 576]
    s = torch.einsum("bmd,bld->bml", qb, latent).float() * scale
    if query_len > 1:
        heads = q.shape[1]
        q_pos = seq_len - query_len + torch.arange(query_len, device=q.device).repeat_interleave(heads)
        s = s.masked_fill(torch.arange(seq_len, device=q.device)[None, None, :] > q_pos[None, :, None],
                          float("-inf"))
    p = torch.softmax(s, dim=-1).to(q.dtype)
    out = torch.einsum("bml,bld->bmd", p, latent[..., :LATENT])
    return out.view(batch * query_len, q.shape[1], LATENT)


def run_case(batch, seq_len, args, device, dtype, g) -> list[dict]:
    from pagedattn.bench.timing import bench, copies_for
    from pagedattn.mla import _mla_decode
    from pagedattn.ops.mla.launch import MLATiles, choose_mla_splits, pick_mla_tiles
    from pagedattn.plan import num_sms

    heads, ql = args.heads, args.query_len
    cache_dtype = torch.float8_e4m3fn if args.fp8 else dtype
    scale = 192 ** -0.5
    nbytes = batch * seq_len * (LATENT + ROPE) * 2
    copies = copies_for(nbytes, device)
    sets = [_paged_inputs(batch, seq_len, ql, heads, args.block_size, dtype, cache_dtype, device, g)
            for _ in range(copies)]
    if args.tiles:
        bh, bq, tn, nw, ns = (int(x) for x in args.tiles.split(","))
        tiles = MLATiles(bh, bq, tn, nw, ns)
    else:
        tiles = pick_mla_tiles(heads, ql)
    splits = args.num_splits or choose_mla_splits(batch, heads, ql, seq_len, tiles, num_sms(device))
    kv_scale = torch.ones(1, device=device) if args.fp8 else None
    outs = [torch.empty(batch * ql, heads, LATENT, dtype=dtype, device=device) for _ in sets]

    def paged_fn(i):
        q, kv, bt, lens, qsl, _ = sets[i]
        return lambda: _mla_decode(q[..., :LATENT], q[..., LATENT:], kv, bt, lens, qsl, scale=scale,
                                   max_query_len=ql, max_seq_len=seq_len, kv_scale=kv_scale, num_splits=splits,
                                   out=outs[i], tiles=tiles)

    def torch_fn(i):
        q, _, _, _, _, latent = sets[i]
        return lambda: torch_mla(q, latent, scale, ql)

    providers = [("pagedattn", paged_fn)] + ([] if args.no_baseline else [("torch", torch_fn)])
    check = torch_mla(sets[0][0].float(), sets[0][5].float(), scale, ql)  # fp32, same latents (pre-fp8)
    records = []
    for name, make in providers:
        fns = [make(i) for i in range(copies)]
        result = fns[0]()
        err = float((result.float() - check).abs().max())
        timing = bench(fns, device)
        us = timing["time_us"]
        gbps = nbytes / (us * 1e-6) / 1e9
        records.append({
            "B": batch, "L": seq_len, "query_len": ql, "heads": heads, "provider": name,
            "time_us": us, "gbps": gbps, "pct_peak": 100 * gbps / (PEAK_TBPS * 1e3),
            "method": timing["method"], "max_err_vs_torch": err,
            "num_splits": splits if name == "pagedattn" else None,
            "tiles": [tiles.block_h, tiles.block_q, tiles.tile_n, tiles.num_warps, tiles.num_stages]
            if name == "pagedattn" else None,
            "fp8": bool(args.fp8 and name == "pagedattn"),
        })
    return records


def markdown(records) -> str:
    lines = [
        "| B x L | provider | µs | GB/s | % of 4.6 TB/s | splits | method | max err vs torch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['B']} x {r['L']} | {r['provider']}{' (fp8)' if r['fp8'] else ''} | {r['time_us']:.1f} | "
            f"{r['gbps']:.0f} | {r['pct_peak']:.1f} | {r['num_splits'] or '-'} | {r['method']} | "
            f"{r['max_err_vs_torch']:.3g} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    device = select_device()
    quick = args.quick or device.type == "cpu"
    args.heads = args.heads or (16 if quick else 128)
    batches = args.batch or ([1, 2] if quick else [1, 32, 128])
    lens = args.seq_len or ([64, 200] if quick else [4096, 32768])
    dtype = torch.float16 if device.type == "cpu" else torch.bfloat16  # the interpreter has no bf16 dot
    g = torch.Generator().manual_seed(args.seed)
    records = []
    for seq_len in lens:
        for batch in batches:
            if batch * seq_len > MAX_TOKENS:
                continue
            records += run_case(batch, seq_len, args, device, dtype, g)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    import triton

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"MLA decode, {args.heads} heads, {LATENT}+{ROPE} latent, {str(dtype).replace('torch.', '')}, "
          f"page {args.block_size}, query_len {args.query_len}; {gpu}, torch {torch.__version__}, "
          f"triton {triton.__version__}; bytes = B*L*576*2")
    print(markdown(records))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
                       "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
