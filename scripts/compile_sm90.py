"""Compile the prefill kernel for sm90 without a GPU and report what the compiler made of it.

``python scripts/compile_sm90.py --paged --tiles 128x128x8x3 [--dump DIR]`` prints registers,
spills, shared memory and the pipelining ops of the TTGIR (async copies, waits, wgmma). Triton
ships ptxas, so this runs on a CPU-only machine: a quick check of a kernel change's structure
before spending GPU time on timing it.
"""

from __future__ import annotations

import argparse
import os
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedattn.ops.prefill.kernel import prefill_attention_kernel


def base_fn(fn):
    from triton.runtime.jit import JITFunction

    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn


TTGIR_OPS = ("async_copy_global_to_local", "async_tma_copy", "async_wait", "warp_group_dot ", "local_load",
             "local_store", "gather", "gpu.barrier", "scf.for")


def compile_and_report(fn, signature, cvals, warps, stages, ops=TTGIR_OPS):
    """(compiled kernel, "REG:.. STACK:.. SHARED:.. LOCAL:.." from the cubin, TTGIR op counts) for
    sm90, with the launcher's specialization on a GPU: 16-byte aligned pointers and strides that
    are multiples of 16 elements (the do_not_specialize scalars get nothing)."""
    import subprocess
    import tempfile

    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if signature[name].startswith("*") or (name.startswith("stride_") and signature[name] == "i32")}
    src = ASTSource(fn=fn, signature=signature, constexprs=cvals, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    stats = {op: k.asm["ttgir"].count(op) for op in ops}
    # registers and spills from the cubin (n_regs is only filled in when a kernel is loaded on a GPU)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([os.path.join(ptxas_dir(), "cuobjdump"), "-res-usage", f.name], capture_output=True,
                             text=True).stdout
    return k, " ".join(re.findall(r"(REG:\d+|STACK:\d+|SHARED:\d+|LOCAL:\d+)", res)), stats


def ptxas_dir():
    """Where Triton keeps the ptxas and cuobjdump it ships."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kernel", choices=("prefill", "split_kv", "unified"), default="prefill")
    p.add_argument("--paged", action="store_true", help="prefill: K/V through the block table")
    p.add_argument("--tiles", default="128x128x8x3", help="block_m x tile_n x warps x stages")
    p.add_argument("--head", type=int, default=128)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--large-cache", action="store_true", help="64-bit K/V offsets (LARGE_CACHE)")
    p.add_argument("--tma", action="store_true", help="prefill, contiguous K/V: tensor-descriptor loads (USE_TMA)")
    p.add_argument("--dump", default=None)
    a = p.parse_args(argv)
    bm, bn, warps, stages = (int(x) for x in a.tiles.split("x"))
    if a.kernel != "prefill":  # the paged Q-block kernels (decode tiles: e.g. --tiles 16x64x4x2)
        from pagedattn.ops.split_kv.kernel import split_kv_attention_kernel
        from pagedattn.ops.unified.kernel import unified_attention_kernel

        a.paged = True
        fn = base_fn(split_kv_attention_kernel if a.kernel == "split_kv" else unified_attention_kernel)
    else:
        fn = base_fn(prefill_attention_kernel)
    ptrs = {"out_ptr": "*bf16", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "kv_lens_ptr": "*i32",
            "cu_seqlens_q_ptr": "*i32", "block_table_ptr": "*i32" if a.paged else "constexpr",
            "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
            "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32"}
    none_ptrs = ["lse_ptr", "sinks_ptr", "alibi_slopes_ptr", "prefix_ranges_ptr", "k_scale_ptr", "v_scale_ptr"]
    if a.tma:
        ptrs.update(k_desc=f"tensordesc<bf16[{bn}, {a.head}]>", v_desc=f"tensordesc<bf16[{bn}, {a.head}]>")
    else:
        none_ptrs += ["k_desc", "v_desc"]
    floats = {"scale", "softcap"}
    constexprs = dict(
        NUM_QUERIES_PER_KV=4, HEAD_SIZE=a.head, HEAD_SIZE_PAD=a.head, HEAD_SIZE_V=a.head, HEAD_SIZE_V_PAD=a.head, PAGE_SIZE=a.page if a.paged else 1,
        BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_Q=max(1, bm // 4), TILE_N=bn,
        IS_CAUSAL=True, USE_SOFTCAP=False, ALIBI_MODE=0, DOT_PRECISION="tf32", USE_SINKS=False, USE_PREFIX=False,
        KV_FP8=False, RETURN_LSE=False, PAGED=a.paged, LARGE_CACHE=a.large_cache, USE_PDL=True, USE_TMA=a.tma,
        POSITIVE_SCALE=True,
    )
    signature, cvals = {}, {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
            cvals[(fn.arg_names.index(name),)] = constexprs[name]
        elif name in none_ptrs or (name == "block_table_ptr" and not a.paged):
            signature[name] = "constexpr"
            cvals[(fn.arg_names.index(name),)] = None
        elif name in ptrs:
            signature[name] = ptrs[name]
        elif name in floats:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    k, usage, stats = compile_and_report(fn, signature, cvals, warps, stages)
    print(f"{a.kernel} paged={a.paged} large={a.large_cache} tma={a.tma} tiles={a.tiles} {usage} smem={k.metadata.shared} {stats}")
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        tag = f"{a.kernel}_{'paged' if a.paged else 'contig'}_{a.tiles}"
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(a.dump, f"{tag}.{ext}"), "w") as f:
                f.write(k.asm[ext])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
