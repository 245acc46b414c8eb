"""Compile the Gluon kernels (MLA decode, prefill) for sm90 without a GPU and report what ptxas made of them.

    python -m pagedattn.compile_gluon   # registers, spills, shared memory per tile / page

The prefill kernel is warp-specialized: its rows also give the registers of each partition
(``partition_registers``: the ``setmaxnreg`` cap and the registers its code uses).

The launcher runs on CPU tensors inside ``capturing`` (nothing is launched), so the kernel is
compiled with the arguments it builds; the figures come from ``pagedattn.compile_matrix.usage``
(``cuobjdump -res-usage``, ``ptxas -v`` where there is a stack frame, the sm90 shared-memory
limit). ``compile_matrix.compile_launch`` builds an ``ASTSource``; a Gluon kernel needs a
``GluonASTSource``, hence ``compile_gluon_launch``.
"""

from __future__ import annotations

import torch

from pagedattn.ops.mla.launch import MLAConfig
from pagedattn.ops.mla_gluon.launch import (
    GLUON_LATENT_DIM,
    GLUON_MLA_CONFIG,
    GLUON_ROPE_DIM,
    launch_mla_decode_gluon,
)

# (tile_n, num_stages) worth compiling: the default, and 32-key tiles at the most stages that fit
TILINGS = ((GLUON_MLA_CONFIG.tile_n, GLUON_MLA_CONFIG.num_stages), (32, 4))


def compile_gluon_launch(kernel, kwargs: dict, target: str = "sm90"):
    """The compiled kernel of ``kernel[grid](**kwargs)`` for ``target``, specialized as the JIT
    would (16-byte aligned pointers, strides that are multiples of 16)."""
    import triton
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    from pagedattn.ops.common.target import gpu_target, props_for

    gpu = gpu_target(props_for(target))
    backend = make_backend(gpu)
    bound, specialization, options = create_function_from_signature(kernel.signature, kernel.params, backend)(**kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, options, bound, specialization, options)
    src = GluonASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=gpu, options=dict(options.__dict__))


def capture_launch(page_size: int, config: MLAConfig = GLUON_MLA_CONFIG, dtype: torch.dtype = torch.bfloat16,
                   num_heads: int = 128, num_splits: int = 1, return_lse: bool = True) -> tuple:
    """``(kernel, grid, kwargs)`` of the Gluon launch for a small batch of CPU tensors."""
    from pagedattn.ops.common.launching import capturing

    num_seqs, num_blocks, max_blocks = 2, 8, 4
    q = torch.zeros(num_seqs, num_heads, GLUON_LATENT_DIM + GLUON_ROPE_DIM, dtype=dtype)
    kv_cache = torch.zeros(num_blocks, page_size, GLUON_LATENT_DIM + GLUON_ROPE_DIM, dtype=dtype)
    block_table = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    seq_lens = torch.ones(num_seqs, dtype=torch.int32)
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
    out = torch.empty(num_seqs, num_heads, GLUON_LATENT_DIM, dtype=dtype)
    lse = torch.empty(num_seqs, num_heads, dtype=torch.float32) if return_lse else None
    partial_out = partial_lse = None
    if num_splits > 1:
        partial_out = torch.empty(num_seqs, num_heads, num_splits, GLUON_LATENT_DIM, dtype=torch.float32)
        partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32)
    with capturing() as launched:
        launch_mla_decode_gluon(out, lse, q[..., :GLUON_LATENT_DIM], q[..., GLUON_LATENT_DIM:], kv_cache, block_table,
                                seq_lens, query_start_loc, scale=0.07, config=config, num_splits=num_splits,
                                partial_out=partial_out, partial_lse=partial_lse)
    return launched[0]


def compile_usage(page_size: int, tile_n: int, num_stages: int, dtype: torch.dtype = torch.bfloat16,
                  num_splits: int = 1) -> dict:
    """``compile_matrix.usage`` of the kernel compiled for sm90 (regs, spill_bytes, shared, problems)."""
    from pagedattn.compile_matrix import usage

    config = MLAConfig(block_h=GLUON_MLA_CONFIG.block_h, tile_n=tile_n, num_warps=8, num_stages=num_stages)
    kernel, _, kwargs = capture_launch(page_size, config, dtype, num_splits=num_splits)
    return usage(compile_gluon_launch(kernel, kwargs, "sm90"), "sm90")


def capture_prefill_launch(page_size: int, dtype: torch.dtype = torch.bfloat16, return_lse: bool = True,
                           config=None, head_size: int = 128, num_q_heads: int = 32, num_kv_heads: int = 8) -> tuple:
    """``(kernel, grid, kwargs)`` of the Gluon prefill launch for a small batch of CPU tensors."""
    from pagedattn.ops.common.bundles import AttentionArgs
    from pagedattn.ops.common.launching import capturing
    from pagedattn.ops.prefill_gluon.launch import GLUON_PREFILL_CONFIG, launch_prefill_gluon

    num_seqs, num_blocks, max_blocks, num_tokens = 2, 8, 4, 300
    q = torch.zeros(num_tokens, num_q_heads, head_size, dtype=dtype)
    k_cache = torch.zeros(num_blocks, page_size, num_kv_heads, head_size, dtype=dtype)
    args = AttentionArgs(q=q, k_cache=k_cache, v_cache=torch.zeros_like(k_cache),
                         block_table=torch.zeros(num_seqs, max_blocks, dtype=torch.int32),
                         seq_lens=torch.full((num_seqs,), 150, dtype=torch.int32),
                         query_start_loc=torch.tensor([0, 150, 300], dtype=torch.int32), scale=head_size ** -0.5,
                         causal=True, sliding_window=0, softcap=0.0, alibi_mode=0, alibi_slopes=None, sinks=None,
                         prefix_ranges=None, k_scale=None, v_scale=None)
    out = torch.empty_like(q)
    lse = torch.empty(num_tokens, num_q_heads, dtype=torch.float32) if return_lse else None
    with capturing() as launched:
        launch_prefill_gluon(out, lse, args, max_query_len=150, config=config or GLUON_PREFILL_CONFIG)
    return launched[0]


def partition_registers(compiled, producer_regs: int) -> dict:
    """Registers of a warp-specialized kernel's partitions: ``{"default": (cap, used), "producer":
    (cap, used)}``. The SASS is cut at its ``USETMAXREG`` instructions; a stretch belongs to the
    producer when the cap set before it is ``producer_regs``, else to the default partition
    (its code before and after the fork included). ``used``: the highest register a stretch
    names, plus one (a lower bound: a 64-bit operand also takes the register after it); ``cap``:
    the ``setmaxnreg`` cap of the stretch that uses the most (0 where none is set: the kernel's
    register count bounds it)."""
    import re
    import subprocess
    import tempfile

    from pagedattn.compile_matrix import _cuobjdump

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True).stdout
    parts = {"default": (0, 0), "producer": (0, 0)}
    cap = 0
    for line in sass.splitlines():
        m = re.search(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d, )?0x([0-9a-f]+)", line)
        if m:
            cap = int(m.group(1), 16)
            continue
        regs = [int(r) for r in re.findall(r"\bR(\d+)\b", line.split(";")[0])]
        name = "producer" if cap == producer_regs else "default"
        if regs and max(regs) + 1 > parts[name][1]:
            parts[name] = (cap, max(regs) + 1)
    return parts


def compile_prefill_usage(page_size: int, dtype: torch.dtype = torch.bfloat16, return_lse: bool = True,
                          config=None, head_size: int = 128) -> dict:
    """``compile_matrix.usage`` of the Gluon prefill kernel compiled for sm90, with
    ``partition_regs`` (``partition_registers``)."""
    from pagedattn.compile_matrix import usage
    from pagedattn.ops.prefill_gluon.launch import GLUON_PREFILL_CONFIG

    config = config or GLUON_PREFILL_CONFIG
    kernel, _, kwargs = capture_prefill_launch(page_size, dtype, return_lse, config, head_size)
    compiled = compile_gluon_launch(kernel, kwargs, "sm90")
    row = usage(compiled, "sm90")
    row["partition_regs"] = partition_registers(compiled, config.producer_regs)
    return row


def main() -> int:
    failed = False
    print("MLA decode (mla_decode_gluon_kernel)")
    for dtype in (torch.bfloat16, torch.float16):
        for page in (16, 64):
            for tile_n, stages in TILINGS:
                row = compile_usage(page, tile_n, stages, dtype)
                failed |= bool(row["problems"])
                print(f"{str(dtype).removeprefix('torch.'):9} page {page:3} tile {tile_n:3} stages {stages}: "
                      f"{row['regs']} registers, {row['spill_bytes']} B spilled, {row['shared']} B shared"
                      + (f"  PROBLEMS: {'; '.join(row['problems'])}" if row["problems"] else ""))
    from pagedattn.ops.prefill_gluon.launch import GLUON_PREFILL_CONFIG as cfg

    print(f"prefill (prefill_gluon_kernel), head 128, {cfg.block_m} x {cfg.block_n} tiles, {cfg.num_stages} stages, "
          f"{cfg.num_warps} + {cfg.producer_warps} warps")
    for dtype in (torch.bfloat16, torch.float16):
        for page in (16, 64):
            for return_lse in (True, False):
                row = compile_prefill_usage(page, dtype, return_lse)
                failed |= bool(row["problems"])
                (d_cap, d_used), (p_cap, p_used) = row["partition_regs"]["default"], row["partition_regs"]["producer"]
                print(f"{str(dtype).removeprefix('torch.'):9} page {page:3} lse {'on ' if return_lse else 'off'}: "
                      f"default partition {d_used} of {d_cap} registers, producer {p_used} of {p_cap}, "
                      f"{row['spill_bytes']} B spilled, {row['shared']} B shared"
                      + (f"  PROBLEMS: {'; '.join(row['problems'])}" if row["problems"] else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
