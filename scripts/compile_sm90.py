"""Compile the paged-attention kernels for sm90 without a GPU and report what the compiler made of them.

``python scripts/compile_sm90.py --kernel prefill --paged --tiles 128x128x8x3 [--dump DIR]`` prints
registers, spills, shared memory, the SASS instruction count and the pipelining ops of the TTGIR
(async copies, waits, wgmma) of each kernel the launcher starts. Triton ships ptxas, so this runs
on a CPU-only machine: a quick check of a kernel change's structure before spending GPU time on
timing it. The arguments come from the real launcher (called on CPU tensors with its launch
intercepted), so the kernels are specialized as on a GPU: 16-byte aligned pointers, strides
that are multiples of 16, the do_not_specialize sizes left alone.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import types

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

TARGET = GPUTarget("cuda", 90, 32)
TTGIR_OPS = ("async_copy_global_to_local", "async_tma_copy", "async_wait", "warp_group_dot ", "local_load",
             "local_store", "gather", "gpu.barrier", "scf.for")


_LAUNCHED: list = []


def intercept_launches():
    """Make every launcher record (kernel, kwargs) in the returned list instead of launching
    (the list is emptied at each call)."""
    import pagedattn.ops.common.launching as launching

    _LAUNCHED.clear()
    for name, mod in list(sys.modules.items()):
        if name.startswith("pagedattn.ops") and mod is not launching and getattr(mod, "launch", None) is launching.launch:
            mod.launch = lambda kernel, grid, **kwargs: _LAUNCHED.append((kernel, kwargs))
    return _LAUNCHED


def compile_launch(kernel, kwargs):
    """The sm90 compile of ``kernel[grid](**kwargs)``, specialized as Triton's launcher would."""
    from triton.runtime.autotuner import Heuristics
    from triton.runtime.jit import JITFunction

    kw = dict(kwargs)
    while not isinstance(kernel, JITFunction):
        if isinstance(kernel, Heuristics):
            kw.update({name: heur(dict(kw)) for name, heur in kernel.values.items()})
        kernel = kernel.fn
    backend = make_backend(TARGET)
    bound, specialization, options = create_function_from_signature(kernel.signature, kernel.params, backend)(**kw)
    options, signature, constexprs, attrs = kernel._pack_args(backend, options, bound, specialization, options)
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options=dict(options.__dict__))


def ptxas_dir():
    """Where Triton keeps the ptxas and cuobjdump it ships."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def report(k, ops=TTGIR_OPS):
    """("REG:.. STACK:.. SHARED:.. LOCAL:.. spill_st=..B spill_ld=..B sass=.. STL=.. LDL=..", TTGIR op
    counts, SASS text) of a compiled kernel."""
    bindir = ptxas_dir()
    with tempfile.TemporaryDirectory() as d:
        cubin, ptx = os.path.join(d, "k.cubin"), os.path.join(d, "k.ptx")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        res = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", cubin], capture_output=True,
                             text=True).stdout
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True).stdout
        info = subprocess.run([os.path.join(bindir, "ptxas"), "--gpu-name", "sm_90a", "-v", ptx, "-o",
                               os.path.join(d, "k2.cubin")], capture_output=True, text=True).stderr
    usage = " ".join(re.findall(r"(REG:\d+|STACK:\d+|SHARED:\d+|LOCAL:\d+)", res))
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    if spill:
        usage += f" spill_st={spill.group(1)}B spill_ld={spill.group(2)}B"
    ins = [line for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+\S", line)
           and not re.search(r"\bNOP\b", line)]
    stl, ldl = (sum(bool(re.search(pattern, i)) for i in ins) for pattern in (r"\bSTL", r"\bLDL"))
    usage += f" sass={len(ins)} STL={stl} LDL={ldl}"
    return usage, {op: k.asm["ttgir"].count(op) for op in ops}, sass


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kernel", choices=("prefill", "split_kv", "unified", "persistent"), default="prefill")
    p.add_argument("--paged", action="store_true", help="prefill: K/V through the block table")
    p.add_argument("--tiles", default="128x128x8x3", help="block_m x tile_n x warps x stages")
    p.add_argument("--head", type=int, default=128)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--large-cache", action="store_true", help="64-bit K/V offsets (LARGE_CACHE)")
    p.add_argument("--tma", action="store_true", help="prefill, contiguous K/V: tensor-descriptor loads")
    p.add_argument("--dump", default=None)
    a = p.parse_args(argv)
    bm, bn, warps, stages = (int(x) for x in a.tiles.split("x"))

    from pagedattn.ops.common import offsets
    from pagedattn.ops.common.bundles import AttentionArgs
    from pagedattn.ops.common.tiles import Tiles
    from pagedattn.ops.persistent.launch import launch_persistent
    from pagedattn.ops.prefill import launch as prefill_launch
    from pagedattn.ops.split_kv.launch import launch_split_kv
    from pagedattn.ops.unified.launch import launch_unified

    if a.large_cache:
        offsets.INT32_OFFSET_LIMIT = 0
    launched = intercept_launches()
    heads, kv_heads, tokens, seqs, blocks, max_blocks = 32, 8, 64, 16, 512, 256
    bf = torch.bfloat16
    paged = a.paged or a.kernel != "prefill"
    q = torch.empty(tokens, heads, a.head, dtype=bf)
    out = torch.empty_like(q)
    if paged:
        k = torch.empty(blocks, a.page, kv_heads, a.head, dtype=bf)
    else:
        k = torch.empty(4096, kv_heads, a.head, dtype=bf)
    v = torch.empty_like(k)
    counts = torch.zeros(seqs + 1, dtype=torch.int32)
    args = AttentionArgs(q=q, k_cache=k, v_cache=v, block_table=torch.zeros(seqs, max_blocks, dtype=torch.int32),
                         seq_lens=torch.zeros(seqs, dtype=torch.int32), query_start_loc=counts, scale=0.088,
                         causal=True, sliding_window=0, softcap=0.0, alibi_mode=0, alibi_slopes=None, sinks=None,
                         prefix_ranges=None, k_scale=None, v_scale=None)
    if a.kernel == "prefill":
        prefill_launch.tma_wanted = lambda t: a.tma
        prefill_launch.tma_layout_ok = lambda t: a.tma
        prefill_launch.launch_prefill(out, None, args, Tiles(bm, bm, bn, warps, stages), max_query_len=tokens,
                                      cu_seqlens_k=None if paged else counts)
    else:  # the Q-block kernels: decode tiles, e.g. --tiles 16x64x4x3 (4 query heads per KV head)
        tiles = Tiles(bm, max(1, bm // (heads // kv_heads)), bn, warps, stages)
        partial_out = torch.empty(tokens, heads, 16, a.head)
        partial_lse = torch.empty(tokens, heads, 16)
        if a.kernel == "unified":
            launch_unified(out, None, args, tiles)
        elif a.kernel == "split_kv":
            launch_split_kv(out, None, args, tiles, num_splits=16, segment_size=0, partial_out=partial_out,
                            partial_lse=partial_lse)
        else:
            plan = types.SimpleNamespace(
                partial_out=partial_out, partial_lse=partial_lse, work_counts=torch.zeros(3, dtype=torch.int32),
                work_counter=torch.zeros(1, dtype=torch.int32), work_items=torch.zeros(512, 5, dtype=torch.int32),
                reduce_rows=torch.zeros(tokens, 2, dtype=torch.int32), num_programs=528, tiles=tiles)
            launch_persistent(out, None, args, plan)
    for i, (kernel, kwargs) in enumerate(launched):
        k = compile_launch(kernel, kwargs)
        usage, stats, sass = report(k)
        print(f"{a.kernel}[{i}] {k.name} paged={paged} large={a.large_cache} tma={a.tma} tiles={a.tiles} {usage} "
              f"smem={k.metadata.shared} {stats}")
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            tag = f"{a.kernel}{i}_{'paged' if paged else 'contig'}_{a.tiles}"
            for ext, text in (("ttgir", k.asm["ttgir"]), ("ptx", k.asm["ptx"]), ("sass", sass)):
                with open(os.path.join(a.dump, f"{tag}.{ext}"), "w") as f:
                    f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
