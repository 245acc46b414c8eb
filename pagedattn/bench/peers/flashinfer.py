"""FlashInfer's paged wrappers (decode, prefill, MLA) on pagedattn's own cache tensors.

pagedattn's cache ``[num_blocks, block_size, num_kv_heads, head_size]`` is FlashInfer's "NHD"
paged layout; K and V go in as a tuple, so nothing is copied. The block table and KV lengths
become FlashInfer's page lists (``indptr`` / ``indices`` / ``last_page_len``) once per batch,
and each wrapper is planned once per batch, outside the timed call. Calls as engines make them:

* single-token decodes: ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores for GQA groups of
  4 and more, as vLLM and SGLang choose);
* prefills and extends: ``BatchPrefillWithPagedKVCacheWrapper`` (``backend="fa3"`` on sm90
  where FA3 has the head size, else FlashInfer's own choice), causal, bottom-right aligned;
* a mixed batch (``mode="engine"``): the decode wrapper on the decodes plus the prefill wrapper
  on the rest, the split vLLM's FlashInfer backend makes; ``mode="prefill"`` runs the whole
  batch through one prefill-wrapper call instead;
* MLA decode: ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` with the latent and rope parts
  as two views of pagedattn's ``[num_blocks, block_size, 576]`` latent cache.

FlashInfer compiles each kernel variant with nvcc on first use (tens of seconds to minutes);
the first ``prepare`` of a case pays it, never the timed call.
"""

from __future__ import annotations

import math

import torch

from pagedattn.bench.peers.common import (
    NotApplicable,
    gpu_status,
    jit_toolchain_status,
    module_status,
    paged_csr,
    sm_version,
    split_decodes,
    sub_query_start_loc,
    token_span,
    window_left,
)

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended float workspace (split-KV partials)
FA3_HEAD_SIZES = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)

_WORKSPACES: dict[tuple, torch.Tensor] = {}


def _workspace(device: torch.device) -> torch.Tensor:
    """One float workspace per device, shared by every wrapper.

    The wrappers of a run execute one after another on one stream, so their split-KV partials
    never overlap in time (vLLM shares one buffer across its wrappers the same way). FlashInfer
    asks for zeros on first use.
    """
    key = (device.type, device.index)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return ws


def availability() -> tuple[bool, str]:
    for status in (gpu_status, lambda: module_status("flashinfer"), jit_toolchain_status):
        ok, why = status()
        if not ok:
            return ok, why
    return True, ""


def version() -> str:
    import flashinfer

    return getattr(flashinfer, "__version__", "?")


def supports(case) -> tuple[bool, str]:
    p = case.params
    if p.get("sinks"):
        return False, "attention sinks are not wired for FlashInfer's fa2/fa3 paged kernels here"
    if p["num_q_heads"] % p["num_kv_heads"]:
        return False, "num_q_heads is not a multiple of num_kv_heads"
    if any(kv < 1 for kv in case.seq_lens):
        return False, "a sequence without keys has no FlashInfer page list"
    return True, ""


def prefill_backend(device: torch.device, head_size: int) -> str:
    """``fa3`` on sm90 (Hopper) where FA3 instantiates the head size; elsewhere FlashInfer's
    ``auto`` (fa2 before Hopper)."""
    if device.type == "cuda" and sm_version(device) == (9, 0) and head_size in FA3_HEAD_SIZES:
        return "fa3"
    return "auto"


def _check_dtypes(q: torch.Tensor, k_cache: torch.Tensor):
    if q.dtype not in DTYPES:
        raise NotApplicable(f"FlashInfer's paged kernels take fp16/bf16, not {q.dtype}")
    if k_cache.dtype != q.dtype:
        raise NotApplicable(f"cache dtype {k_cache.dtype} differs from q's {q.dtype} (no fp8 scales wired)")


def _score_options(features: dict, head_size: int) -> dict:
    if features.get("sinks") is not None:
        raise NotApplicable("attention sinks are not wired for FlashInfer here")
    softcap = features.get("softcap")
    return dict(
        sm_scale=1.0 / math.sqrt(head_size),
        window_left=window_left(features.get("sliding_window")),
        logits_soft_cap=float(softcap) if softcap else None,
    )


def plan_decode(csr, *, num_q_heads, num_kv_heads, head_size, block_size, dtype, device, options):
    """A planned decode wrapper for one batch of single-token queries."""
    import flashinfer

    use_tensor_cores = num_q_heads // num_kv_heads >= 4
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        _workspace(device), "NHD", use_tensor_cores=use_tensor_cores)
    wrapper.plan(
        csr.indptr, csr.indices.to(device), csr.last_page_len, num_q_heads, num_kv_heads, head_size,
        block_size, pos_encoding_mode="NONE", q_data_type=dtype, kv_data_type=dtype, **options,
    )
    backend = getattr(wrapper, "_backend", "?")
    return wrapper, f"decode wrapper ({backend}{', tensor cores' if use_tensor_cores else ''})"


def plan_prefill(qo_indptr: list[int], csr, *, num_q_heads, num_kv_heads, head_size, block_size, dtype,
                 device, causal, options):
    """A planned prefill wrapper (prefills, extends, or any batch) for one batch."""
    import flashinfer

    backend = prefill_backend(device, head_size)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(device), "NHD", backend=backend)
    wrapper.plan(
        torch.tensor(qo_indptr, dtype=torch.int32), csr.indptr, csr.indices.to(device), csr.last_page_len,
        num_q_heads, num_kv_heads, head_size, block_size, causal=causal, pos_encoding_mode="NONE",
        q_data_type=dtype, kv_data_type=dtype, **options,
    )
    return wrapper, f"prefill wrapper ({getattr(wrapper, '_backend', backend)})"


def prepare(inputs, mode: str = "engine"):
    """A :class:`~pagedattn.bench.providers.Prepared` call of FlashInfer on ``inputs``.

    ``mode="engine"``: decodes through the decode wrapper and the rest through the prefill
    wrapper (one call each when the batch has only one kind); ``mode="prefill"``: one
    prefill-wrapper call for the whole batch.
    """
    from pagedattn.bench.providers import Prepared

    if mode not in ("engine", "prefill"):
        raise ValueError(f"mode must be 'engine' or 'prefill', got {mode!r}")
    q, k_cache, v_cache = inputs.q, inputs.k_cache, inputs.v_cache
    _check_dtypes(q, k_cache)
    num_q_heads, head_size = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    device = q.device
    options = _score_options(inputs.features, head_size)
    causal = bool(inputs.features.get("causal", True))
    shape = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                 block_size=block_size, dtype=q.dtype, device=device, options=options)
    qsl = inputs.query_start_loc.tolist()
    table, lens = inputs.block_table.cpu(), inputs.seq_lens.cpu()
    kv = (k_cache, v_cache)
    out = torch.full_like(q, float("nan"))  # an unwritten row fails the check

    if mode == "prefill":
        wrapper, what = plan_prefill(qsl, paged_csr(table, lens, block_size), causal=causal, **shape)

        def run_one():
            wrapper.run(q, kv, out=out)
            return out

        return Prepared(run_one, note=f"one call: {what}")

    split = split_decodes(qsl)
    q_run, to_tokens, reorder_note = q, None, ""
    if split.reorder:
        # [decodes | rest], as an engine orders its batch once per step (outside the timing)
        order = torch.tensor(split.token_order, dtype=torch.int64, device=device)
        q_run = q.index_select(0, order)
        inverse = torch.argsort(order)
        to_tokens = lambda o: o.index_select(0, inverse)  # noqa: E731
        num_decode = len(split.decode)
        spans = {"decode": (0, num_decode), "rest": (num_decode, q.shape[0])}
        reorder_note = "; batch put in [decodes | rest] order once outside the timing"
    else:
        spans = {"decode": token_span(qsl, split.decode), "rest": token_span(qsl, split.rest)}

    calls, notes = [], []
    if split.decode:
        idx = torch.tensor(split.decode)
        wrapper, what = plan_decode(paged_csr(table[idx], lens[idx], block_size), **shape)
        a, b = spans["decode"]
        calls.append((wrapper, q_run[a:b], out[a:b]))
        notes.append(f"{len(split.decode)} decodes: {what}")
    if split.rest:
        idx = torch.tensor(split.rest)
        wrapper, what = plan_prefill(sub_query_start_loc(qsl, split.rest),
                                     paged_csr(table[idx], lens[idx], block_size), causal=causal, **shape)
        a, b = spans["rest"]
        calls.append((wrapper, q_run[a:b], out[a:b]))
        notes.append(f"{len(split.rest)} prefill/extend: {what}")

    if len(calls) == 1:
        (w0, q0, o0), = calls

        def run():
            w0.run(q0, kv, out=o0)
            return out
    else:
        (w0, q0, o0), (w1, q1, o1) = calls

        def run():
            w0.run(q0, kv, out=o0)
            w1.run(q1, kv, out=o1)
            return out

    prepared = Prepared(run, note="; ".join(notes) + reorder_note)
    if to_tokens is not None:
        prepared.to_tokens = to_tokens
    return prepared


# ---------------------------------------------------------------------------------------------
# MLA


def prepare_mla(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                query_start_loc: torch.Tensor, *, scale: float, latent_dim: int, out: torch.Tensor):
    """(zero-argument call, note): FlashInfer's MLA wrapper on pagedattn's latent cache.

    ``q`` is ``[num_tokens, num_heads, latent_dim + rope_dim]`` (absorbed query, then rope
    part); ``kv_cache`` is ``[num_blocks, block_size, latent_dim + rope_dim]``, passed as the
    two views FlashInfer's split layout takes: latent ``[..., :latent_dim]`` and rope
    ``[..., latent_dim:]`` (strided, no copy). The call writes ``out`` ``[num_tokens,
    num_heads, latent_dim]``. Queries of a sequence with more than one token are causal.
    """
    import flashinfer.mla as fmla

    if q.dtype not in DTYPES:
        raise NotApplicable(f"FlashInfer's MLA wrapper takes fp16/bf16 queries, not {q.dtype}")
    if kv_cache.dtype != q.dtype:
        raise NotApplicable(f"latent cache dtype {kv_cache.dtype} differs from q's {q.dtype} (fp8 scales not wired)")
    device = q.device
    num_heads, rope_dim = q.shape[1], q.shape[2] - latent_dim
    block_size = kv_cache.shape[1]
    if kv_cache.shape[2] != latent_dim + rope_dim or rope_dim < 1:
        raise ValueError(f"kv_cache rows of {kv_cache.shape[2]} do not match q's {q.shape[2]} = {latent_dim} + rope")
    csr = paged_csr(block_table, seq_lens, block_size)
    qsl = query_start_loc.tolist()
    causal = max(b - a for a, b in zip(qsl[:-1], qsl[1:])) > 1
    metadata = fmla.MLAPlanMetadata.csr(
        qo_indptr=query_start_loc.to(device=device, dtype=torch.int32),
        kv_indptr=csr.indptr.to(device), kv_indices=csr.indices.to(device), kv_len_arr=csr.seq_lens.to(device),
    )
    wrapper = fmla.BatchMLAPagedAttentionWrapper(_workspace(device), backend="auto")
    wrapper.plan(
        metadata=metadata, num_heads=num_heads, head_dim_ckv=latent_dim, head_dim_kpe=rope_dim,
        page_size=block_size, causal=causal, sm_scale=float(scale), q_data_type=q.dtype,
        kv_data_type=kv_cache.dtype, query_layout="split", kv_cache_layout="split",
    )
    query = (q[..., :latent_dim], q[..., latent_dim:])
    cache = (kv_cache[..., :latent_dim], kv_cache[..., latent_dim:])

    def run():
        return wrapper.run(query=query, kv_cache=cache, out=out)

    backend = getattr(wrapper, "_planned_backend_name", None) or getattr(wrapper, "_backend", "?")
    return run, f"MLA wrapper ({backend})"
