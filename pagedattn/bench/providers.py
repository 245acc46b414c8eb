"""Providers: the attention implementations the suite checks and times, in one registry.

A provider answers ``available() -> (bool, reason)`` and ``supports(case) -> (bool, reason)``,
and ``prepare(inputs)`` returns a :class:`Prepared` whose call runs one attention call on
prepared inputs (allocation and layout changes happen in ``prepare``, outside the timing).
pagedattn is imported inside ``prepare`` only, so the CLI can still set ``TRITON_INTERPRET``.

The peers (FlashInfer's paged wrappers, cuDNN's paged SDPA graph, vLLM's AOT-compiled
FlashAttention-3) read the same paged tensors; what their APIs take is in
:mod:`pagedattn.adapters` (each imports its package only when asked), and the providers here
only turn a case's inputs into those calls.
``python -m pagedattn.bench.selftest`` runs each of them once on small cases on a GPU, against
the float64 reference, and prints one line per provider and case.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch

from pagedattn.adapters import cudnn, flashinfer, sdpa, vllm_kernels
from pagedattn.adapters.common import NotApplicable
from pagedattn.bench.workloads import Case, CaseInputs


def _identity(x):
    return x


def _unroute(out: torch.Tensor, *, inv: torch.Tensor) -> torch.Tensor:
    """Rows of an output computed in a reordered batch, back in the caller's token order."""
    return out.index_select(0, inv)


@dataclass
class Prepared:
    """A zero-argument call plus how to turn its result into ``[num_tokens, num_q_heads, head_size]``."""

    run: Callable[[], Any]
    to_tokens: Callable[[Any], torch.Tensor] = _identity
    note: str = ""

    def __call__(self):
        return self.run()


@dataclass
class Provider:
    name: str
    anchor: bool = False  # a reference implementation: counts toward a case's "best anchor"
    description: str = ""
    by_default: bool = True  # timed when no --provider is given

    def available(self) -> tuple[bool, str]:
        return True, ""

    def supports(self, case: Case) -> tuple[bool, str]:
        return True, ""

    def prepare(self, inputs: CaseInputs) -> Prepared:
        raise NotImplementedError


def _has_gpu() -> bool:
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"


# ---------------------------------------------------------------------------------------------
# pagedattn


@dataclass
class PagedAttnProvider(Provider):
    """``paged_attention`` with a plan built once from host metadata (outside the timed call).

    ``path`` is the plan's path: "auto" (the planner's rule), "unified", "split_kv", "persistent"
    or "prefill"; or "graph", decodes only: the persistent plan that vLLM's builder makes for its
    CUDA graphs (``plan_for_graphs``), sized as ``run_vllm_e2e.py``'s grid sizes it (largest
    capture size max(64, B), max_model_len the context plus 65 tokens rounded up to 256), then
    ``update()``-d with the batch, as each graph step is.
    """

    path: str = "auto"
    gluon: str | None = None  # PAGEDATTN_PREFILL_GLUON's value while the call runs (a Gluon variant: sm9x only)

    def available(self):
        if importlib.util.find_spec("triton") is None:
            return False, "triton is not installed"
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
            return False, "no GPU and TRITON_INTERPRET is not 1"
        if self.gluon not in (None, "0"):
            from pagedattn.ops.common.gluon import unavailable_reason
            from pagedattn.ops.prefill_gluon.launch import gluon_kernel

            reason = unavailable_reason(gluon_kernel())
            if reason is None and not (_has_gpu() and torch.cuda.get_device_capability()[0] == 9):
                reason = "the Gluon prefill kernel runs on compute capability 9.x only"
            if reason is not None:
                return False, reason
        return True, ""

    def supports(self, case):
        if self.path == "graph" and any(q != 1 for q in case.query_lens):
            return False, "the graph plan serves decode steps (one query token a sequence)"
        return True, ""

    def prepare(self, inputs):
        from pagedattn.api import paged_attention
        from pagedattn.plan import plan_attention, plan_for_graphs

        args = inputs.paged_args()
        q, k_cache = inputs.q, inputs.k_cache
        shape = dict(num_q_heads=q.shape[1], num_kv_heads=k_cache.shape[2], head_size=q.shape[2], device=q.device,
                     sliding_window=inputs.features.get("sliding_window"), dtype=q.dtype)
        qsl, lens = inputs.query_start_loc.cpu(), inputs.seq_lens.cpu()
        if self.path == "graph":
            context = -(-(int(lens.max()) + 65) // 256) * 256
            plan = plan_for_graphs(max(64, len(lens)), 1, context, **shape)
            plan.update(qsl, lens)
        else:
            plan = plan_attention(qsl, lens, path=self.path, **shape)
        kwargs = dict(inputs.paged_kwargs(), plan=plan)
        out = torch.empty_like(q)
        if self.gluon is None:
            return Prepared(lambda: paged_attention(*args, out=out, **kwargs))
        from pagedattn.ops.prefill_gluon.launch import GLUON_PREFILL_ENV
        from pagedattn.testing import environ_set

        def run():
            with environ_set(GLUON_PREFILL_ENV, self.gluon):
                return paged_attention(*args, out=out, **kwargs)

        return Prepared(run)


# ---------------------------------------------------------------------------------------------
# torch SDPA over contiguous K/V (anchors)


def _groups_to_tokens(outs: list[torch.Tensor]) -> torch.Tensor:
    """[count, heads, query_len, head_size] per group -> [num_tokens, heads, head_size]."""
    return torch.cat([o.transpose(1, 2).flatten(0, 1) for o in outs])


@dataclass
class SdpaProvider(Provider):
    """``F.scaled_dot_product_attention`` pinned to one backend, one batched call per segment.

    Decode segments run without a mask; prefill segments (query_len == seq_len) with
    ``is_causal=True``. Extend (1 < query_len < seq_len) needs a lower-right causal mask that
    SDPA's ``is_causal`` (top-left) does not give, so it is not supported.
    """

    backend: str = "FLASH_ATTENTION"  # a torch.nn.attention.SDPBackend member name

    def available(self):
        if not _has_gpu():
            return False, "needs a CUDA GPU"
        return sdpa.kernel_status(self.backend)

    def supports(self, case):
        feats = case.features
        if feats:
            return False, f"SDPA has no {', '.join(sorted(feats))}"
        for _, q, kv in case.segments:
            if 1 < q < kv:
                return False, "extend needs lower-right causal; SDPA is_causal is top-left"
        return True, ""

    def prepare(self, inputs):
        groups = inputs.contiguous()
        calls = [(g.q, g.k, g.v, g.query_len > 1) for g in groups]
        kernels = [self.backend]

        def run_with(calls, gqa):
            return [sdpa.call(q, k, v, kernels=kernels, is_causal=causal, enable_gqa=gqa) for q, k, v, causal in calls]

        note = ""
        try:
            run_with(calls, True)
            gqa = True
        except RuntimeError as e:  # backend without GQA: repeat KV heads (reads more bytes)
            rep = inputs.q.shape[1] // inputs.k_cache.shape[2]
            calls = [(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), c) for q, k, v, c in calls]
            gqa = False
            note = f"KV heads repeated x{rep} (enable_gqa failed: {str(e).splitlines()[0][:120]})"
        return Prepared(lambda: run_with(calls, gqa), _groups_to_tokens, note)


# ---------------------------------------------------------------------------------------------
# FlexAttention (compiled), anchor


_FLEX_COMPILED = None


def _flex_compiled():
    global _FLEX_COMPILED
    if _FLEX_COMPILED is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        # One compile per shape: raise the recompile limit so no case falls back to eager flex
        # (which materializes the score matrix).
        for attr in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, attr):
                setattr(torch._dynamo.config, attr, max(getattr(torch._dynamo.config, attr), 256))
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    return _FLEX_COMPILED


def flex_segment_call(g, *, window, softcap, sinks, device, flex_fn):
    """A zero-argument flex call for one segment, in bottom-right causal alignment.

    Sinks join the softmax denominator: ``out * sigmoid(lse - sink)``.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    offset = g.seq_len - g.query_len  # absolute position of query 0

    def mask_mod(b, h, q_idx, kv_idx):
        visible = kv_idx <= q_idx + offset
        if window:
            visible = visible & (kv_idx > q_idx + offset - window)
        return visible

    block_mask = None
    if g.query_len > 1 or window:
        block_mask = create_block_mask(mask_mod, None, None, g.query_len, g.seq_len, device=device)
    def softcap_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    kwargs = dict(block_mask=block_mask, score_mod=softcap_mod if softcap else None, enable_gqa=True)
    if sinks is None:
        return lambda: flex_fn(g.q, g.k, g.v, **kwargs)
    sink = sinks.view(1, -1, 1, 1)
    try:
        from torch.nn.attention.flex_attention import AuxRequest

        def flex_with_lse():
            out, aux = flex_fn(g.q, g.k, g.v, return_aux=AuxRequest(lse=True), **kwargs)
            return out, aux.lse
    except ImportError:  # torch < 2.9

        def flex_with_lse():
            return flex_fn(g.q, g.k, g.v, return_lse=True, **kwargs)

    def run():
        out, lse = flex_with_lse()
        return out * torch.sigmoid(lse.unsqueeze(-1) - sink).to(out.dtype)

    return run


@dataclass
class FlexProvider(Provider):
    """``torch.nn.attention.flex_attention`` under ``torch.compile``, one call per segment."""

    def available(self):
        if not _has_gpu():
            return False, "needs a CUDA GPU (compiled flex)"
        try:
            importlib.import_module("torch.nn.attention.flex_attention")
        except ImportError as e:
            return False, f"flex_attention missing: {e}"
        return True, ""

    def prepare(self, inputs):
        flex_fn = _flex_compiled()
        f = inputs.features
        calls = [
            flex_segment_call(g, window=f.get("sliding_window"), softcap=f.get("softcap"),
                              sinks=f.get("sinks"), device=inputs.q.device, flex_fn=flex_fn)
            for g in inputs.contiguous()
        ]
        return Prepared(lambda: [c() for c in calls], _groups_to_tokens)


# ---------------------------------------------------------------------------------------------
# Peers on the same paged tensors: FlashInfer's wrappers, cuDNN's paged SDPA graph and vLLM's
# FlashAttention-3 (pagedattn.adapters; no package is imported until a provider is asked)


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a module already in sys.modules without a spec
        return name in sys.modules


HAS_FLASHINFER = _installed("flashinfer")
HAS_CUDNN_FRONTEND = _installed("cudnn")


@dataclass
class FlashInferProvider(Provider):
    """FlashInfer's paged wrappers, planned once per batch outside the timed call.

    ``mode="engine"``: single-token decodes through ``BatchDecodeWithPagedKVCacheWrapper`` and
    the rest through ``BatchPrefillWithPagedKVCacheWrapper`` (two calls for a mixed batch, as
    vLLM's FlashInfer backend makes them; a batch whose decodes and rest interleave is put in
    [decodes | rest] order once, outside the timing); ``mode="prefill"``: the whole batch in
    one prefill-wrapper call. Prefills use FA3 on sm90 where it has the head size.
    """

    mode: str = "engine"

    def available(self):
        return flashinfer.availability()

    def supports(self, case):
        p = case.params
        if p.get("sinks"):
            return False, "attention sinks are not wired for FlashInfer's fa2/fa3 paged kernels here"
        if p["num_q_heads"] % p["num_kv_heads"]:
            return False, "num_q_heads is not a multiple of num_kv_heads"
        if any(kv < 1 for kv in case.seq_lens):
            return False, "a sequence without keys has no FlashInfer page list"
        return True, ""

    def prepare(self, inputs):
        if self.mode not in ("engine", "prefill"):
            raise ValueError(f"mode must be 'engine' or 'prefill', got {self.mode!r}")
        q, k_cache, v_cache = inputs.q, inputs.k_cache, inputs.v_cache
        flashinfer.check_dtypes(q.dtype, k_cache.dtype)
        f = inputs.features
        if f.get("sinks") is not None:
            raise NotApplicable("attention sinks are not wired for FlashInfer here")
        block_size, device = k_cache.shape[1], q.device
        options = dict(num_q_heads=q.shape[1], num_kv_heads=k_cache.shape[2], head_size=q.shape[2],
                       block_size=block_size, dtype=q.dtype, scale=1.0 / math.sqrt(q.shape[2]),
                       sliding_window=f.get("sliding_window"), softcap=f.get("softcap"))
        causal = bool(f.get("causal", True))
        ws = flashinfer.workspace(device)
        qsl = inputs.query_start_loc.tolist()
        table, lens = inputs.block_table.cpu(), inputs.seq_lens.cpu()

        def prefill(seqs):
            wrapper = flashinfer.prefill_wrapper(ws, flashinfer.prefill_backend(device, q.shape[2]))
            flashinfer.plan_prefill(wrapper, flashinfer.sub_query_start_loc(qsl, seqs),
                                    flashinfer.paged_csr(table[seqs], lens[seqs], block_size), causal=causal,
                                    **options)
            return wrapper, f"prefill wrapper ({flashinfer.backend_name(wrapper)})"

        kv = (k_cache, v_cache)
        out = torch.full_like(q, float("nan"))  # an unwritten row fails the check
        if self.mode == "prefill":
            wrapper, what = prefill(list(range(len(qsl) - 1)))

            def run_one():
                wrapper.run(q, kv, out=out)
                return out

            return Prepared(run_one, note=f"one call: {what}")

        split = flashinfer.split_decodes(qsl)
        q_run, to_tokens, reorder_note = q, _identity, ""
        if split.reorder:
            # [decodes | rest], as an engine orders its batch once per step (outside the timing)
            order = torch.tensor(split.token_order, dtype=torch.int64, device=device)
            q_run = q.index_select(0, order)
            to_tokens = partial(_unroute, inv=torch.argsort(order))
            num_decode = len(split.decode)
            spans = {"decode": (0, num_decode), "rest": (num_decode, q.shape[0])}
            reorder_note = "; batch put in [decodes | rest] order once outside the timing"
        else:
            spans = {"decode": flashinfer.token_span(qsl, split.decode),
                     "rest": flashinfer.token_span(qsl, split.rest)}
        calls, notes = [], []
        if split.decode:
            wrapper = flashinfer.decode_wrapper(ws, tensor_cores=flashinfer.use_tensor_cores(q.shape[1],
                                                                                           k_cache.shape[2]))
            flashinfer.plan_decode(wrapper, flashinfer.paged_csr(table[split.decode], lens[split.decode], block_size),
                                   **options)
            calls.append((wrapper, *spans["decode"]))
            cores = ", tensor cores" if flashinfer.use_tensor_cores(q.shape[1], k_cache.shape[2]) else ""
            notes.append(f"{len(split.decode)} decodes: decode wrapper ({flashinfer.backend_name(wrapper)}{cores})")
        if split.rest:
            wrapper, what = prefill(split.rest)
            calls.append((wrapper, *spans["rest"]))
            notes.append(f"{len(split.rest)} prefill/extend: {what}")
        calls = [(w, q_run[a:b], out[a:b]) for w, a, b in calls]

        def run():
            for w, q_part, o_part in calls:
                w.run(q_part, kv, out=o_part)
            return out

        return Prepared(run, to_tokens, "; ".join(notes) + reorder_note)


@dataclass
class CudnnPagedProvider(Provider):
    """cuDNN's SDPA graph with page tables (cudnn-frontend), one call per batch; ragged Q/O
    offsets for a batch with different query lengths. Graphs are built once per shape."""

    def available(self):
        return cudnn.availability()

    def supports(self, case):
        p = case.params
        return cudnn.supports(case.features, p["num_q_heads"], p["num_kv_heads"])

    def prepare(self, inputs):
        features = {k: v for k, v in inputs.features.items() if k != "causal"}
        out = torch.full_like(inputs.q, float("nan"))  # an unwritten row fails the check
        run, note = cudnn.paged_call(inputs.q, inputs.k_cache, inputs.v_cache, inputs.block_table, inputs.seq_lens,
                                     inputs.query_start_loc, out=out, causal=inputs.features.get("causal", True),
                                     features=features)
        return Prepared(run, note=note)


class _VllmPagedProvider(Provider):
    """One of vLLM's kernels over the paged cache (``kernel_call``, from
    :mod:`pagedattn.adapters.vllm_kernels`), one call per batch as vLLM's backend makes it per
    layer; what vLLM's metadata builder makes once per step and the host maxima are made in
    ``prepare``, outside the timed call."""

    @staticmethod
    def kernel_call(*args, **kwargs):
        raise NotImplementedError

    def prepare(self, inputs):
        q, f = inputs.q, inputs.features
        out = torch.full_like(q, float("nan"))  # an unwritten row fails the check
        run, note = self.kernel_call(
            q, inputs.k_cache, inputs.v_cache, inputs.block_table, inputs.seq_lens, inputs.query_start_loc, out=out,
            causal=bool(f.get("causal", True)), sliding_window=f.get("sliding_window"), softcap=f.get("softcap"),
            sinks=f.get("sinks"), scale=1.0 / math.sqrt(q.shape[2]), max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
        )
        return Prepared(run, note=note)


@dataclass
class VllmFa3Provider(_VllmPagedProvider):
    """vLLM's FlashAttention-3 (``vllm.vllm_flash_attn``, compiled into vLLM's wheel for sm90):
    ``flash_attn_varlen_func(..., fa_version=3)`` as vLLM's FLASH_ATTN backend calls it, with
    the scheduler metadata its builder computes once per step and the sinks as bf16."""

    kernel_call = staticmethod(vllm_kernels.fa3_call)

    def available(self):
        return vllm_kernels.fa3_availability()

    def supports(self, case):
        p = case.params
        return vllm_kernels.fa3_supports(case.features, num_q_heads=p["num_q_heads"], num_kv_heads=p["num_kv_heads"],
                                         head_size=p["head_size"], block_size=p["block_size"])


@dataclass
class VllmTritonProvider(_VllmPagedProvider):
    """vLLM's Triton unified-attention kernel (``unified_attention``, the kernel of vLLM's
    TRITON_ATTN backend), with the segment buffers its builder allocates once."""

    kernel_call = staticmethod(vllm_kernels.triton_unified_call)

    def available(self):
        return vllm_kernels.triton_unified_availability()

    def supports(self, case):
        extra = sorted(set(case.features) - set(vllm_kernels.TRITON_FEATURES))
        if extra:
            return False, f"the vllm-triton call here wires no {', '.join(extra)}"
        return True, ""


def host_time_us(prepared: Prepared, calls: int = 50) -> float:
    """Host time of one prepared call: ``calls`` back-to-back calls without synchronizing,
    wall time / ``calls`` (one warm-up call first)."""
    from pagedattn.bench.timing import host_time_us as _host_time_us

    return _host_time_us(prepared.run, calls)


# The kept Gluon prefill variants (PAGEDATTN_PREFILL_GLUON values) timed as their own columns
GLUON_VARIANT_COLUMNS = {
    "split": "P V after each softmax",
    "pipelined": "one consumer partition",
    "serial": "serial loop",
    "smemq": "Q read from shared memory by each wgmma",
    "lagged": "copies signalled a tile late, ring of 4",
    "stages4": "ring of 4 tiles",
    "tma": "K and V copied by TMA",
    "tma128-earlyk-1w": "128-key tiles by TMA, K released after its scores, a one-warp producer",
    "tma128-threads": "tma128-earlyk-1w, slots released by every consumer thread",
    "pairs": "mask-free key tiles in pairs",
    "pairs-smemq": "tiles in pairs, Q from shared memory",
}


# ---------------------------------------------------------------------------------------------
# Registry (name -> provider), in report column order.

PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in [
        PagedAttnProvider("pagedattn", description="paged_attention, automatic path"),
        PagedAttnProvider("pagedattn-2d", path="unified", description="unified 2D kernel (forced)"),
        PagedAttnProvider("pagedattn-split", path="split_kv", description="split-KV path (forced)"),
        PagedAttnProvider("pagedattn-persistent", path="persistent", description="persistent path (forced)"),
        PagedAttnProvider("pagedattn-prefill", path="prefill", description="large-tile prefill kernel (forced)"),
        PagedAttnProvider("pagedattn-graph", path="graph", by_default=False,
                          description="decodes: the persistent plan vLLM's builder makes for CUDA graphs, updated"),
        PagedAttnProvider("pagedattn-tl", gluon="0", by_default=False,
                          description="automatic path, portable tl kernels only (no Gluon on sm90)"),
        PagedAttnProvider("pagedattn-gluon", gluon="1", by_default=False,
                          description="automatic path, every prefill launch on the Gluon sm90 kernel (its default config)"),
        *(PagedAttnProvider(f"pagedattn-gluon-{variant}", gluon=variant, by_default=False,
                            description=f"automatic path, Gluon sm90 prefill kernel, {what}")
          for variant, what in GLUON_VARIANT_COLUMNS.items()),
        SdpaProvider("sdpa-cudnn", anchor=True, backend="CUDNN_ATTENTION",
                     description="torch SDPA, cuDNN backend, contiguous KV"),
        SdpaProvider("sdpa-flash", anchor=True, backend="FLASH_ATTENTION",
                     description="torch SDPA, FlashAttention-2 backend, contiguous KV"),
        FlexProvider("flex", anchor=True, description="FlexAttention, torch.compile, contiguous KV"),
        FlashInferProvider("flashinfer", anchor=True,
                           description="FlashInfer paged wrappers: decode wrapper on decodes + prefill wrapper "
                                       "on the rest (as vLLM calls them)"),
        FlashInferProvider("flashinfer-prefill", anchor=True, mode="prefill",
                           description="FlashInfer paged prefill wrapper, whole batch in one call"),
        CudnnPagedProvider("cudnn-paged", anchor=True,
                           description="cuDNN SDPA graph over the paged cache (page tables), one call"),
        VllmFa3Provider("vllm-fa3", anchor=True,
                        description="vLLM's FlashAttention-3 (vllm_flash_attn, paged KV, AOT-compiled)"),
        VllmTritonProvider("vllm-triton", anchor=True,
                           description="vLLM's Triton unified-attention kernel (TRITON_ATTN's, paged KV)"),
    ]
}

