"""Host time per call of varlen_attention (contiguous K/V, TMA off and on) against its GPU time:
the eager time of a call is the larger of the two. Prints one table row per (S, TMA).

    PYTHONPATH=. python scripts/host_launch_cost.py
"""

import os
import time

import torch
import triton

from pagedattn import varlen_attention


def main() -> None:
    print("| S | TMA | host us/call | GPU us (graph) | eager us |")
    print("|---|---|---|---|---|")
    for s in (512, 2048, 8192):
        g = torch.Generator(device="cuda").manual_seed(s)
        q = torch.randn(s, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(s, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(s, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        cu = torch.tensor([0, s], dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        for tma in ("0", "1"):
            os.environ["PAGEDATTN_TMA"] = tma

            def fn():
                varlen_attention(q, k, v, cu, cu, causal=True, max_query_len=s, out=out)
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            n = 50  # far fewer than the launch queue holds: the loop measures the host side only
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            host = (time.perf_counter() - t0) / n * 1e6
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            gpu = triton.testing.do_bench(graph.replay, warmup=10, rep=50, return_mode="median") * 1e3
            eager = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
            print(f"| {s} | {tma} | {host:.1f} | {gpu:.1f} | {eager:.1f} |", flush=True)


if __name__ == "__main__":
    main()
