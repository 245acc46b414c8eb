"""``pagedattn check``: every path and feature against the reference on this machine.

The first command to run on new hardware. On a GPU it uses realistic head counts and lengths
in every dtype; without one it runs Triton's interpreter on small shapes (fp16/fp32 only).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _select_device() -> str:
    import torch

    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return "cuda"
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the kernels
    return "cpu"


def _configs(device: str):
    import torch

    if device == "cuda":
        dtypes = [torch.bfloat16, torch.float16, torch.float32]
        shape = dict(num_q_heads=32, num_kv_heads=8, head_size=128, block_size=16)
        batches = {
            "decode": [(1, 1), (1, 17), (1, 463), (1, 4099), (1, 1328)],
            "prefill": [(1, 1), (129, 129), (1000, 1000)],
            "mixed": [(1, 1328), (5, 18), (129, 463), (0, 7), (1, 1), (300, 2000), (8, 4096)],
        }
    else:
        dtypes = [torch.float16, torch.float32]
        shape = dict(num_q_heads=4, num_kv_heads=2, head_size=32, block_size=16)
        batches = {
            "decode": [(1, 1), (1, 17), (1, 129)],
            "prefill": [(1, 1), (33, 33)],
            "mixed": [(1, 129), (5, 18), (0, 7), (17, 40)],
        }
    return dtypes, shape, batches


def _attention_rows(device: str):
    """Yield (feature, batch_name, dtype, extra, kwargs-builder) for the attention checks."""
    import torch

    from pagedattn.testing import FEATURES

    dtypes, shape, batches = _configs(device)
    for dtype in dtypes:
        for feature in FEATURES:
            for batch_name in batches:
                yield feature, batch_name, dtype, shape, None
        yield "fp8-cache", "mixed", dtype, shape, torch.float8_e4m3fn
    for head_size in (64, 80, 256):
        yield f"head{head_size}", "mixed", dtypes[0], dict(shape, head_size=head_size), None
    for block_size in (32, 64, 128):
        yield f"page{block_size}", "mixed", dtypes[0], dict(shape, block_size=block_size), None


def run_check(device: str | None = None, *, quiet: bool = False) -> list[dict]:
    """Run every check; returns one dict per row (also printed as a table unless quiet)."""
    device = device or _select_device()
    import torch

    from pagedattn import paged_attention, write_kv
    from pagedattn.reference import paged_attention_ref, write_kv_ref
    from pagedattn.testing import (
        FEATURES,
        TOLERANCES,
        feature_kwargs,
        make_paged_batch,
        max_errors,
        within_tolerance,
    )

    from pagedattn.plan import plan_attention

    _, _, batches = _configs(device)

    def run_path(path, batch, **kwargs):
        plan = plan_attention(
            batch.query_start_loc.cpu(), batch.seq_lens.cpu(), num_q_heads=batch.q.shape[1],
            num_kv_heads=batch.k_cache.shape[2], head_size=batch.q.shape[2], device=device,
            path=path, num_splits=None if path != "split_kv" else 5,
        )
        return paged_attention(*batch.args(), plan=plan, **kwargs)

    paths = {name: (lambda *a, _p=name, **kw: run_path(_p, *a, **kw))
             for name in ("auto", "unified", "split_kv", "persistent")}
    rows = []
    g = torch.Generator().manual_seed(0)
    for feature, batch_name, dtype, shape, cache_dtype in _attention_rows(device):
        cases = batches[batch_name]
        batch = make_paged_batch(cases, dtype=dtype, cache_dtype=cache_dtype, device=device, generator=g, **shape)
        if cache_dtype is not None:
            kwargs = {"k_scale": 0.7, "v_scale": 1.3}
        elif feature in FEATURES:
            kwargs = feature_kwargs(feature, shape["num_q_heads"], len(cases), device=device, generator=g)
        else:
            kwargs = {}
        ref_out, ref_lse = paged_attention_ref(
            *batch.args(), compute_dtype=torch.float64, **kwargs
        )
        for path, fn in paths.items():
            out = torch.full_like(batch.q, float("nan"))
            out, lse = fn(batch, out=out, return_lse=True, **kwargs)
            out_err, lse_err, _ = max_errors(out, lse, ref_out, ref_lse)
            rows.append(dict(
                path=path, feature=feature, batch=batch_name, dtype=str(dtype).replace("torch.", ""),
                out_err=out_err, lse_err=lse_err, atol=TOLERANCES[dtype][0],
                ok=within_tolerance(out, lse, ref_out, ref_lse),
            ))

    # write_kv, plain and into an fp8 cache
    dtypes, shape, _ = _configs(device)
    for dtype in dtypes:
        for cache_dtype in (dtype, torch.float8_e4m3fn):
            n, h, d, bs = 37, shape["num_kv_heads"], shape["head_size"], shape["block_size"]
            key = torch.randn(n, h, d, generator=g).to(device, dtype)
            value = torch.randn(n, h, d, generator=g).to(device, dtype)
            k_cache = torch.randn(8, bs, h, d, generator=g).to(device, cache_dtype)
            v_cache = torch.randn(8, bs, h, d, generator=g).to(device, cache_dtype)
            slots = torch.randperm(8 * bs, generator=g)[:n].to(device)
            slots[5] = -1
            ref_k, ref_v = write_kv_ref(key, value, k_cache, v_cache, slots, k_scale=0.5, v_scale=2.0)
            write_kv(key, value, k_cache, v_cache, slots, k_scale=0.5, v_scale=2.0)
            err = max((k_cache.float() - ref_k.float()).abs().max().item(),
                      (v_cache.float() - ref_v.float()).abs().max().item())
            rows.append(dict(
                path="write_kv", feature="fp8" if cache_dtype != dtype else "plain", batch="-",
                dtype=str(dtype).replace("torch.", ""), out_err=err, lse_err=0.0, atol=0.0,
                ok=bool(torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
                        and torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))),
            ))
    if not quiet:
        print_table(rows, device)
    return rows


def print_table(rows: list[dict], device: str) -> None:
    import torch
    import triton

    if device == "cuda":
        where = f"{torch.cuda.get_device_name()} (GPU)"
    else:
        where = "CPU, Triton interpreter (small shapes)"
    print(f"pagedattn check on {where}; torch {torch.__version__}, triton {triton.__version__}")
    header = f"{'path':<9} {'feature':<17} {'batch':<8} {'dtype':<9} {'max|out err|':>12} {'max|lse err|':>12} {'atol':>8}  result"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['path']:<9} {r['feature']:<17} {r['batch']:<8} {r['dtype']:<9} "
            f"{r['out_err']:>12.2e} {r['lse_err']:>12.2e} {r['atol']:>8.0e}  {'PASS' if r['ok'] else 'FAIL'}"
        )
    failed = sum(not r["ok"] for r in rows)
    print(f"{len(rows) - failed} passed, {failed} failed")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pagedattn check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="default: cuda when available, else the CPU interpreter")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    start = time.perf_counter()
    rows = run_check(args.device or _select_device())
    print(f"({time.perf_counter() - start:.1f} s)")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
