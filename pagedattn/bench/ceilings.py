"""Hardware ceilings measured in the same run: a large device read and a large bf16 matmul."""

from __future__ import annotations

import torch

READ_BYTES = 4 * 2**30  # bf16 elements summed: far past the L2
MATMUL_N = 8192


def measure_ceilings(device: torch.device) -> dict:
    """``{"read_gbps", "matmul_tflops", ...}``; empty on the CPU (nothing meaningful to measure)."""
    if device.type == "cpu":
        return {}
    import triton.testing

    def median_ms(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    x = torch.empty(READ_BYTES // 2, dtype=torch.bfloat16, device=device).uniform_()
    read_ms = median_ms(lambda: torch.sum(x))

    n = MATMUL_N
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    mm_ms = median_ms(lambda: a @ b)
    x = a = b = None  # free before the cases run
    torch.cuda.empty_cache()
    return {
        "read_gbps": READ_BYTES / (read_ms * 1e-3) / 1e9,
        "read_bytes": READ_BYTES,
        "matmul_tflops": 2 * n**3 / (mm_ms * 1e-3) / 1e12,
        "matmul_shape": [n, n, n],
    }
