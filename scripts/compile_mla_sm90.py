"""Compile the MLA decode kernel for sm90 without a GPU and report what the compiler made of it.

``PYTHONPATH=. python scripts/compile_mla_sm90.py [--config b32|b1|all] [--large-cache] [--fp8] [--dump DIR]``
prints registers, spills (STACK/LOCAL), shared memory and the pipelining ops of the TTGIR for the
configs ``pick_mla_config`` gives on the benchmark (128 heads, 512 + 64 latent, page 16, bf16):

* ``b32``: B >= 32 (unsplit grid fills the GPU): h64 q1 n64 v1, 8 warps, 2 stages;
* ``b1``:  B = 1 (small grid, keys split): h64 q1 n32 v2, 4 warps, 4 stages.

Both compile the split-KV form (fp32 partials + lse, PDL on) that the benchmark's B=1 and B=32 rows
run. Whatever ``pagedattn`` is first on the path is compiled (PYTHONPATH selects the tree).
"""

from __future__ import annotations

import argparse
import os
import re

from compile_sm90 import compile_launch, intercept_launches, report  # this folder (the script's path comes first)

import torch

import pagedattn
from pagedattn.ops.common import offsets
from pagedattn.ops.mla.launch import MLAConfig, launch_mla_decode

TTGIR_OPS = ("async_copy_global_to_local", "async_tma_copy", "async_wait", "warp_group_dot ", "warp_group_dot_wait",
             "local_load", "local_store", "local_alloc", "gather", "gpu.barrier", "scf.for", "scf.if")
CONFIGS = {  # block_h, block_q, tile_n, value_split, warps, stages
    "b32": (64, 1, 64, 1, 8, 2),
    "b1": (64, 1, 32, 2, 4, 4),
}


def sass_loops(sass):
    """(start, end, instructions, op counts) of each backward branch's range in the SASS, innermost first."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    at = {a: i for i, (a, _) in enumerate(ins)}
    keys = {"STL": r"\bSTL", "LDL": r"\bLDL", "LDGSTS": "LDGSTS", "HGMMA": "HGMMA", "BAR": r"\bBAR\b",
            "LDS": r"\bLDS", "STS": r"\bSTS"}
    out = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r"\bBRA\b.*0x([0-9a-f]+)\s*$", text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            body = [t for _, t in ins[at[int(m.group(1), 16)]:i + 1]]
            out.append((int(m.group(1), 16), a, len(body),
                        {k: sum(1 for t in body if re.search(v, t)) for k, v in keys.items()}))
    return sorted(out, key=lambda r: r[2])


def compile_one(name, *, page=16, large_cache=False, fp8=False, splits=True, dump=None):
    block_h, block_q, tile_n, value_split, warps, stages = CONFIGS[name]
    tokens, heads, latent, rope, blocks, seqs = 64, 128, 512, 64, 512, 16
    bf = torch.bfloat16
    offsets.INT32_OFFSET_LIMIT = 0 if large_cache else 2**31
    launched = intercept_launches()
    num_splits = 8 if splits else 1
    launch_mla_decode(
        torch.empty(tokens, heads, latent, dtype=bf), torch.empty(tokens, heads),
        torch.empty(tokens, heads, latent, dtype=bf), torch.empty(tokens, heads, rope, dtype=bf),
        torch.empty(blocks, page, latent + rope, dtype=torch.float8_e4m3fn if fp8 else bf),
        torch.zeros(seqs, 256, dtype=torch.int32), torch.zeros(seqs, dtype=torch.int32),
        torch.zeros(seqs + 1, dtype=torch.int32), scale=0.1, kv_scale=torch.ones(1) if fp8 else None,
        config=MLAConfig(block_h, block_q, tile_n, value_split, warps, stages), num_splits=num_splits,
        partial_out=torch.empty(tokens, heads, num_splits, latent), partial_lse=torch.empty(tokens, heads, num_splits))
    k = compile_launch(*launched[0])  # the decode kernel (then the merge)
    usage, stats, sass = report(k, TTGIR_OPS)
    loops = sass_loops(sass)
    print(f"mla {name} h{block_h}q{block_q}-n{tile_n}-v{value_split}-w{warps}-s{stages} page={page} "
          f"large={large_cache} fp8={fp8} splits={splits}: {usage} smem={k.metadata.shared} {stats}", flush=True)
    for lo, hi, n, counts in loops:  # the key loops hold the HGMMAs; the other is find_q_block's
        if counts["HGMMA"]:
            print(f"    SASS loop [{lo:#x}, {hi:#x}]: {n} instructions a trip, "
                  + " ".join(f"{k}={v}" for k, v in counts.items()))
    if dump:
        os.makedirs(dump, exist_ok=True)
        tag = f"mla_{name}_p{page}{'_large' if large_cache else ''}{'_fp8' if fp8 else ''}"
        for ext, text in (("ttgir", k.asm["ttgir"]), ("ptx", k.asm["ptx"]), ("sass", sass)):
            with open(os.path.join(dump, f"{tag}.{ext}"), "w") as f:
                f.write(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", choices=("b32", "b1", "all"), default="all")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--large-cache", action="store_true")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--no-splits", action="store_true", help="one split: bf16 out, no PDL (the B=128 rows)")
    p.add_argument("--dump", default=None)
    a = p.parse_args(argv)
    print("pagedattn from", os.path.dirname(pagedattn.__file__))
    for name in (("b32", "b1") if a.config == "all" else (a.config,)):
        compile_one(name, page=a.page, large_cache=a.large_cache, fp8=a.fp8, splits=not a.no_splits, dump=a.dump)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
