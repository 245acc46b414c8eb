"""pagedattn check: every kernel family and every feature against the float64 reference, here.

The first command to run on new hardware. Each row runs one public call on random inputs
(outputs poisoned with NaN first), compares it with pagedattn.reference computed in float64, and
is printed as soon as it finishes. On a GPU the rows use the Llama-3.1-8B attention shape (32 query
heads, 8 KV heads, head size 128) in bf16 with fp16 and fp32 rows beside; without one they run in
Triton's interpreter on small shapes in fp16 and fp32 (plus one bf16 row: the interpreter has no
bf16 matmul, so bf16 there must be computed right or refused).

The default covers every family (unified, split-KV, persistent and prefill paths of
paged_attention, the plan-less call, varlen_attention, merge_attention_states, write_kv,
mla_decode, write_mla_kv) and every feature at least once; --full runs the whole matrix
(every path x feature x batch x dtype, head sizes 8-256, page sizes).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

# Kernel families and the paths of paged_attention a row can name.
ATTENTION_PATHS = ("unified", "split_kv", "persistent", "prefill", "auto")

# Seconds one row takes in the interpreter, measured with these small shapes on 2 CPU cores
# (torch 2.13, triton 3.6; the default's 57 rows in 18.6 s), and a rough cost of one row on a GPU with a cold Triton cache, where
# compiling the row's kernel specialization dominates (about a second for an attention kernel;
# not measured for this list). Used only for the estimate printed before the run starts.
CPU_ROW_SECONDS = {
    "unified": 0.2, "split_kv": 0.65, "persistent": 0.2, "prefill": 0.35, "auto": 0.55, "varlen": 0.3,
    "merge": 0.1, "write_kv": 0.2, "mla": 0.4, "write_mla_kv": 0.1,
}
GPU_ROW_SECONDS = 1.0


@dataclass
class Spec:
    """One row of the check: which call, on which inputs."""

    family: str  # attention | varlen | merge | write_kv | mla | write_mla_kv
    path: str  # attention: one of ATTENTION_PATHS; else the function's short name
    feature: str  # a pagedattn.testing feature name, "+"-joined features, or a variant name
    batch: str  # a key of the device's batches
    dtype: object  # torch dtype of q (or of key/value, latents)
    cache_dtype: object = None  # fp8 cache when set
    shape: dict = field(default_factory=dict)  # overrides of the device's default heads / page size
    options: dict = field(default_factory=dict)  # num_splits, batch_invariant, update, refusal_ok

    @property
    def name(self) -> str:
        dtype = _dtype_name(self.dtype) + (f"/{_dtype_name(self.cache_dtype)}" if self.cache_dtype else "")
        return f"{self.path} {self.feature} {self.batch} {dtype}"

    @property
    def seconds(self) -> float:
        key = self.path if self.family == "attention" else self.family
        return CPU_ROW_SECONDS.get(key, 0.5)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.").replace("float8_e4m3fn", "fp8")


# ---------------------------------------------------------------------------------------------
# Shapes and batches per device


def _device_config(device: str) -> dict:
    """Heads, page size and batches ((query_len, seq_len) per sequence) for this device."""
    if device == "cuda":
        return dict(
            shape=dict(num_q_heads=32, num_kv_heads=8, head_size=128, block_size=16),
            odd_heads=(80, 24), mla=dict(num_heads=128, latent_dim=512, rope_dim=64),
            batches={
                "decode": [(1, 1), (1, 17), (1, 463), (1, 4099), (1, 1328), (1, 2048), (1, 77), (1, 9000)],
                "spec": [(6, 1330), (3, 40), (8, 4100), (1, 17), (4, 4)],
                "prefill": [(1, 1), (129, 129), (1000, 1000), (77, 77)],
                "mixed": [(1, 1328), (5, 18), (129, 463), (0, 7), (1, 1), (300, 2000), (8, 4096)],
                "long-mixed": [(1, 4096), (700, 700), (1, 1), (9, 300), (200, 2500), (1, 900)],
                "cross": [(9, 400), (300, 120), (1, 5), (64, 64)],
                "merge": [(6, 1330), (129, 463), (4, 0), (1, 4099), (0, 5)],
            },
            write_tokens=300, num_blocks=64,
        )
    return dict(
        shape=dict(num_q_heads=4, num_kv_heads=2, head_size=32, block_size=16),
        odd_heads=(80, 24), mla=dict(num_heads=8, latent_dim=32, rope_dim=16),
        batches={
            "decode": [(1, 1), (1, 17), (1, 129), (1, 40)],
            "spec": [(3, 40), (1, 17), (4, 4), (2, 70)],
            "prefill": [(1, 1), (33, 33), (20, 20)],
            "mixed": [(1, 129), (5, 18), (0, 7), (17, 40), (1, 1)],
            "long-mixed": [(130, 130), (1, 40), (3, 17)],
            "cross": [(9, 40), (30, 12), (1, 5)],
            "merge": [(3, 40), (2, 9), (4, 0), (1, 16), (0, 5)],
        },
        write_tokens=37, num_blocks=8,
    )


def default_specs(device: str) -> list[Spec]:
    """Every family and feature at least once, with few kernel specializations (a GPU compiles
    each distinct combination of dtype, head size and feature flags once)."""
    import torch

    fp8 = torch.float8_e4m3fn
    main = torch.bfloat16 if device == "cuda" else torch.float16
    other = [torch.float16, torch.float32] if device == "cuda" else [torch.float32]
    odd_a, odd_b = _device_config(device)["odd_heads"]
    specs = []

    def att(path, feature, batch, dtype=main, **kw):
        specs.append(Spec("attention", path, feature, batch, dtype, **kw))

    for f in ("causal", "noncausal", "window", "softcap", "alibi", "prefix"):
        att("unified", f, "mixed")
    att("unified", "fp8-kv", "mixed", cache_dtype=fp8)
    for dtype in other:
        att("unified", "causal", "mixed", dtype=dtype)
    if device != "cuda":  # bf16 on the interpreter: computed right or refused, never garbage
        att("unified", "causal", "decode", dtype=torch.bfloat16, options=dict(refusal_ok=True))
    att("unified", f"head{odd_b}", "mixed", shape=dict(head_size=odd_b))
    att("unified", "mqa", "decode", shape=dict(num_kv_heads=1))

    for f, batch in (("causal", "decode"), ("causal", "spec"), ("window_noncausal", "decode"),
                     ("alibi_sqrt", "decode"), ("sinks", "spec")):
        att("split_kv", f, batch, options=dict(num_splits=3))
    att("split_kv", "fp8-kv", "decode", cache_dtype=fp8, options=dict(num_splits=3))
    att("split_kv", f"head{odd_a}", "spec", shape=dict(head_size=odd_a), options=dict(num_splits=3))
    att("split_kv", "batch-invariant", "mixed", options=dict(batch_invariant=True))

    for f in ("causal", "softcap", "sinks", "prefix"):
        att("persistent", f, "mixed")
    att("persistent", "update", "mixed", options=dict(update=True))
    att("persistent", "fp8-kv", "decode", cache_dtype=fp8)

    for f in ("causal", "noncausal", "window", "alibi_sqrt", "sinks", "prefix"):
        att("prefill", f, "prefill")
    att("prefill", f"head{odd_a}", "mixed", shape=dict(head_size=odd_a))

    att("auto", "causal", "long-mixed")
    att("auto", "causal", "decode")

    # NaN read by a query: that row NaN (out and lse) on every path, nothing else touched
    nan = dict(poison=True)
    for path, batch in (("unified", "mixed"), ("split_kv", "decode"), ("persistent", "mixed"), ("prefill", "prefill"),
                        ("auto", "long-mixed")):
        att(path, "nan-input", batch, options=dict(nan, num_splits=3) if path == "split_kv" else nan)
    specs.append(Spec("varlen", "varlen", "nan-input", "prefill", main, options=nan))
    specs.append(Spec("merge", "merge", "nan-input", "merge", main, options=nan))
    specs.append(Spec("mla", "mla_decode", "nan-input", "decode", main, options=nan))

    for f, batch in (("causal", "prefill"), ("noncausal", "cross"), ("window+softcap", "prefill"),
                     ("alibi", "prefill"), ("sinks+prefix", "prefill")):
        specs.append(Spec("varlen", "varlen", f, batch, main))
    specs.append(Spec("varlen", "varlen", "head_v<head_qk", "prefill", main, options=dict(head_size_v=True)))

    for dtype in [main] + other[-1:]:
        specs.append(Spec("merge", "merge", "halves", "merge", dtype))
    specs.append(Spec("write_kv", "write_kv", "plain", "-", main))
    specs.append(Spec("write_kv", "write_kv", "fp8", "-", main, cache_dtype=fp8))
    specs.append(Spec("mla", "mla_decode", "decode", "decode", main))
    specs.append(Spec("mla", "mla_decode", "spec-splits", "spec", main, options=dict(num_splits=3)))
    specs.append(Spec("mla", "mla_decode", "fp8-kv", "decode", main, cache_dtype=fp8))
    specs.append(Spec("write_mla_kv", "write_mla_kv", "plain", "-", main))
    specs.append(Spec("write_mla_kv", "write_mla_kv", "fp8", "-", main, cache_dtype=fp8))
    return specs


def full_specs(device: str) -> list[Spec]:
    """The whole matrix: every path x feature x batch x dtype, fp8 per path, head and page sizes."""
    import torch

    from pagedattn.testing import FEATURES

    fp8 = torch.float8_e4m3fn
    dtypes = [torch.bfloat16, torch.float16, torch.float32] if device == "cuda" else [torch.float16, torch.float32]
    main = dtypes[0]
    batches = ("decode", "spec", "prefill", "mixed")
    specs = []
    for dtype in dtypes:
        for path in ATTENTION_PATHS:
            opts = dict(num_splits=3) if path == "split_kv" else {}
            for feature in FEATURES:
                for batch in batches:
                    specs.append(Spec("attention", path, feature, batch, dtype, options=opts))
            specs.append(Spec("attention", path, "fp8-kv", "mixed", dtype, cache_dtype=fp8, options=opts))
        specs.append(Spec("attention", "auto", "causal", "long-mixed", dtype))
        specs.append(Spec("attention", "split_kv", "batch-invariant", "mixed", dtype,
                          options=dict(batch_invariant=True)))
        specs.append(Spec("attention", "persistent", "update", "mixed", dtype, options=dict(update=True)))
        for feature in FEATURES:
            specs.append(Spec("varlen", "varlen", feature, "prefill", dtype))
        specs.append(Spec("varlen", "varlen", "noncausal", "cross", dtype))
        specs.append(Spec("varlen", "varlen", "head_v<head_qk", "prefill", dtype, options=dict(head_size_v=True)))
        specs.append(Spec("merge", "merge", "halves", "merge", dtype))
        for cache in (None, fp8):
            specs.append(Spec("write_kv", "write_kv", "fp8" if cache else "plain", "-", dtype, cache_dtype=cache))
            specs.append(Spec("write_mla_kv", "write_mla_kv", "fp8" if cache else "plain", "-", dtype,
                              cache_dtype=cache))
            specs.append(Spec("mla", "mla_decode", "fp8-kv" if cache else "decode", "decode", dtype, cache_dtype=cache))
        specs.append(Spec("mla", "mla_decode", "spec-splits", "spec", dtype, options=dict(num_splits=3)))
        nan = dict(poison=True)
        for path in ATTENTION_PATHS:
            for batch in ("decode", "mixed"):
                specs.append(Spec("attention", path, "nan-input", batch, dtype,
                                  options=dict(nan, num_splits=3) if path == "split_kv" else nan))
        specs.append(Spec("varlen", "varlen", "nan-input", "prefill", dtype, options=nan))
        specs.append(Spec("merge", "merge", "nan-input", "merge", dtype, options=nan))
        specs.append(Spec("mla", "mla_decode", "nan-input", "spec", dtype, options=nan))
    if device != "cuda":
        specs.append(Spec("attention", "unified", "causal", "decode", torch.bfloat16, options=dict(refusal_ok=True)))
    for head_size in (8, 24, 64, 80, 96, 112, 160, 192, 256):
        for path in ("unified", "split_kv", "persistent", "prefill"):
            opts = dict(num_splits=3) if path == "split_kv" else {}
            specs.append(Spec("attention", path, f"head{head_size}", "mixed", main, shape=dict(head_size=head_size),
                              options=opts))
        specs.append(Spec("varlen", "varlen", f"head{head_size}", "prefill", main, shape=dict(head_size=head_size)))
    for block_size in (1, 32, 64, 128):
        for path in ("unified", "split_kv", "persistent"):
            opts = dict(num_splits=3) if path == "split_kv" else {}
            specs.append(Spec("attention", path, f"page{block_size}", "mixed", main, shape=dict(block_size=block_size),
                              options=opts))
    for num_kv_heads in (1, 4):  # MQA and MHA beside the default GQA
        specs.append(Spec("attention", "unified", "mqa" if num_kv_heads == 1 else "mha", "mixed", main,
                          shape=dict(num_kv_heads=num_kv_heads * (8 if device == "cuda" and num_kv_heads > 1 else 1))))
    return specs


# ---------------------------------------------------------------------------------------------
# Running one row


def _features(name: str, num_q_heads: int, num_seqs: int, device, g) -> dict:
    """Keyword arguments of a feature name; ``a+b`` combines two features."""
    from pagedattn.testing import FEATURES, feature_kwargs

    kwargs = {}
    for part in name.split("+"):
        if part in FEATURES:
            kwargs.update(feature_kwargs(part, num_q_heads, num_seqs, device=device, generator=g))
    return kwargs


def _result(out, lse, ref_out, ref_lse) -> dict:
    from pagedattn.testing import TOLERANCES, max_errors, within_tolerance

    out_err, lse_err, _ = max_errors(out, lse, ref_out, ref_lse)
    return dict(out_err=out_err, lse_err=lse_err, atol=TOLERANCES[out.dtype][0],
                ok=within_tolerance(out, lse, ref_out, ref_lse))


def _poisoned_result(out, lse, ref_out, ref_lse) -> dict:
    """Rows the reference makes NaN (a NaN it reads) must be NaN in every element and in lse,
    no other row may be, and the other rows match the reference."""
    import torch

    from pagedattn.testing import TOLERANCES, max_errors, within_tolerance

    bad = torch.isnan(ref_lse).to(out.device)
    nan_out = torch.isnan(out)
    pattern = (bool(bad.any()) and torch.equal(torch.isnan(lse), bad) and torch.equal(nan_out.all(-1), bad)
               and torch.equal(nan_out.any(-1), bad))
    good = ~bad
    # the rows that read no NaN, as a [rows, 1, head_size] batch for the ordinary comparison
    got, got_lse = out[good][:, None], lse[good][:, None]
    want, want_lse = ref_out.to(out.device)[good][:, None], ref_lse.to(out.device)[good][:, None]
    out_err, lse_err, _ = max_errors(got, got_lse, want, want_lse)
    if pattern:
        note = f"{int(bad.sum())} (token, head) rows read a NaN: NaN out and lse, as the reference"
    else:
        got_bad = nan_out.any(-1) | torch.isnan(lse)
        note = (f"{int(bad.sum())} (token, head) rows read a NaN; NaN in {int((got_bad & good).sum())} rows that "
                f"read none, {int((bad & ~(nan_out.all(-1) & torch.isnan(lse))).sum())} rows that read one not "
                "NaN in every element and lse")
    return dict(out_err=out_err, lse_err=lse_err, atol=TOLERANCES[out.dtype][0],
                ok=pattern and within_tolerance(got, got_lse, want, want_lse), note=note)


def _poison_position(cases) -> tuple[int, int]:
    """(sequence, key position) to poison: inside the new tokens of the sequence with the most
    queries, so that its later queries read it and its earlier ones (causal) must not; in the
    middle of the longest context when every sequence decodes."""
    s = max(range(len(cases)), key=lambda i: (cases[i][0] if cases[i][0] > 1 else 0, cases[i][1]))
    q_len, kv_len = cases[s]
    return s, (kv_len - q_len + q_len // 2) if q_len > 1 else kv_len // 2


def _poison_paged(cache_pairs, block_table, cases, block_size: int, q) -> None:
    """NaN into a key (see _poison_position), into a value every query of that sequence reads,
    into one query, and into every cache block no sequence uses (which no call may read)."""
    import torch

    s, pos = _poison_position(cases)
    block, offset = int(block_table[s, pos // block_size]), pos % block_size
    k_cache, v_cache = cache_pairs
    k_cache[block, offset, ..., 3] = float("nan")
    if v_cache is not None:
        # the value NaN at the sequence's first key, which every one of its queries sees: a
        # non-finite value at a key hidden from a query of the same tile still reaches that
        # query (docs/contract.md, "NaN and inf")
        v_cache[int(block_table[s, 0]), 0, ..., 5] = float("nan")
    if q.shape[0]:
        q[0, q.shape[1] - 1, 0] = float("nan")
    used = set()
    for i, (_, kv) in enumerate(cases):
        used.update(int(b) for b in block_table[i, : -(-kv // block_size)].tolist())
    unused = torch.tensor(sorted(set(range(k_cache.shape[0])) - used), dtype=torch.long, device=k_cache.device)
    for cache in (k_cache, v_cache):
        if cache is not None and unused.numel():
            cache[unused] = float("nan")


def _nan_like(shape, dtype, device):
    import torch

    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _run_attention(spec: Spec, device: str, g) -> dict:
    import torch

    from pagedattn import paged_attention, plan_attention
    from pagedattn.reference import paged_attention_ref
    from pagedattn.testing import make_paged_batch

    cfg = _device_config(device)
    shape = dict(cfg["shape"], **spec.shape)
    cases = cfg["batches"][spec.batch]
    batch = make_paged_batch(cases, dtype=spec.dtype, cache_dtype=spec.cache_dtype, device=device, generator=g,
                             **shape)
    hq, hk, d = shape["num_q_heads"], shape["num_kv_heads"], shape["head_size"]
    kwargs = _features(spec.feature, hq, len(cases), device, g)
    if spec.cache_dtype is not None:
        kwargs.update(k_scale=0.7, v_scale=1.3)
    opts = spec.options
    if opts.get("poison"):
        _poison_paged((batch.k_cache, batch.v_cache), batch.block_table, cases, shape["block_size"], batch.q)
    heads = dict(num_q_heads=hq, num_kv_heads=hk, head_size=d, device=device, dtype=spec.dtype)
    qsl, lens = batch.query_start_loc.cpu(), batch.seq_lens.cpu()

    def make_plan(path, qsl, lens):
        if path == "auto":
            return None
        if opts.get("batch_invariant"):
            # short segments, so the small batches still split into several
            segment = 256 if device == "cuda" else 64
            return plan_attention(qsl, lens, batch_invariant=True, segment_size=segment, **heads)
        if path == "persistent" and opts.get("update"):
            # capacity for a larger batch, planned for another one first, then updated (CUDA graphs)
            n, t = len(lens), int(qsl[-1])
            plan = plan_attention([0, 1], [1], path="persistent", max_num_seqs=n + 4, max_num_tokens=t + 40,
                                  max_context_len=int(lens.max()) + 100, **heads)
            plan.update(qsl, lens)
            return plan
        return plan_attention(qsl, lens, path=path, num_splits=opts.get("num_splits"), **heads)

    def call(b, plan, qsl_b, lens_b):
        out = _nan_like(b.q.shape, b.q.dtype, device)
        lse = _nan_like(b.q.shape[:2], torch.float32, device)
        maxima = {}
        if plan is None:
            maxima = dict(max_query_len=max([ql for ql, _ in b.cases] + [0]), max_seq_len=b.max_seq_len)
        paged_attention(*b.args(), plan=plan, out=out, lse_out=lse, **maxima, **kwargs)
        return out, lse

    try:
        plan = make_plan(spec.path, qsl, lens)
        out, lse = call(batch, plan, qsl, lens)
    except (ValueError, TypeError) as e:
        if opts.get("refusal_ok"):
            return dict(out_err=None, lse_err=None, atol=None, ok=True,
                        note=f"refused before launch: {type(e).__name__}: {str(e)[:120]}")
        raise
    ref_out, ref_lse = paged_attention_ref(*batch.args(), compute_dtype=torch.float64, **kwargs)
    res = (_poisoned_result if opts.get("poison") else _result)(out, lse, ref_out, ref_lse)
    if opts.get("batch_invariant"):
        # each sequence alone must give bitwise the output it got inside the batch
        same = True
        for s, (ql, kv) in enumerate(cases):
            if ql == 0:
                continue
            q0 = int(batch.query_start_loc[s])
            one = dataclasses.replace(
                batch, cases=[(ql, kv)], q=batch.q[q0:q0 + ql].contiguous(), block_table=batch.block_table[s:s + 1],
                seq_lens=batch.seq_lens[s:s + 1],
                query_start_loc=torch.tensor([0, ql], dtype=torch.int32, device=device), max_seq_len=kv)
            alone, _ = call(one, make_plan("split_kv", one.query_start_loc.cpu(), one.seq_lens.cpu()), None, None)
            same = same and torch.equal(alone, out[q0:q0 + ql])
        res["ok"] = res["ok"] and same
        res["note"] = "each sequence alone: bitwise equal" if same else "a sequence alone differs from its batch output"
    return res


def _varlen_inputs(cases, hq, hk, d, dv, dtype, device, g):
    import torch

    q_lens = [q for q, _ in cases]
    k_lens = [k for _, k in cases]
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(k_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(device, dtype)
    k = torch.randn(sum(k_lens), hk, d, generator=g).to(device, dtype)
    v = torch.randn(sum(k_lens), hk, dv, generator=g).to(device, dtype)
    return q, k, v, cu_q.to(device), cu_k.to(device)


def _run_varlen(spec: Spec, device: str, g) -> dict:
    import torch

    from pagedattn import varlen_attention
    from pagedattn.reference import varlen_attention_ref

    cfg = _device_config(device)
    shape = dict(cfg["shape"], **spec.shape)
    cases = cfg["batches"][spec.batch]
    hq, hk, d = shape["num_q_heads"], shape["num_kv_heads"], shape["head_size"]
    dv = d // 2 if spec.options.get("head_size_v") else d  # MLA prefill: v narrower than q/k
    if spec.options.get("head_size_v"):
        d = d + d // 2
    q, k, v, cu_q, cu_k = _varlen_inputs(cases, hq, hk, d, dv, spec.dtype, device, g)
    kwargs = _features(spec.feature, hq, len(cases), device, g)
    poison = spec.options.get("poison")
    if poison:  # a key (see _poison_position), a value every query of that sequence reads, a query
        seq, pos = _poison_position(cases)
        key = int(cu_k[seq]) + pos
        k[key, 0, 3] = float("nan")
        v[int(cu_k[seq]), -1, 1] = float("nan")  # see _poison_paged
        q[0, -1, 0] = float("nan")
    out = _nan_like((q.shape[0], hq, dv), spec.dtype, device)
    lse = _nan_like((q.shape[0], hq), torch.float32, device)
    varlen_attention(q, k, v, cu_q, cu_k, max_query_len=max(ql for ql, _ in cases), out=out, lse_out=lse,
                     **kwargs)
    ref_out, ref_lse = varlen_attention_ref(q, k, v, cu_q, cu_k, compute_dtype=torch.float64, **kwargs)
    return (_poisoned_result if poison else _result)(out, lse, ref_out, ref_lse)


def _run_merge(spec: Spec, device: str, g) -> dict:
    """Attention over keys [0, 16) merged with attention over [16, kv) equals attention over all
    keys; a sequence of at most 16 keys gives a side with lse -inf, one with no keys both sides."""
    import torch

    from pagedattn import merge_attention_states
    from pagedattn.reference import varlen_attention_ref

    cfg = _device_config(device)
    hq, hk, d = (cfg["shape"][k] for k in ("num_q_heads", "num_kv_heads", "head_size"))
    cases = cfg["batches"][spec.batch]
    split = 16
    q, k, v, cu_q, cu_k = _varlen_inputs(cases, hq, hk, d, d, torch.float64, device, g)
    poison = spec.options.get("poison")
    if poison:  # a NaN key in the first half of sequence 0, one in the second half of sequence 1
        k[2, 0, 3] = float("nan")
        k[int(cu_k[1]) + split + 1, -1, 0] = float("nan")
    kw = dict(causal=False, compute_dtype=torch.float64)
    ks = cu_k.tolist()
    first = [(min(b - a, split)) for a, b in zip(ks[:-1], ks[1:])]
    idx_a = torch.cat([torch.arange(a, a + n) for a, n in zip(ks[:-1], first)]).to(device)
    idx_b = torch.cat([torch.arange(a + n, b) for a, b, n in zip(ks[:-1], ks[1:], first)]).to(device)
    cu_a = torch.tensor([0] + torch.tensor(first).cumsum(0).tolist(), dtype=torch.int32, device=device)
    cu_b = cu_k - cu_a
    # the reference sees each side as its own non-causal sequence; an empty side has lse -inf
    out_a, lse_a = varlen_attention_ref(q, k[idx_a], v[idx_a], cu_q, cu_a, **kw)
    out_b, lse_b = varlen_attention_ref(q, k[idx_b], v[idx_b], cu_q, cu_b, **kw)
    ref_out, ref_lse = varlen_attention_ref(q, k, v, cu_q, cu_k, **kw)
    out = _nan_like(out_a.shape, spec.dtype, device)
    lse = _nan_like(lse_a.shape, torch.float32, device)
    merge_attention_states(out_a.to(spec.dtype), lse_a.float(), out_b.to(spec.dtype), lse_b.float(), out=out,
                           lse_out=lse)
    return (_poisoned_result if poison else _result)(out, lse, ref_out, ref_lse)


def _bitwise_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def _cache_err(got, ref) -> float:
    return float((got.double() - ref.double()).abs().max().item())


def _run_write_kv(spec: Spec, device: str, g) -> dict:
    import torch

    from pagedattn import write_kv
    from pagedattn.reference import write_kv_ref

    cfg = _device_config(device)
    h, d, bs = (cfg["shape"][k] for k in ("num_kv_heads", "head_size", "block_size"))
    n, blocks = cfg["write_tokens"], cfg["num_blocks"]
    key = torch.randn(n, h, d, generator=g).to(device, spec.dtype)
    value = torch.randn(n, h, d, generator=g).to(device, spec.dtype)
    cache_dtype = spec.cache_dtype or spec.dtype
    k_cache = torch.randn(blocks, bs, h, d, generator=g).to(device, cache_dtype)
    v_cache = torch.randn(blocks, bs, h, d, generator=g).to(device, cache_dtype)
    slots = torch.randperm(blocks * bs, generator=g)[:n].to(device)
    slots[5] = -1  # padding: skipped
    scales = dict(k_scale=0.5, v_scale=2.0) if spec.cache_dtype is not None else {}
    ref_k, ref_v = write_kv_ref(key, value, k_cache, v_cache, slots, **scales)
    write_kv(key, value, k_cache, v_cache, slots, **scales)
    ok = _bitwise_equal(k_cache, ref_k) and _bitwise_equal(v_cache, ref_v)
    return dict(out_err=max(_cache_err(k_cache, ref_k), _cache_err(v_cache, ref_v)), lse_err=None, atol=0.0, ok=ok,
                note="bitwise against the reference")


def _mla_batch(spec: Spec, device: str, g):
    from pagedattn.testing import make_paged_batch

    cfg = _device_config(device)
    m = cfg["mla"]
    cases = cfg["batches"][spec.batch]
    b = make_paged_batch(cases, num_q_heads=m["num_heads"], num_kv_heads=1, head_size=m["latent_dim"] + m["rope_dim"],
                         block_size=cfg["shape"]["block_size"], dtype=spec.dtype, cache_dtype=spec.cache_dtype,
                         device=device, generator=g)
    q_nope, q_pe = b.q[..., :m["latent_dim"]], b.q[..., m["latent_dim"]:]
    kv_cache = b.k_cache[:, :, 0].contiguous()
    scale = 1.0 / math.sqrt(m["latent_dim"] // 4 + m["rope_dim"])  # DeepSeek: (128 + 64) ** -0.5 at 512 + 64
    return (q_nope, q_pe, kv_cache, b.block_table, b.seq_lens, b.query_start_loc), scale, b


def _run_mla(spec: Spec, device: str, g) -> dict:
    import torch

    from pagedattn import mla_decode
    from pagedattn.reference import mla_decode_ref

    args, scale, b = _mla_batch(spec, device, g)
    kv_scale = 0.8 if spec.cache_dtype is not None else None
    poison = spec.options.get("poison")
    if poison:
        _poison_paged((args[2], None), b.block_table, b.cases, args[2].shape[1], args[0])
    out = _nan_like(args[0].shape, spec.dtype, device)
    got, lse = mla_decode(*args, scale=scale, kv_scale=kv_scale, max_query_len=b.max_query_len,
                          max_seq_len=b.max_seq_len, num_splits=spec.options.get("num_splits"), out=out,
                          return_lse=True)
    ref_out, ref_lse = mla_decode_ref(*args, scale=scale, kv_scale=kv_scale, compute_dtype=torch.float64)
    return (_poisoned_result if poison else _result)(got, lse, ref_out, ref_lse)


def _run_write_mla_kv(spec: Spec, device: str, g) -> dict:
    import torch

    from pagedattn import write_mla_kv
    from pagedattn.reference import write_mla_kv_ref

    cfg = _device_config(device)
    m, bs = cfg["mla"], cfg["shape"]["block_size"]
    n, blocks = cfg["write_tokens"], cfg["num_blocks"]
    c_kv = torch.randn(n, m["latent_dim"], generator=g).to(device, spec.dtype)
    k_pe = torch.randn(n, m["rope_dim"], generator=g).to(device, spec.dtype)
    cache = torch.randn(blocks, bs, m["latent_dim"] + m["rope_dim"], generator=g).to(device,
                                                                                     spec.cache_dtype or spec.dtype)
    slots = torch.randperm(blocks * bs, generator=g)[:n].to(device)
    slots[3] = -1
    kv_scale = 0.5 if spec.cache_dtype is not None else None
    ref = write_mla_kv_ref(c_kv, k_pe, cache, slots, kv_scale=kv_scale)
    write_mla_kv(c_kv, k_pe, cache, slots, kv_scale=kv_scale)
    return dict(out_err=_cache_err(cache, ref), lse_err=None, atol=0.0, ok=_bitwise_equal(cache, ref),
                note="bitwise against the reference")


RUNNERS: dict[str, Callable] = {
    "attention": _run_attention, "varlen": _run_varlen, "merge": _run_merge, "write_kv": _run_write_kv,
    "mla": _run_mla, "write_mla_kv": _run_write_mla_kv,
}


def run_spec(spec: Spec, device: str, seed: int = 0) -> dict:
    """Run one row; an exception becomes a failed row with its message (the run goes on)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    row = dict(family=spec.family, path=spec.path, feature=spec.feature, batch=spec.batch,
               dtype=_dtype_name(spec.dtype), cache_dtype=_dtype_name(spec.cache_dtype) if spec.cache_dtype else None,
               name=spec.name)
    start = time.perf_counter()
    try:
        row.update(RUNNERS[spec.family](spec, device, g))
        if device == "cuda":
            torch.cuda.synchronize()
        row["status"] = "PASS" if row["ok"] else "FAIL"
    except Exception as e:  # noqa: BLE001 - reported as a failed row, the check goes on
        row.update(ok=False, status="ERROR", out_err=None, lse_err=None, atol=None,
                   note=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        if os.environ.get("PAGEDATTN_CHECK_DEBUG"):
            import traceback

            traceback.print_exc()
    row["seconds"] = round(time.perf_counter() - start, 3)
    return row


# ---------------------------------------------------------------------------------------------
# Output


HEADER = (f"{'#':>4} {'path':<12} {'feature':<17} {'batch':<10} {'dtype':<16} "
          f"{'max|out err|':>12} {'max|lse err|':>12} {'atol':>7}  result   time")


def _num(x, spec: str) -> str:
    width = int(spec.split(".")[0])
    return f"{'-':>{width}}" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_row(i: int, total: int, row: dict, elapsed: float) -> str:
    dtype = row["dtype"] + (f"/{row['cache_dtype']}" if row.get("cache_dtype") else "")
    text = (f"{i:>4} {row['path']:<12} {row['feature']:<17} {row['batch']:<10} {dtype:<16} "
            f"{_num(row['out_err'], '12.2e')} {_num(row['lse_err'], '12.2e')} {_num(row['atol'], '7.0e')}  "
            f"{row['status']:<6} {row['seconds']:5.1f} s  [{i}/{total}, {elapsed:.0f} s]")
    if row.get("note") and (row["status"] != "PASS" or "refused" in row["note"]):
        text += f"\n       {row['note']}"
    return text


def _where(device: str) -> str:
    import torch
    import triton

    if device == "cuda":
        what = f"{torch.cuda.get_device_name()} (GPU), Llama-3.1-8B attention shape"
    else:
        what = "CPU, Triton's interpreter (small shapes)"
    return f"{what}; torch {torch.__version__}, triton {triton.__version__}"


def _cpu_load() -> tuple[int, float]:
    """(CPU cores this process may use, runnable processes per core over the last minute)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    return cores, load / cores


def estimate_seconds(specs: list[Spec], device: str) -> float:
    """Expected duration on an otherwise idle machine (the sum of the per-row costs)."""
    if device == "cuda":
        return GPU_ROW_SECONDS * len(specs)
    return sum(s.seconds for s in specs)


def run_check(device: str | None = None, *, full: bool = False, only: list[str] | None = None,
              quiet: bool = False, stream=None, seed: int = 0, specs: list[Spec] | None = None) -> list[dict]:
    """Run the check's rows, printing each as it finishes (unless quiet); returns one dict per row.

    ``only``: keep rows whose name contains any of these texts (e.g. ``["mla", "varlen"]``).
    """
    from pagedattn.terminal import Progress

    device = device or select_device()
    stream = stream or sys.stdout
    if specs is None:
        specs = full_specs(device) if full else default_specs(device)
    if only:
        specs = [s for s in specs if any(text in s.name or text == s.family for text in only)]
    if not quiet:
        est = estimate_seconds(specs, device)
        if device == "cuda":
            how = "most of it compiling kernels; a second run reuses Triton's cache"
        else:
            cores, per_core = _cpu_load()
            how = f"{cores} idle CPU cores" + (
                f"; longer now: the load is {per_core:.1f} per core" if per_core > 1 else "")
        print(f"pagedattn check on {_where(device)}", file=stream)
        print(f"{len(specs)} checks against the float64 reference; about {_duration(est)} ({how})", file=stream,
              flush=True)
        print(HEADER, file=stream)
        print("-" * len(HEADER), file=stream, flush=True)
    progress = None if quiet else Progress(total=len(specs), weights=[s.seconds for s in specs], stream=stream)
    rows = []
    with warnings.catch_warnings():
        # the interpreter evaluates masked-off lanes too (log(0), inf - inf): numpy's warnings
        # about them are noise, the results are checked against the reference
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
        warnings.filterwarnings("ignore", message="Conversion of an array with ndim > 0", category=DeprecationWarning)
        _run_rows(specs, device, seed, progress, rows)
    return rows


def _run_rows(specs, device, seed, progress, rows) -> None:
    try:
        for i, spec in enumerate(specs, 1):
            if progress:
                progress.start(spec.name)
            row = run_spec(spec, device, seed=seed + i)
            rows.append(row)
            if progress:
                progress.done(format_row(i, len(specs), row, progress.elapsed))
    finally:
        if progress:
            progress.close()


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(5, round(seconds / 5) * 5):.0f} s"
    return f"{seconds / 60:.0f} min"


def select_device(requested: str | None = None) -> str:
    """The device to check: the requested one, else CUDA when present, else the CPU interpreter.

    Raises SystemExit with a message (not a traceback) when the request cannot be met. Sets
    TRITON_INTERPRET=1 for the CPU, which must happen before the kernels are first imported.
    """
    import torch

    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if requested == "cuda":
        if not torch.cuda.is_available():
            built = f"CUDA {torch.version.cuda}" if torch.version.cuda else (
                f"ROCm {torch.version.hip}" if torch.version.hip else "CPU only")
            raise SystemExit(f"pagedattn check: --device cuda, but no CUDA device is available "
                             f"(torch {torch.__version__}, built for {built}). Run without --device to check "
                             f"on the CPU with Triton's interpreter.")
        if interpret:
            raise SystemExit("pagedattn check: --device cuda, but TRITON_INTERPRET=1 is set (the kernels would "
                             "run in the interpreter); unset it.")
        return "cuda"
    if requested is None and torch.cuda.is_available() and not interpret:
        return "cuda"
    if not interpret and any(m.startswith("pagedattn.ops") for m in sys.modules):
        raise SystemExit("pagedattn check: the kernels were imported before TRITON_INTERPRET=1 could be set; "
                         "run `TRITON_INTERPRET=1 pagedattn check --device cpu`.")
    os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedattn check",
        description="Check every kernel family and feature against the float64 reference on this machine. "
                    "Rows are printed as they finish; the exit code is 1 when any row fails.",
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="cuda (a GPU) or cpu (Triton's interpreter); default: cuda when available")
    p.add_argument("--full", action="store_true",
                   help="the whole matrix: every path x feature x batch x dtype, head sizes 8-256 and page sizes "
                        "(several minutes)")
    p.add_argument("--only", action="append", metavar="TEXT",
                   help="keep rows whose name (path feature batch dtype) contains TEXT, or whose family is TEXT; "
                        "repeatable")
    p.add_argument("--json", metavar="PATH", help="also write the rows and the machine to this JSON file")
    p.add_argument("--list", action="store_true", help="list the rows and exit")
    p.add_argument("--seed", type=int, default=0, help="random inputs' seed (default 0)")
    p.add_argument("--compile", action="store_true",
                   help="compile every kernel variant the planner can launch for NVIDIA and AMD targets, without "
                        "running anything, and print registers, spills and shared memory per target "
                        "(with --full: every variant; --only filters variants)")
    p.add_argument("--targets", default=None, metavar="LIST",
                   help="--compile: comma-separated targets (default: sm80,sm90,sm100,sm120,gfx942,gfx950,gfx1100)")
    p.add_argument("--jobs", type=int, default=None, help="--compile: worker processes (default: the CPUs, at most 8)")
    p.add_argument("--dump", metavar="DIR", default=None,
                   help="--compile: write each kernel's TTGIR, PTX, SASS or AMDGCN under DIR/<target>/")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.compile:
        from pagedattn import compile_matrix

        if args.targets is None:
            args.targets = ",".join(compile_matrix.TARGETS)
        return compile_matrix.main(args)
    if args.targets is not None or args.jobs is not None or args.dump is not None:
        print("pagedattn check: --targets, --jobs and --dump go with --compile", file=sys.stderr)
        return 2
    try:
        device = select_device(args.device)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    if args.list:
        specs = full_specs(device) if args.full else default_specs(device)
        for s in specs:
            if not args.only or any(t in s.name or t == s.family for t in args.only):
                print(f"{s.family:<13} {s.name}")
        return 0
    start = time.perf_counter()
    rows = run_check(device, full=args.full, only=args.only, seed=args.seed)
    seconds = time.perf_counter() - start
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed in {seconds:.1f} s")
    for r in failed:
        print(f"  {r['status']}: {r['name']}" + (f" ({r['note']})" if r.get("note") else ""))
    if args.json:
        from pagedattn.bench.report import machine_info, write_json

        import torch

        dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        path = write_json(dict(machine=machine_info(dev), config=dict(full=args.full, only=args.only, seed=args.seed),
                               seconds=round(seconds, 1), passed=len(rows) - len(failed), failed=len(failed),
                               rows=rows), args.json)
        print(f"results: {path}")
    if not rows:
        print("no rows matched", file=sys.stderr)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
