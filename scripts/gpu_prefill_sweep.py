"""Prefill tile sweep on a GPU: ``PYTHONPATH=. python scripts/gpu_prefill_sweep.py --json out.json``.

Causal prefill, one sequence of S tokens, 32 q / 8 kv heads (Llama-3 8B), bf16. For each tile
configuration of the large-tile kernel it runs the contiguous (varlen) and the paged variant,
checks them against torch SDPA, and times them with ``triton.testing.do_bench`` (median); the
SDPA cuDNN and flash backends are timed on the same tensors as anchors.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from pagedattn.bench.report import compiled_kernels
from pagedattn.ops.prefill.kernel import prefill_attention_kernel
from pagedattn.ops.prefill.launch import launch_prefill
from pagedattn.ops.unified.launch import AttentionArgs
from pagedattn.plan import Tiles, pick_prefill_tiles

CONFIGS = {  # head size -> [(block_m, tile_n, warps, stages)]
    64: [(128, 64, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4),
          (128, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3), (128, 32, 8, 4)],
    256: [(64, 32, 8, 2), (64, 64, 8, 2), (128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 3), (64, 64, 8, 3)],
}


def parse_configs(text):
    """None (the sweep's list) if not given; [] for "default" (the planner's tiles only)."""
    if text == "default":
        return []
    return [tuple(int(x) for x in c.split("x")) for c in text.split(",")] if text else None


def new_kernels(seen: set, tag: str, dump_dir) -> list[dict]:
    """Compiled variants of the prefill kernel not seen before: registers, spills, pipelining ops."""
    info = []
    for _, _, k in compiled_kernels(prefill_attention_kernel):
        if id(k) in seen:
            continue
        seen.add(id(k))
        ttgir = k.asm.get("ttgir", "")
        info.append(dict(tag=tag, n_regs=k.n_regs, n_spills=k.n_spills, shared=k.metadata.shared,
                         async_copies=ttgir.count("async_copy_global_to_local"),
                         wgmma=ttgir.count("warp_group_dot"), dots=ttgir.count("tt.dot")))
        if dump_dir:
            with open(f"{dump_dir}/{tag.replace(' ', '_')}_{len(seen)}.ttgir", "w") as f:
                f.write(ttgir)
    return info


def flops(s: int, hq: int, d: int) -> float:
    return 4.0 * hq * s * s * d / 2


def inputs(s, hq, hkv, d, page=16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    nb = s // page
    perm = torch.randperm(nb, device="cuda", generator=g)
    k_cache = torch.empty(nb, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    k_cache[perm] = k.view(nb, page, hkv, d)
    v_cache[perm] = v.view(nb, page, hkv, d)
    return q, k, v, k_cache, v_cache, perm.int().view(1, nb)


def args_for(q, k, v, block_table, seq_lens, qsl):
    return AttentionArgs(q=q, k_cache=k, v_cache=v, block_table=block_table, seq_lens=seq_lens,
                         query_start_loc=qsl, scale=1.0 / math.sqrt(q.shape[2]), causal=True, sliding_window=0,
                         softcap=0.0, alibi_mode=0, alibi_slopes=None, sinks=None, prefix_ranges=None,
                         k_scale=None, v_scale=None)


def graphed(fn):
    """fn captured once in a CUDA graph; the returned callable replays it."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="2048,8192,32768")
    p.add_argument("--heads", default="128", help="head sizes; the sweep runs only at 128, others default tiles")
    p.add_argument("--configs", default=None, help="e.g. 128x64x8x3,64x64x4x3 (block_m x tile_n x warps x stages); default: the planner's only")
    p.add_argument("--variants", default="contig,paged")
    p.add_argument("--anchors", default="sdpa-cudnn,sdpa-flash")
    p.add_argument("--dump", default=None, help="directory for the TTGIR of each compiled variant")
    p.add_argument("--json", default=None)
    p.add_argument("--graph", action="store_true", help="time pagedattn as a CUDA-graph replay (no host launch cost)")
    a = p.parse_args(argv)
    rows, kinfo, seen = [], [], set()
    for d in [int(x) for x in a.heads.split(",")]:
        for s in [int(x) for x in a.lengths.split(",")]:
            hq, hkv = 32, 8
            q, k, v, kc, vc, bt = inputs(s, hq, hkv, d)
            qsl = torch.tensor([0, s], dtype=torch.int32, device="cuda")
            seq_lens = torch.tensor([s], dtype=torch.int32, device="cuda")
            qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
            ref = ref[0].transpose(0, 1)
            fl = flops(s, hq, d)
            anchors = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}
            for name, backend in [(n, anchors[n]) for n in a.anchors.split(",") if n]:
                try:
                    def fn(backend=backend):
                        with sdpa_kernel(backend):
                            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                                                    enable_gqa=True)
                    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                    rows.append(dict(d=d, s=s, provider=name, cfg="", us=ms * 1e3, tflops=fl / ms / 1e9))
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(d=d, s=s, provider=name, cfg="", error=str(e)[:200]))
                print(rows[-1], flush=True)
            configs = parse_configs(a.configs)
            configs = CONFIGS.get(d, []) if configs is None else configs
            default = pick_prefill_tiles(d, torch.bfloat16)
            configs = [(default.block_m, default.tile_n, default.num_warps, default.num_stages)] + \
                [c for c in configs if c != (default.block_m, default.tile_n, default.num_warps, default.num_stages)]
            for bm, bn, w, st in configs:
                tiles = Tiles(bm, bm, bn, w, st)
                for variant in a.variants.split(","):
                    out = torch.full_like(q, float("nan"))
                    if variant == "contig":
                        cu_k = qsl
                        args = args_for(q, k, v, None, None, qsl)
                    else:
                        cu_k = None
                        args = args_for(q, kc, vc, bt, seq_lens, qsl)

                    def fn(out=out, args=args, tiles=tiles, cu_k=cu_k):
                        launch_prefill(out, None, args, tiles, max_query_len=s, cu_seqlens_k=cu_k)
                    try:
                        fn()
                        err = (out.float() - ref.float()).abs().max().item()
                        ms = triton.testing.do_bench(graphed(fn) if a.graph else fn, warmup=25, rep=100,
                                                     return_mode="median")
                        rows.append(dict(d=d, s=s, provider=f"pagedattn-{variant}", cfg=f"{bm}x{bn} w{w} s{st}",
                                         us=ms * 1e3, tflops=fl / ms / 1e9, max_err=err))
                    except Exception as e:  # noqa: BLE001
                        rows.append(dict(d=d, s=s, provider=f"pagedattn-{variant}", cfg=f"{bm}x{bn} w{w} s{st}",
                                         error=f"{type(e).__name__}: {str(e)[:200]}"))
                    kinfo += new_kernels(seen, f"d{d} {variant} {bm}x{bn} w{w} s{st}", a.dump)
                    print(rows[-1], kinfo[-1] if kinfo else "", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "kernels": kinfo}, f, indent=1)
    print("\n| head | S | provider | config | us | TFLOP/s | max err |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['d']} | {r['s']} | {r['provider']} | {r['cfg']} | error | {r['error'][:60]} | |")
        else:
            print(f"| {r['d']} | {r['s']} | {r['provider']} | {r['cfg']} | {r['us']:.0f} | {r['tflops']:.0f} | "
                  f"{r.get('max_err', 0):.3g} |")
    print("\n| kernel | regs | spills | smem | async copies | wgmma | dots |")
    print("|---|---|---|---|---|---|---|")
    for k in kinfo:
        print(f"| {k['tag']} | {k['n_regs']} | {k['n_spills']} | {k['shared']} | {k['async_copies']} | {k['wgmma']} | "
              f"{k['dots']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
