"""Compile the Gluon kernels (the MLA decode kernel for sm90) without a GPU and report what ptxas made of them.

    python -m pagedattn.compile_gluon   # registers, spills, shared memory per tile / page

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


def main() -> int:
    failed = False
    for dtype in (torch.bfloat16, torch.float16):
        for page in (16, 64):
            for tile_n, stages in TILINGS:
                row = compile_usage(page, tile_n, stages, dtype)
                failed |= bool(row["problems"])
                print(f"{str(dtype).removeprefix('torch.'):9} page {page:3} tile {tile_n:3} stages {stages}: "
                      f"{row['regs']} registers, {row['spill_bytes']} B spilled, {row['shared']} B shared"
                      + (f"  PROBLEMS: {'; '.join(row['problems'])}" if row["problems"] else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
