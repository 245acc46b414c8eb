#!/usr/bin/env python3
"""Where a vLLM step's GPU time goes, per kernel, for each attention backend.

Runs vLLM offline in this process's child (engine core in-process, so torch.profiler sees its
kernels, CUDA graph replays included), one fresh process per backend, with the model, weights
and engine flags of ``run_vllm_e2e.py`` (the vLLM-on-GPU runner; ``--runner``, default
``.vllm_wheels/run_vllm_e2e.py``). Its own flags (``--model-config``, ``--config-json``,
``--max-model-len``, ``--max-num-batched-tokens``, ``--gpu-mem``, ``--site``, ...) pass through.

* decode points (``--points BxL,...``): B prompts of L tokens, profiled twice, generating 1 token
  and 1 + D tokens; per kernel name, (GPU time of the second - of the first) / D is its time in
  one decode step, with launches per step. Where ``--max-num-batched-tokens`` is under B x L the
  prompts are chunked, and the steps that prefill the later chunks also carry the decodes of the
  earlier prompts in the second run only: the difference then holds those mixed steps' kernels
  too, while the decode kernels' rows (one launch a layer a step) stay pure decode steps.
* replay (``--replay N``): after each decode point, one layer's attention call of its last decode
  step (the impl's ``forward`` with the arguments it was captured with into the decode graph of
  B tokens: the engine's activations, cache and metadata buffers, which then hold that step)
  runs N times alone in the engine's process, per kernel timed as above: as captured; after a
  GEMM the size of the model's MLP up-projection each time (the HBM and L2 state a layer leaves);
  with q copied out of the QKV projection's rows; as a CUDA graph replay; for CUSTOM with a new
  cache (random, and the engine's copied), with each sequence's pages in order, with the bench's
  plan, with a new q and output, and the bench's own call (its inputs and graph plan) in this
  process, with and without PDL, then the registers and spills of every build of the persistent
  kernel in the process; and, for FLASH_ATTN, the bench's ``vllm_kernels.fa3_call`` on the same
  cache and metadata. It tells whether a kernel's in-engine time comes from its arguments, its
  surroundings or its compiled code (inside vLLM, torch's inductor points Triton at torch's
  ptxas: docs/vllm.md). The last step must
  hold the whole batch: with chunked prompts (``--max-num-batched-tokens`` under B x L) the
  first chunks' sequences finish first and the last steps hold fewer.
* prompts (``--prompts L,...``): one-token requests of an L-token prompt, one after another
  (``--prompt-requests`` of them, after two warm-ups), the first token's path that TTFT times:
  wall time a request unprofiled and profiled, the kernels' busy time (union of their
  intervals) and per kernel GPU time a request. Wall minus busy is the time the GPU waited on
  the host (scheduling, metadata, launches of the eager attention between the piecewise graphs).
  Beside it, the host time a request of the backend's builder ``build`` and impl ``forward`` /
  ``do_kv_cache_update`` (``HostClock``, unprofiled), the garbage collector's time and each
  request's wall (unprofiled), and of each CUDA runtime or driver call (profiled), and where the
  GPU waited: its idle time between kernels by the kernels on either side (profiled).
* traffic (``--traffic N``): N requests of unequal lengths (prompts 64-4096, outputs 16-512, the
  runner's distribution, its own seed), once unprofiled for the wall time, then profiled: per
  kernel GPU time, the kernels' busy time (union of their intervals) and the share of it in
  attention kernels (``ATTENTION`` below), which bounds what any attention kernel can gain:
  with attention free, the run could go at most busy / (busy - attention) faster.

    python3 scripts/vllm_profile.py --backends CUSTOM,FLASH_ATTN --points 64x2048 --traffic 96
    python3 scripts/vllm_profile.py --backends CUSTOM,FLASH_ATTN --model-config mistral-7b --prompts 500

Writes ``$OUT/vllm_profile.json`` (every kernel) and prints a short table per backend last.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

# Kernels of the attention layer (the attention itself, its split merge, the KV-cache write) of
# pagedattn, FA3, vLLM's Triton backend and FlashInfer; the GEMMs, norms and sampling are not.
ATTENTION = re.compile(r"attention|attn|flash|fmha|reshape_and_cache|write_kv|persistent_reduce|merge_|"
                       r"combine|reduce_segments|split_kv|reduce_splits|prefill_|gluon_kernel|mla_decode|paged|BatchPrefill|BatchDecode", re.IGNORECASE)
NOT_ATTENTION = re.compile(r"nvjet|cublas|gemm|rms_norm|silu|sample|splitKreduce", re.IGNORECASE)


def is_attention(name: str) -> bool:
    return bool(ATTENTION.search(name)) and not NOT_ATTENTION.search(name)


def load_runner(path: str):
    spec = importlib.util.spec_from_file_location("run_vllm_e2e", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runner", default=".vllm_wheels/run_vllm_e2e.py", help="path of run_vllm_e2e.py")
    p.add_argument("--backends", default="CUSTOM,FLASH_ATTN")
    p.add_argument("--points", default="", help="decode points BATCHxCONTEXT,... (the runner's grid syntax)")
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--replay", type=int, default=0, help="calls of the replayed layer per variant (0: none)")
    p.add_argument("--traffic", type=int, default=0, help="requests of the profiled traffic run (0: none)")
    p.add_argument("--prompts", default="", help="prompt lengths L,... of profiled one-token requests")
    p.add_argument("--prompt-requests", type=int, default=10, help="one-token requests timed a prompt length")
    p.add_argument("--per-backend-timeout", type=float, default=300.0)
    p.add_argument("--top", type=int, default=12, help="kernels printed per workload")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    return p.parse_known_args(argv)


def runner_args(e2e, own, rest: list[str]):
    """The runner's settings: its defaults and the passed-through flags, with our decode points
    (they size max_model_len, max_num_batched_tokens and the graph capture sizes as the runner's)."""
    argv = list(rest) + ["--inproc", "--b64-decode", str(own.decode_steps)]
    if own.points:
        argv += ["--grid", ",".join(f"{b}x{l}" for b, l in own.points)]
    else:
        argv += ["--no-batch64"]
    return e2e.parse_args(argv)


def _tally(rows: dict, key: str, amount: float) -> None:
    """``rows[key]`` is [total, count]: add ``amount`` and one."""
    row = rows.setdefault(key, [0.0, 0])
    row[0] += amount
    row[1] += 1


def _per_request(rows: dict, n: int, most: int | None = None) -> dict:
    """[total, count] rows divided by ``n`` requests, the largest total first (the ``most`` largest)."""
    ordered = sorted(rows.items(), key=lambda kv: -kv[1][0])[:most]
    return {k: [round(v[0] / n, 1), round(v[1] / n, 2)] for k, v in ordered}


def kernel_table(trace_path: str) -> dict:
    """Per kernel name [GPU us, launches], the busy time (union of kernel intervals), per CUDA
    runtime or driver call made on the host [us, calls] (launches, pointer queries, copies and
    synchronizations: a call that waits for the GPU shows here as a long one), and the GPU's idle
    time between kernels [us, gaps] by the names of the kernels before and after each gap, from a
    chrome trace that torch.profiler wrote."""
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    table: dict[str, list[float]] = {}
    api: dict[str, list[float]] = {}
    spans = []
    for ev in events:
        if ev.get("ph") != "X":
            continue
        if ev.get("cat") in ("cuda_runtime", "cuda_driver"):
            _tally(api, ev["name"], float(ev.get("dur", 0.0)))
            continue
        if ev.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ts, dur = float(ev["ts"]), float(ev.get("dur", 0.0))
        _tally(table, ev["name"], dur)
        spans.append((ts, ts + dur, ev["name"]))
    spans.sort()
    busy, end, last = 0.0, float("-inf"), None
    gaps: dict[str, list[float]] = {}  # the GPU idle between two kernels, by the pair's names
    for a, b, name in spans:
        if b <= end:
            continue
        if a > end and last is not None:
            _tally(gaps, f"{last[:60]} -> {name[:60]}", a - end)
        busy += b - max(a, end)
        end, last = b, name
    return {"kernels": table, "busy_us": busy, "api": api, "gaps": gaps}


def profiled(fn, tmp: str, tag: str):
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    path = os.path.join(tmp, f"{tag}.json")
    prof.export_chrome_trace(path)
    table = kernel_table(path)
    os.remove(path)
    table["wall_us"] = wall * 1e6
    return result, table


def summarize(kernels: dict, scale: float) -> dict:
    """kernels {name: [us, launches]} scaled (per step), with the attention sum."""
    rows = {k: [round(v[0] * scale, 2), round(v[1] * scale, 2)] for k, v in kernels.items()}
    rows = dict(sorted(rows.items(), key=lambda kv: -kv[1][0]))
    attn = sum(v[0] for k, v in rows.items() if is_attention(k))
    total = sum(v[0] for v in rows.values())
    return {"kernel_us": round(total, 1), "attention_us": round(attn, 1), "kernels": rows}


class ForwardRecorder:
    """Wraps the attention impls' ``forward`` to keep, per token count, the last call's arguments
    captured into a CUDA graph (the last layer's, in the decode graph of that many tokens: under
    full CUDA graphs the decode steps replay it and call no Python)."""

    IMPLS = (("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl"),
             ("pagedattn.integrations.vllm.backend", "PagedAttnImpl"))

    def __init__(self):
        self.calls = {}
        for module, name in self.IMPLS:
            try:
                cls = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                continue
            cls.forward = self._wrap(cls.forward)

    def _wrap(self, forward):
        import torch

        def recorded(impl, layer, query, key, value, kv_cache, attn_metadata, output, *rest, **kw):
            if attn_metadata is not None and torch.cuda.is_current_stream_capturing():
                self.calls[query.shape[0]] = (forward, impl, (layer, query, key, value, kv_cache, attn_metadata,
                                                              output) + rest, kw)
            return forward(impl, layer, query, key, value, kv_cache, attn_metadata, output, *rest, **kw)

        return recorded


class HostClock:
    """Host time of the attention backends' per-step methods: the metadata builder's ``build``
    and the impl's ``forward`` and ``do_kv_cache_update``, summed per method while ``on`` (wall
    clock around the call: under piecewise CUDA graphs the attention runs eagerly, so a prefill
    step pays these once a layer on the host)."""

    CLASSES = (("vllm.v1.attention.backends.flash_attn", ("FlashAttentionMetadataBuilder", "FlashAttentionImpl")),
               ("vllm.v1.attention.backends.triton_attn", ("TritonAttentionMetadataBuilder", "TritonAttentionImpl")),
               ("vllm.v1.attention.backends.flashinfer", ("FlashInferMetadataBuilder", "FlashInferImpl")),
               ("pagedattn.integrations.vllm.backend", ("PagedAttnMetadataBuilder", "PagedAttnImpl")))
    METHODS = ("build", "forward", "do_kv_cache_update")

    def __init__(self):
        self.on = False
        self._step_started = False
        self.totals: dict[str, list[float]] = {}
        for module, names in self.CLASSES:
            try:
                mod = importlib.import_module(module)
            except ImportError:
                continue
            for name in names:
                cls = getattr(mod, name, None)
                for method in self.METHODS:
                    if cls is not None and method in vars(cls):
                        setattr(cls, method, self._wrap(vars(cls)[method], f"{name}.{method}"))

    def _wrap(self, fn, label):
        first_label = f"{label} (first of a step)"

        def timed(*args, **kw):
            if not self.on:
                return fn(*args, **kw)
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                # the first forward after a build runs a new plan (pagedattn records its launches there)
                name = label
                if label.endswith(".build"):
                    self._step_started = True
                elif label.endswith(".forward") and self._step_started:
                    self._step_started, name = False, first_label
                _tally(self.totals, name, (time.perf_counter() - t) * 1e6)

        return timed

    def take(self, requests: int) -> dict:
        """{method: [us, calls]} a request over ``requests``, and the sums reset."""
        rows = _per_request(self.totals, requests)
        self.totals = {}
        return rows


class GcClock:
    """Time spent in Python's garbage collector inside the block (``gc.callbacks``), and the
    collections per generation: a full collection over the engine's heap is a host pause that
    one request's wall time would show and its GPU time would not."""

    def __enter__(self):
        self.seconds, self.collections, self._t = 0.0, [0, 0, 0], None
        gc.callbacks.append(self._callback)
        return self

    def _callback(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.seconds += time.perf_counter() - self._t
            self.collections[info["generation"]] += 1
            self._t = None

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)
        return False


def describe(md) -> dict:
    """The metadata's host values, tensor shapes, and small or key tensors' values."""
    out = {}
    for name, v in sorted(vars(md).items()):
        if isinstance(v, (bool, int, float, str)) or v is None:
            out[name] = v
        elif hasattr(v, "shape"):
            row = {"shape": list(v.shape), "dtype": str(v.dtype)}
            if name in ("seq_lens", "scheduler_metadata") or v.numel() <= 32:
                flat = v.flatten()
                row["values"] = flat[:40].tolist()
                if name == "seq_lens" and v.numel():
                    row["min"], row["max"] = int(flat.min()), int(flat.max())
            out[name] = row
        elif name == "plan":
            out[name] = {k: x for k, x in vars(v).items() if isinstance(x, (bool, int, float, str))} \
                if hasattr(v, "__dict__") else repr(v)[:200]
    return out


def _paged_isolation_variants(forward, impl, call, kw, res: dict) -> dict:
    """pagedattn's captured call with one argument swapped for what ``bench kernels`` builds:
    a new cache of the same shape (random values; and the engine's values copied, which tells
    the values from the allocation), a block table of each sequence's pages in order from block
    1, the plan the bench's graph provider makes. Whichever swap takes the in-engine time back to
    the bench's names the argument that costs it. Also records the table and the cache's address."""
    import dataclasses

    import torch

    from pagedattn.plan import plan_for_graphs

    layer, query, key, value, kv_cache, md = call[:6]
    rest = call[6:]
    lens = md.seq_lens.tolist()
    table = md.block_table
    res["block_table_rows"] = [table[i, :8].tolist() + ["..."] + table[i, max(0, -(-n // 16) - 4):-(-n // 16)].tolist()
                               for i, n in enumerate(lens[:4])]
    res["kv_cache_address"] = {"data_ptr_mod_2MiB": kv_cache.data_ptr() % 2**21,
                               "storage_bytes": kv_cache.untyped_storage().nbytes(),
                               "storage_offset": kv_cache.storage_offset()}
    try:
        fresh = torch.randn_like(kv_cache)
        copied = kv_cache.clone()  # the engine's values in a new allocation: values or placement
    except torch.OutOfMemoryError as e:  # vLLM holds most of the memory; the other swaps still run
        res["cache_swap_error"] = str(e)[:200]
        fresh = copied = None
    page = kv_cache.shape[2]
    width = table.shape[1]
    compact = torch.zeros_like(table)
    for i, n in enumerate(lens):
        pages = -(-n // page)
        compact[i, :pages] = 1 + i * pages + torch.arange(pages, device=table.device, dtype=table.dtype)
    context = -(-(max(lens) + 65) // 256) * 256
    plan = plan_for_graphs(max(64, len(lens)), 1, context, num_q_heads=query.shape[1], num_kv_heads=impl.num_kv_heads,
                           head_size=impl.head_size, device=query.device, sliding_window=impl.sliding_window,
                           dtype=query.dtype)
    plan.update(md.query_start_loc.cpu(), md.seq_lens.cpu())
    md_table, md_plan = dataclasses.replace(md, block_table=compact), dataclasses.replace(md, plan=plan)
    res["compact_table_fits"] = bool(int(compact.max()) < kv_cache.shape[0]) and width * page >= max(lens)
    variants = {"bench's plan": lambda: forward(impl, layer, query, key, value, kv_cache, md_plan, *rest, **kw)}
    fresh_q, fresh_out = torch.randn_like(query), torch.empty_like(call[6])
    variants["new q and out"] = lambda: forward(impl, layer, fresh_q, key, value, kv_cache, md, fresh_out, *call[7:], **kw)
    variants.update(_bench_call_variants(len(lens), max(lens), query, impl))
    if fresh is not None:
        variants["new cache"] = lambda: forward(impl, layer, query, key, value, fresh, md, *rest, **kw)
        variants["cache copied"] = lambda: forward(impl, layer, query, key, value, copied, md, *rest, **kw)
    if res["compact_table_fits"]:
        variants["pages in order"] = lambda: forward(impl, layer, query, key, value, kv_cache, md_table, *rest, **kw)
    return variants


def _bench_call_variants(batch: int, context: int, query, impl) -> dict:
    """``bench kernels``' own decode call (its inputs, shuffled cache, graph plan) at the engine's
    batch and context, in the engine's process: slow here and fast in the bench's own
    process means the process (its compiled kernels, its state), not the arguments. Also with
    PAGEDATTN_PDL=0 (a plan of its own, so a tape of its own)."""
    import torch

    from pagedattn.bench.providers import PagedAttnProvider
    from pagedattn.bench.workloads import _case, build_inputs
    from pagedattn.testing import environ_set

    shape = dict(num_q_heads=query.shape[1], num_kv_heads=impl.num_kv_heads, head_size=impl.head_size)
    case = _case(f"decode B={batch} L={context}", "llama3", "decode", [(batch, 1, context)], shape)
    try:
        inputs = build_inputs(case, query.device, query.dtype)
    except torch.OutOfMemoryError:  # vLLM holds most of the memory
        return {}
    provider = PagedAttnProvider("pagedattn-graph", path="graph")
    run = provider.prepare(inputs)
    with environ_set("PAGEDATTN_PDL", "0"):
        run_no_pdl = provider.prepare(inputs)

    def no_pdl():
        with environ_set("PAGEDATTN_PDL", "0"):
            run_no_pdl()

    return {"bench call, this process": run, "bench call, PAGEDATTN_PDL=0": no_pdl}


def kernel_builds(kernel) -> list[dict]:
    """Each compiled variant of a Triton kernel in this process: registers, spills, warps,
    stages, shared memory and a hash of its binary (two processes that time one call apart
    either run the same binary or not)."""
    import hashlib

    from pagedattn.bench.report import compiled_kernels

    rows = []
    for device, key, k in compiled_kernels(kernel):
        md = k.metadata
        rows.append({"device": str(device), "n_regs": getattr(k, "n_regs", None),
                     "n_spills": getattr(k, "n_spills", None), "num_warps": md.num_warps,
                     "num_stages": md.num_stages, "maxnreg": getattr(md, "maxnreg", None), "shared": md.shared,
                     "binary_sha1": hashlib.sha1(k.asm.get("cubin", b"")).hexdigest()[:12], "key": str(key)[:800]})
    return rows


def _clock_mhz():
    import torch

    try:
        return torch.cuda.clock_rate()
    except Exception:  # noqa: BLE001 - pynvml missing: no clock column
        return None


def replay_alone(recorder, tokens: int, reps: int, tmp: str, hidden: int, intermediate: int) -> dict:
    """Per-kernel µs a call of one layer's captured attention call, alone in several surroundings."""
    import torch

    if tokens not in recorder.calls:
        return {"error": f"no attention call of {tokens} tokens was recorded"}
    forward, impl, call, kw = recorder.calls[tokens]
    layer, query, key, value, kv_cache, md, output = call[:7]
    res = {"impl": type(impl).__name__, "metadata": describe(md),
           "kv_cache": {"shape": list(kv_cache.shape), "stride": list(kv_cache.stride())}}
    engine_call = lambda: forward(impl, *call, **kw)  # noqa: E731
    x = torch.randn(tokens, hidden, device=query.device, dtype=query.dtype)
    w = torch.randn(hidden, 2 * intermediate, device=query.device, dtype=query.dtype)
    y = torch.empty(tokens, 2 * intermediate, device=query.device, dtype=query.dtype)

    def after_gemm():
        torch.mm(x, w, out=y)
        engine_call()

    variants = {"engine call": engine_call, "after MLP-sized GEMM": after_gemm}
    if query.dim() == 3 and not query.is_contiguous():  # the engine's q is a view into the QKV projection
        dense = (call[0], query.contiguous()) + tuple(call[2:])
        variants["contiguous q"] = lambda: forward(impl, *dense, **kw)
    if type(impl).__name__ == "PagedAttnImpl" and getattr(md, "plan", None) is not None:
        variants.update(_paged_isolation_variants(forward, impl, call, kw, res))
    if type(impl).__name__ == "FlashAttentionImpl" and kv_cache.shape[0] == 2:
        from pagedattn.adapters import vllm_kernels

        n = md.num_actual_tokens
        run, note = vllm_kernels.fa3_call(query[:n], kv_cache[0], kv_cache[1], md.block_table, md.seq_lens,
                                          md.query_start_loc, out=output[:n], sliding_window=impl.sliding_window[0] + 1
                                          if impl.sliding_window and impl.sliding_window[0] >= 0 else None,
                                          scale=impl.scale)
        variants["bench fa3_call"] = run
        res["bench_fa3_note"] = note
    try:
        graph = torch.cuda.CUDAGraph()
        engine_call()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            engine_call()
        variants["engine call, graph replay"] = graph.replay
    except Exception as e:  # noqa: BLE001 - a variant that cannot be captured is reported, not fatal
        res["graph_error"] = f"{type(e).__name__}: {e}"[:300]
    res["variants"] = {}
    for name, fn in variants.items():
        for _ in range(3):
            fn()
        _, table = profiled(lambda: [fn() for _ in range(reps)], tmp, "replay")
        res["variants"][name] = {k: [round(v[0] / reps, 2), round(v[1] / reps, 2)]
                                 for k, v in sorted(table["kernels"].items(), key=lambda kv: -kv[1][0])}
        res["variants"][name]["(wall per call)"] = [round(table["wall_us"] / reps, 2), 1]
        res["variants"][name]["(SM clock MHz after)"] = [_clock_mhz(), 0]
    if type(impl).__name__ == "PagedAttnImpl":
        from pagedattn.ops.persistent.kernel import persistent_attention_kernel

        res["persistent_kernel_builds"] = kernel_builds(persistent_attention_kernel)
        res["triton_ptxas_path"] = os.environ.get("TRITON_PTXAS_PATH")  # inductor sets it to torch's ptxas
    return res


def run_child(own, e2e, args) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    backend = own.child
    res = {"backend": backend}
    _, cfg = e2e.model_config(args)
    text = e2e.text_config(cfg)
    vocab = text["vocab_size"]
    recorder = ForwardRecorder() if own.replay else None
    clock = HostClock() if own.prompts else None
    t0 = time.perf_counter()
    llm = LLM(**e2e.llm_kwargs(args, backend, own.model_dir))
    res["init_s"] = round(time.perf_counter() - t0, 1)
    res["gpu"] = torch.cuda.get_device_name(0)
    rng = random.Random(0)
    tmp = tempfile.mkdtemp(prefix="vllm_profile_")

    def prompts(n, length):
        return [TokensPrompt(prompt_token_ids=[rng.randrange(1000, vocab - 1000) for _ in range(length)])
                for _ in range(n)]

    def generate(ps, sps):
        return llm.generate(ps, sps, use_tqdm=False)

    def greedy(n):
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False)

    D = own.decode_steps
    res["decode"] = []
    for B, L in own.points:
        generate(prompts(B, L), greedy(1 + D))  # warm-up at this shape
        _, one = profiled(lambda: generate(prompts(B, L), greedy(1)), tmp, "one")
        _, many = profiled(lambda: generate(prompts(B, L), greedy(1 + D)), tmp, "many")
        diff = {k: [v[0] - one["kernels"].get(k, [0.0, 0])[0], v[1] - one["kernels"].get(k, [0.0, 0])[1]]
                for k, v in many["kernels"].items()}
        point = dict(batch=B, context=L, decode_steps=D,
                     busy_us_per_step=round((many["busy_us"] - one["busy_us"]) / D, 1),
                     wall_us_per_step_profiled=round((many["wall_us"] - one["wall_us"]) / D, 1))
        point.update(summarize(diff, 1.0 / D))
        if own.replay:
            try:
                point["replay"] = replay_alone(recorder, B, own.replay, tmp, text["hidden_size"],
                                               text["intermediate_size"])
            except Exception as e:  # noqa: BLE001 - keep the point's profile
                point["replay"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        res["decode"].append(point)
        print(f"{backend} {B}x{L}: attention {point['attention_us']} us of {point['kernel_us']} us a step",
              flush=True)

    res["prompts"] = []
    for L in own.prompts:
        n = own.prompt_requests
        for _ in range(2):  # warm-up at this length
            generate(prompts(1, L), greedy(1))
        batches = [prompts(1, L) for _ in range(2 * n)]  # built outside the timed part
        torch.cuda.synchronize()
        clock.on = True
        samples = []
        with GcClock() as gc_clock:
            for ps in batches[:n]:
                t = time.perf_counter()
                generate(ps, greedy(1))
                samples.append(time.perf_counter() - t)
        wall = sum(samples)
        clock.on = False
        _, prof = profiled(lambda: [generate(ps, greedy(1)) for ps in batches[n:]], tmp, "prompt")
        point = dict(prompt_len=L, requests=n, wall_us_per_request=round(wall * 1e6 / n, 1),
                     wall_us_per_request_profiled=round(prof["wall_us"] / n, 1),
                     wall_us_samples=[round(x * 1e6, 1) for x in samples],
                     gc_us_per_request=round(gc_clock.seconds * 1e6 / n, 1), gc_collections=gc_clock.collections,
                     busy_us_per_request=round(prof["busy_us"] / n, 1), host_us_per_request=clock.take(n),
                     cuda_api_per_request_profiled=_per_request(prof["api"], n),
                     gpu_idle_per_request_profiled=_per_request(prof["gaps"], n, most=40))
        point.update(summarize(prof["kernels"], 1.0 / n))
        res["prompts"].append(point)
        print(f"{backend} prompt {L}: wall {point['wall_us_per_request']} us, busy {point['busy_us_per_request']} us, "
              f"attention {point['attention_us']} us a request", flush=True)

    if own.traffic:
        def traffic(seed):
            r = random.Random(seed)
            ps, sps = [], []
            for _ in range(own.traffic):
                L, O = r.randint(64, 4096), r.randint(16, 512)
                ps.append(TokensPrompt(prompt_token_ids=[r.randrange(1000, vocab - 1000) for _ in range(L)]))
                sps.append(greedy(O))
            return ps, sps

        generate(*traffic(7))  # warm-up
        ps, sps = traffic(200)
        torch.cuda.synchronize()
        t = time.perf_counter()
        generate(ps, sps)
        wall = time.perf_counter() - t
        _, prof = profiled(lambda: generate(*traffic(200)), tmp, "traffic")
        tr = dict(requests=own.traffic, prompt_tokens=sum(len(p["prompt_token_ids"]) for p in ps),
                  output_tokens=sum(s.max_tokens for s in sps), wall_us=round(wall * 1e6),
                  wall_us_profiled=round(prof["wall_us"]), busy_us=round(prof["busy_us"]))
        tr.update(summarize(prof["kernels"], 1.0))
        tr["attention_share_of_busy"] = round(tr["attention_us"] / prof["busy_us"], 4)
        res["traffic"] = tr
        print(f"{backend} traffic: wall {wall:.2f} s, busy {prof['busy_us'] / 1e6:.2f} s, attention "
              f"{tr['attention_us'] / 1e6:.2f} s", flush=True)
    return res


def main():
    own, rest = parse_args()
    e2e = load_runner(own.runner)
    own.points = e2e.parse_grid(own.points)
    own.prompts = [int(x) for x in own.prompts.split(",") if x.strip()]
    args = runner_args(e2e, own, rest)
    if own.child:
        try:
            res = run_child(own, e2e, args)
            res["status"] = "ok"
        except BaseException as e:  # noqa: BLE001 - report, then fail
            import traceback

            traceback.print_exc()
            res = {"backend": own.child, "status": "error", "error": e2e.last_line(e)}
        with open(own.result_file, "w") as f:
            json.dump(res, f)
        sys.stdout.flush()
        os._exit(0)

    os.makedirs(args.out, exist_ok=True)
    name, cfg = e2e.model_config(args)
    tmp = tempfile.mkdtemp(prefix="vllm_profile_")
    model_dir = e2e.write_model_dir(tmp, name, cfg)
    plugin_dir = e2e.write_plugin_dir(tmp)
    meta = dict(model=name, points=own.points, prompts=own.prompts, decode_steps=own.decode_steps, traffic=own.traffic,
                max_model_len=e2e.max_model_len(args), max_num_batched_tokens=e2e.max_num_batched_tokens(args),
                project_commit=e2e.git_commit(e2e.project_root(args)), attention_kernels=ATTENTION.pattern)
    results = {}
    out_json = os.path.join(args.out, "vllm_profile.json")
    for backend in (b.strip() for b in own.backends.split(",") if b.strip()):
        result_file = os.path.join(tmp, f"profile_{backend}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", backend, "--result-file", result_file,
               "--model-dir", model_dir, "--runner", os.path.abspath(own.runner),
               "--decode-steps", str(own.decode_steps), "--traffic", str(own.traffic), "--replay", str(own.replay),
               "--prompts", ",".join(map(str, own.prompts)), "--prompt-requests", str(own.prompt_requests),
               "--points", ",".join(f"{b}x{l}" for b, l in own.points)] + rest
        log = os.path.join(args.out, f"vllm_profile_{backend}.log")
        t0 = time.perf_counter()
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, env=e2e.child_env(args, backend, plugin_dir), stdout=f,
                                    stderr=subprocess.STDOUT, timeout=own.per_backend_timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        try:
            with open(result_file) as f:
                results[backend] = json.load(f)
        except OSError:
            results[backend] = {"backend": backend, "status": "error", "error": f"no result (rc {rc}); see {log}"}
        results[backend]["seconds"] = round(time.perf_counter() - t0, 1)
        with open(out_json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        print(f"{backend}: {results[backend].get('status')} {results[backend].get('error', '')} "
              f"in {results[backend]['seconds']} s", flush=True)
    for backend, r in results.items():
        for point in r.get("decode", []):
            print(f"\n{backend} {point['batch']}x{point['context']}: us a decode step, launches a step "
                  f"(busy {point['busy_us_per_step']}, kernels {point['kernel_us']}, attention {point['attention_us']})")
            for k, (us, n) in list(point["kernels"].items())[:own.top]:
                print(f"  {us:9.1f} {n:6.1f}  {'A ' if is_attention(k) else '  '}{k[:90]}")
            replay = point.get("replay")
            if replay:
                print(f"  replayed alone ({replay.get('impl', replay.get('error'))}), us a call, launches a call:")
                for variant, rows in replay.get("variants", {}).items():
                    print(f"    {variant}:")
                    for k, (us, n) in list(rows.items())[:5]:
                        print(f"      {us if us is not None else '-':>9}  {n:5.2f}  {k[:80]}")
                for b in replay.get("persistent_kernel_builds", []):
                    print(f"    build: regs {b['n_regs']} spills {b['n_spills']} warps {b['num_warps']} stages "
                          f"{b['num_stages']} maxnreg {b['maxnreg']} shared {b['shared']} sha {b['binary_sha1']}")
        for point in r.get("prompts", []):
            print(f"\n{backend} one-token request, {point['prompt_len']}-token prompt: us a request (wall "
                  f"{point['wall_us_per_request']}, profiled {point['wall_us_per_request_profiled']}, busy "
                  f"{point['busy_us_per_request']}, kernels {point['kernel_us']}, attention {point['attention_us']})")
            for k, (us, n) in list(point["kernels"].items())[:own.top]:
                print(f"  {us:9.1f} {n:6.1f}  {'A ' if is_attention(k) else '  '}{k[:90]}")
            walls = sorted(point["wall_us_samples"])
            print(f"  unprofiled requests: wall min {walls[0]} median {walls[len(walls) // 2]} max {walls[-1]} us; "
                  f"garbage collector {point['gc_us_per_request']} us a request, collections {point['gc_collections']}")
            print("  host us a request, calls (unprofiled requests):")
            for k, (us, n) in point["host_us_per_request"].items():
                print(f"  {us:9.1f} {n:6.1f}  {k}")
            print("  CUDA runtime and driver calls, us a request, calls (profiled requests):")
            for k, (us, n) in list(point["cuda_api_per_request_profiled"].items())[:8]:
                print(f"  {us:9.1f} {n:6.1f}  {k[:80]}")
            print("  GPU idle between kernels, us a request, gaps (profiled requests; before -> after):")
            for k, (us, n) in list(point["gpu_idle_per_request_profiled"].items())[:8]:
                print(f"  {us:9.1f} {n:6.1f}  {k[:120]}")
        tr = r.get("traffic")
        if tr:
            print(f"\n{backend} traffic {tr['requests']} requests: wall {tr['wall_us'] / 1e6:.3f} s, busy "
                  f"{tr['busy_us'] / 1e6:.3f} s (profiled), attention {tr['attention_us'] / 1e6:.3f} s "
                  f"= {tr['attention_share_of_busy']:.1%} of busy")
            for k, (us, n) in list(tr["kernels"].items())[:own.top]:
                print(f"  {us / 1e3:9.1f} ms {n:7.0f}  {'A ' if is_attention(k) else '  '}{k[:90]}")


if __name__ == "__main__":
    main()
