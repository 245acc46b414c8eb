"""pagedattn as vLLM's MLA backend (``CUSTOM`` for a model with latent attention), tested against
the real classes of the vLLM installed: ``.ci/run`` runs this file with vLLM 0.26.0 and 0.33.0.

vLLM's MLA metadata builder, its chunked-context planning, its metadata classes and its backend
selection are the real ones; the ``VllmConfig`` and the MLA layer handed to the builder are
stand-ins carrying the attributes it reads (vLLM cannot build a config without a GPU), and
``test_config_stand_in_matches_vllm`` checks that vLLM's classes have every one of them.
Outputs are compared with the float64 references of :mod:`pagedattn.reference`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import types

import pytest
import torch

from tests.vllm_support import require_vllm

require_vllm()

from vllm.config import CUDAGraphMode  # noqa: E402
from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import MLAAttentionSpec  # noqa: E402

import pagedattn.integrations.vllm as pa_vllm  # noqa: E402
from pagedattn.integrations.vllm.backend import PagedAttnBackend, worker_block_table_width  # noqa: E402
from pagedattn.integrations.vllm.mla import (  # noqa: E402
    PagedAttnMLABackend,
    PagedAttnMLADecodeMetadata,
    PagedAttnMLAImpl,
    PagedAttnMLAMetadataBuilder,
    PagedAttnMLAPrefill,
)
from pagedattn.reference import mla_decode_ref, varlen_attention_ref, write_mla_kv_ref  # noqa: E402
from pagedattn.testing import assert_matches_reference  # noqa: E402
from tests.vllm_support import assert_stand_in_matches, override_mismatches, paged_layout  # noqa: E402

DEVICE = torch.device("cpu")
# 256 + 64 = 320: the smaller latent row vLLM's MLA metadata accepts (DeepSeek's is 512 + 64)
HEADS, LATENT, ROPE, NOPE, V_DIM = 4, 256, 64, 32, 32
SCALE = (NOPE + ROPE) ** -0.5
BLOCK = 16


def make_config(*, cudagraph_mode=CUDAGraphMode.NONE, capture_sizes=(), dtype=torch.float16, max_model_len=512,
                cache_dtype="auto", speculative_tokens=None, num_gpu_blocks=None):
    model_config = types.SimpleNamespace(
        dtype=dtype, max_model_len=max_model_len, use_mla=True,
        get_num_attention_heads=lambda parallel_config: HEADS, get_head_size=lambda: LATENT + ROPE,
        hf_text_config=types.SimpleNamespace(q_lora_rank=None, kv_lora_rank=LATENT, qk_nope_head_dim=NOPE,
                                             qk_rope_head_dim=ROPE, v_head_dim=V_DIM))
    compilation = types.SimpleNamespace(cudagraph_mode=cudagraph_mode, cudagraph_capture_sizes=list(capture_sizes),
                                        static_forward_context={})
    parallel = types.SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1,
                                     cp_kv_cache_interleave_size=1)
    spec = None if speculative_tokens is None else types.SimpleNamespace(
        num_speculative_tokens=speculative_tokens, parallel_drafting=False)
    return types.SimpleNamespace(
        model_config=model_config, compilation_config=compilation, parallel_config=parallel,
        scheduler_config=types.SimpleNamespace(max_num_seqs=16, max_num_batched_tokens=256),
        cache_config=types.SimpleNamespace(cache_dtype=cache_dtype, block_size=BLOCK, num_gpu_blocks=num_gpu_blocks),
        attention_config=types.SimpleNamespace(mla_prefill_backend=None, use_prefill_query_quantization=False),
        speculative_config=spec, kv_transfer_config=None)


def test_config_stand_in_matches_vllm():
    from vllm.config import (AttentionConfig, CacheConfig, CompilationConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig)

    stand_in = make_config()
    assert_stand_in_matches(stand_in, {
        ModelConfig: stand_in.model_config, CompilationConfig: stand_in.compilation_config,
        ParallelConfig: stand_in.parallel_config, SchedulerConfig: stand_in.scheduler_config,
        CacheConfig: stand_in.cache_config, AttentionConfig: stand_in.attention_config})


def make_layer(config, k_scale=1.0):
    """The MLA layer's fields the builder and impl read."""
    prefill = PagedAttnMLAPrefill(num_heads=HEADS, scale=SCALE, kv_lora_rank=LATENT, qk_nope_head_dim=NOPE,
                                  qk_rope_head_dim=ROPE, v_head_dim=V_DIM, vllm_config=config)
    layer = types.SimpleNamespace(q_lora_rank=None, kv_lora_rank=LATENT, qk_nope_head_dim=NOPE,
                                  qk_rope_head_dim=ROPE, v_head_dim=V_DIM, prefill_backend=prefill,
                                  _k_scale=torch.tensor(k_scale))
    config.compilation_config.static_forward_context["layer.0"] = layer
    return layer


def make_impl(config, kv_cache_dtype="auto"):
    import vllm.config.vllm as config_module  # the impl reads the config vLLM has made current

    saved = config_module._current_vllm_config
    config_module._current_vllm_config = config
    try:
        return PagedAttnMLAImpl(
            HEADS, LATENT + ROPE, SCALE, 1, None, None, kv_cache_dtype, None, "decoder", None,
            q_lora_rank=None, kv_lora_rank=LATENT, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
            qk_head_dim=NOPE + ROPE, v_head_dim=V_DIM, kv_b_proj=None)
    finally:
        config_module._current_vllm_config = saved


@pytest.fixture(autouse=True)
def _no_pinned_memory(monkeypatch):
    """vLLM's MLA builder stages host lengths in pinned memory (0.26 asks for it unconditionally);
    on a machine without an accelerator torch has no pinned allocator, so the request is dropped."""
    for name in ("empty", "zeros", "tensor"):
        make = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *args, pin_memory=False, _make=make, **kwargs: _make(*args, **kwargs))


def make_builder(config):
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=LATENT + ROPE, dtype=config.model_config.dtype)
    make_layer(config)
    return PagedAttnMLAMetadataBuilder(spec, ["layer.0"], config, DEVICE)


class Batch:
    """Requests ``(query_len, seq_len)`` with a random paged latent cache and vLLM's metadata."""

    def __init__(self, cases, *, num_blocks=64, dtype=torch.float16, g, cache_dtype=None):
        self.cases = cases
        self.block_table, self.qsl, slots = paged_layout(cases, BLOCK, num_blocks, g)
        self.seq_lens = torch.tensor([kv for _, kv in cases], dtype=torch.int32)
        self.num_tokens = int(self.qsl[-1])
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64)
        self.cache = torch.randn(num_blocks, BLOCK, LATENT + ROPE, generator=g).to(cache_dtype or dtype)
        self.common = CommonAttentionMetadata(
            query_start_loc=self.qsl, query_start_loc_cpu=self.qsl, seq_lens=self.seq_lens, num_reqs=len(cases),
            num_actual_tokens=self.num_tokens, max_query_len=max(q for q, _ in cases),
            max_seq_len=int(self.seq_lens.max()), block_table_tensor=self.block_table,
            slot_mapping=self.slot_mapping, seq_lens_cpu_upper_bound=self.seq_lens.clone())


# ---------------------------------------------------------------------------------------------
# selection

def test_custom_resolves_to_the_mla_backend_for_an_mla_model(monkeypatch):
    import vllm.config.vllm as config_module

    pa_vllm.register()
    custom = AttentionBackendEnum.CUSTOM
    assert custom.get_path() == pa_vllm.BACKEND_CLASS_PATH
    config = make_config()
    monkeypatch.setattr(config_module, "_current_vllm_config", config, raising=False)
    if hasattr(config_module, "get_current_vllm_config_or_none"):
        monkeypatch.setattr(config_module, "get_current_vllm_config_or_none", lambda: config)
    assert custom.get_class() is PagedAttnMLABackend
    config.model_config.use_mla = False
    assert custom.get_class() is PagedAttnBackend


def test_backend_classes_resolve_from_the_names_vllm_makes_of_them():
    """vLLM's platform names a backend class f"{__module__}.{__qualname__}" and imports it again
    from that name: pagedattn's classes, and the broken ones of the GPU logprob check, must
    come back as themselves."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from tests.vllm_logprobs import _broken_backends

    for cls in (PagedAttnBackend, PagedAttnMLABackend, PagedAttnMLAImpl, PagedAttnMLAMetadataBuilder,
                *_broken_backends()):
        module, qualname = cls.full_cls_name() if hasattr(cls, "full_cls_name") else (cls.__module__,
                                                                                      cls.__qualname__)
        assert resolve_obj_by_qualname(f"{module}.{qualname}") is cls, (module, qualname)


@pytest.mark.parametrize("block_size", [16, 64])
def test_mla_backend_passes_vllms_selection(block_size):
    common = dict(dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=block_size, has_sink=False,
                  use_sparse=False, device_capability=DeviceCapability(9, 0))
    assert PagedAttnMLABackend.validate_configuration(head_size=576, use_mla=True, **_selector_extras(), **common) == []
    assert PagedAttnMLABackend.validate_configuration(head_size=576, use_mla=False, **_selector_extras(), **common)
    assert PagedAttnMLABackend.validate_configuration(head_size=512, use_mla=True, **_selector_extras(), **common)
    assert PagedAttnBackend.validate_configuration(head_size=576, use_mla=True, **_selector_extras(), **common)
    assert PagedAttnMLABackend.get_name() == "CUSTOM"
    assert PagedAttnMLABackend.is_mla()


def _selector_extras() -> dict:
    """The keywords vLLM's validate_configuration takes beyond the common ones (they vary by release)."""
    import inspect

    from vllm.v1.attention.backend import AttentionBackend

    params = inspect.signature(AttentionBackend.validate_configuration).parameters
    extras = dict(use_mm_prefix=False, use_per_head_quant_scales=False, attn_type="decoder",
                  has_sliding_window=False, use_non_causal=False, use_batch_invariant=False, use_kv_connector=False,
                  use_pcp=False)
    return {k: v for k, v in extras.items() if k in params}


def test_impl_refuses_what_the_kernels_lack():
    config = make_config()
    with pytest.raises(NotImplementedError, match="sliding_window"):
        PagedAttnMLAImpl(HEADS, LATENT + ROPE, SCALE, 1, None, 128, "auto", None, "decoder", None,
                         q_lora_rank=None, kv_lora_rank=LATENT, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                         qk_head_dim=NOPE + ROPE, v_head_dim=V_DIM, kv_b_proj=None)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_impl(config, kv_cache_dtype="fp8_e5m2")


def test_builder_refuses_more_than_eight_speculative_tokens():
    config = make_config(speculative_tokens=8)  # 9 query tokens a decode step
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_builder(config)


# ---------------------------------------------------------------------------------------------
# decode, the cache write

@pytest.mark.parametrize("graphs", [False, True])
def test_decode_matches_reference(graphs):
    g = torch.Generator().manual_seed(3)
    mode = CUDAGraphMode.FULL_AND_PIECEWISE if graphs else CUDAGraphMode.NONE
    config = make_config(cudagraph_mode=mode, capture_sizes=(1, 2, 4, 8, 16), speculative_tokens=2)
    builder = make_builder(config)
    assert builder.get_cudagraph_support(config, None) == AttentionCGSupport.UNIFORM_BATCH
    batch = Batch([(1, 37), (3, 80), (2, 5), (1, 129)], g=g)
    md = builder.build(0, batch.common)
    assert md.num_decodes == 4 and md.num_prefills == 0 and md.prefill is None
    decode = md.decode
    assert isinstance(decode, PagedAttnMLADecodeMetadata)
    assert decode.max_query_len == 3
    assert decode.max_seq_len == (config.model_config.max_model_len if graphs else 256)

    impl = make_impl(config)
    q_nope = torch.randn(batch.num_tokens, HEADS, LATENT, generator=g).half()
    q_pe = torch.randn(batch.num_tokens, HEADS, ROPE, generator=g).half()
    layer = config.compilation_config.static_forward_context["layer.0"]
    out, lse = impl.forward_mqa((q_nope, q_pe), batch.cache, md, layer)
    assert lse is None  # only decode context parallelism combines ranks by lse
    ref, _ = mla_decode_ref(q_nope, q_pe, batch.cache, batch.block_table, batch.seq_lens, batch.qsl, scale=SCALE)
    assert_matches_reference(out, None, ref, None)
    out_cat, _ = impl.forward_mqa(torch.cat([q_nope, q_pe], dim=-1), batch.cache, md, layer)
    assert_matches_reference(out_cat, None, ref, None)


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_cache_write_matches_reference(cache_dtype):
    g = torch.Generator().manual_seed(5)
    config = make_config(cache_dtype=cache_dtype)
    impl = make_impl(config, kv_cache_dtype=cache_dtype)
    fp8 = cache_dtype == "fp8"
    cache = torch.zeros(8, BLOCK, LATENT + ROPE, dtype=torch.uint8 if fp8 else torch.float16)
    n = 5
    c_kv = torch.randn(n + 2, LATENT, generator=g).half()  # two padding rows past the slots
    k_pe = torch.randn(n + 2, 1, ROPE, generator=g).half()
    slots = torch.tensor([3, 17, -1, 40, 127], dtype=torch.int64)
    scale = torch.tensor(0.5)
    view = cache.view(torch.float8_e4m3fn) if fp8 else cache
    expected = write_mla_kv_ref(c_kv[:n], k_pe[:n, 0], view.clone(), slots, kv_scale=0.5 if fp8 else None)
    impl.do_kv_cache_update(c_kv, k_pe, cache, slots, cache_dtype, scale)
    assert torch.equal(view.view(torch.uint8) if fp8 else view, expected.view(torch.uint8) if fp8 else expected)


# ---------------------------------------------------------------------------------------------
# prefill: new tokens and chunks of context, merged by their lse

def _merge(parts):
    """Combine (out [T, H, D], lse [H, T]) partial attentions over disjoint keys, in float64."""
    lses = torch.stack([lse.double().transpose(0, 1) for _, lse in parts])  # [P, T, H]
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total)
    out = sum(w[..., None] * o.double() for w, (o, _) in zip(weights, parts))
    return out, total


def test_prefill_backend_is_pagedattns_and_sees_chunks():
    g = torch.Generator().manual_seed(7)
    config = make_config()
    builder = make_builder(config)
    batch = Batch([(1, 40), (24, 100), (9, 9)], g=g)
    md = builder.build(0, batch.common)
    assert md.num_decodes == 1 and md.num_prefills == 2
    assert isinstance(md.prefill.prefill_backend, PagedAttnMLAPrefill)
    assert md.prefill.chunked_context is not None


def test_prefill_new_tokens_and_context_chunks_merge_to_full_attention():
    """Two prefills with cached context: the context is attended in two chunks, the new tokens
    causally, and the three lse-weighted parts equal attention over all keys."""
    g = torch.Generator().manual_seed(11)
    config = make_config()
    prefill = make_layer(config).prefill_backend.clone()
    q_lens, ctx_lens = [5, 8], [12, 20]
    qk = NOPE + ROPE
    q = torch.randn(sum(q_lens), HEADS, qk, generator=g).half()
    new_k = torch.randn(sum(q_lens), HEADS, qk, generator=g).half()
    new_v = torch.randn(sum(q_lens), HEADS, V_DIM, generator=g).half()
    ctx_k = [torch.randn(n, HEADS, qk, generator=g).half() for n in ctx_lens]
    ctx_v = [torch.randn(n, HEADS, V_DIM, generator=g).half() for n in ctx_lens]
    cu_q = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    bounds = ((0, 7), (7, 20))  # each request's context in two chunks (the first request has 12)
    cu_ks = []
    for lo, hi in bounds:
        lens = [min(hi, n) - min(lo, n) for n in ctx_lens]
        cu_ks.append(torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32))
    prefill.prepare_metadata(types.SimpleNamespace(query_start_loc=cu_q, max_query_len=max(q_lens),
                                                   chunked_context=types.SimpleNamespace(cu_seq_lens=cu_ks)))
    # vLLM's MLA layer passes every argument by keyword, the chunk under the base class's name:
    # 0.26's chunk_idx (an index into the metadata's chunked context) or 0.33's chunk (an object)
    chunk_name = [*inspect.signature(MLAPrefillBackend.run_prefill_context_chunk).parameters][1]

    out_new = torch.full((sum(q_lens), HEADS, V_DIM), float("nan"), dtype=torch.float16)
    o_new, lse_new = prefill.run_prefill_new_tokens(q, new_k, new_v, True, out=out_new)
    assert o_new is out_new and lse_new.shape == (HEADS, sum(q_lens))
    parts = [(o_new, lse_new)]
    for i, (lo, hi) in enumerate(bounds):
        pieces = [(k[lo:hi], v[lo:hi]) for k, v in zip(ctx_k, ctx_v)]
        chunk_k = torch.cat([p[0] for p in pieces])
        chunk_v = torch.cat([p[1] for p in pieces])
        chunk = i if chunk_name == "chunk_idx" else types.SimpleNamespace(
            query_start_loc=cu_q, cu_seq_lens=cu_ks[i], max_query_len=max(q_lens))
        parts.append(prefill.run_prefill_context_chunk(**{chunk_name: chunk}, q=q, k=chunk_k, v=chunk_v))
    out, lse = _merge(parts)

    full_k = torch.cat([torch.cat([ctx_k[s], new_k[cu_q[s]:cu_q[s + 1]]]) for s in range(2)])
    full_v = torch.cat([torch.cat([ctx_v[s], new_v[cu_q[s]:cu_q[s + 1]]]) for s in range(2)])
    cu_full = torch.tensor([0, ctx_lens[0] + q_lens[0], sum(ctx_lens) + sum(q_lens)], dtype=torch.int32)
    ref_out, ref_lse = varlen_attention_ref(q, full_k, full_v, cu_q, cu_full, scale=SCALE, causal=True)
    assert_matches_reference(out.half(), lse.float(), ref_out, ref_lse)
    assert math.isfinite(float(lse.max()))


def test_context_chunk_reads_the_chunk_fields_vllm_has():
    """The fields ``run_prefill_context_chunk`` reads exist on the installed vLLM's classes."""
    cls = getattr(MLACommonPrefillMetadata, "ContextChunk", None)
    if cls is not None:  # 0.33: a chunk object
        names = {f.name for f in dataclasses.fields(cls)}
        assert {"query_start_loc", "cu_seq_lens", "max_query_len"} <= names
    else:  # 0.26: a chunk index into the prefill metadata's chunked context
        names = {f.name for f in dataclasses.fields(MLACommonPrefillMetadata.ChunkedContextMetadata)}
        assert "cu_seq_lens" in names
    assert {"query_start_loc", "max_query_len"} <= {f.name for f in dataclasses.fields(MLACommonPrefillMetadata)}


def test_warm_up_runs_decode_steps_and_prefill_calls(monkeypatch):
    """The builder's warm-up (run at construction on a GPU so that no request waits for Triton to
    compile) runs its decode steps through the impl and the prefill backend's calls, on scratch
    tensors; a speculative step runs only where speculative decoding is configured."""
    config = make_config(speculative_tokens=1)
    builder = make_builder(config)  # on the CPU: no warm-up at construction
    impl = make_impl(config)
    builder.layer.impl = impl
    decodes, prefills, rows = [], [], []
    forward_mqa = impl.forward_mqa

    def counting_mqa(q, cache, md, layer):
        out, lse = forward_mqa(q, cache, md, layer)
        assert torch.isfinite(out).all()
        decodes.append(md.decode.max_query_len)
        rows.append(md.decode.block_table.stride(0))
        return out, lse
    monkeypatch.setattr(impl, "forward_mqa", counting_mqa)
    attend = PagedAttnMLAPrefill._attend

    def counting_attend(self, q, k, v, cu_q, cu_k, max_query_len, *, causal, return_lse, out):
        prefills.append((causal, return_lse, q.shape[0], k.shape[0]))
        return attend(self, q, k, v, cu_q, cu_k, max_query_len, causal=causal, return_lse=return_lse, out=out)
    monkeypatch.setattr(PagedAttnMLAPrefill, "_attend", counting_attend)
    steps = (((1, 20),), ((2, 40), (1, 9)), ((3, 30),))  # the last is wider than 1 + 1 speculative token
    assert builder.warm_up(steps, prefill_tokens=24, long_prefill_tokens=40) == 2 + 7
    assert decodes == [1, 2]
    # the row length of vLLM's own block table (tests/test_vllm.py checks it against vLLM's class)
    assert rows == [worker_block_table_width(builder.kv_cache_spec, config)] * 2
    # both prefill sizes: new tokens without and with lse, a context chunk of as many keys as
    # queries; the short size also a chunk of three times as many (the tiles a long context takes)
    assert prefills == [(True, False, 24, 24), (True, True, 24, 24), (False, True, 24, 24), (False, True, 24, 72),
                        (True, False, 40, 40), (True, True, 40, 40), (False, True, 40, 40)]


def _builder_recording_compiles(monkeypatch, config):
    """A builder of ``config`` with an impl (made on the CPU: no warm-up at construction), and the
    list that records each ``compile_ahead(launched, **fields)`` the warm-up asks for instead."""
    from pagedattn.integrations.vllm import backend as vllm_backend

    builder = make_builder(config)
    builder.layer.impl = make_impl(config)
    asked = []
    monkeypatch.setattr(vllm_backend, "compile_ahead",
                        lambda launched, **fields: asked.append((list(launched), fields)))
    return builder, asked


def _assert_asked_large_variants(asked, calls: int):
    """The warm-up asked for ``calls`` compiles in the 64-bit-offset variant, each of a call's
    captured launches, among them one compiled with 32-bit offsets when it ran."""
    assert [fields for _, fields in asked] == [{"LARGE_CACHE": True}] * calls
    for launched, _ in asked:
        assert launched and any(getattr(kwargs.get("CFG"), "LARGE_CACHE", None) is False for _, _, kwargs in launched)


@pytest.mark.parametrize("large", [False, True], ids=["below", "past"])
def test_warm_up_also_compiles_the_64_bit_offset_decode_variants_of_a_large_cache(monkeypatch, large):
    """Where the latent cache vLLM sized passes 2**31 elements (a few DeepSeek-V3 layers on one
    H200), the decode kernel takes its 64-bit-offset variant, which the scratch cache never
    reaches: the warm-up then also compiles each decode launch in that variant (shapes only)."""
    below = 2**31 // (BLOCK * (LATENT + ROPE))  # the most blocks whose cache stays under 2**31 elements
    builder, asked = _builder_recording_compiles(monkeypatch, make_config(num_gpu_blocks=below + int(large)))
    assert builder.warm_up((((1, 20),), ((1, 40), (1, 9))), prefill_tokens=0) == 2
    _assert_asked_large_variants(asked, 2 if large else 0)


@pytest.mark.parametrize("large", [False, True], ids=["below", "past"])
def test_warm_up_also_compiles_the_64_bit_offset_prefill_variants_of_large_steps(monkeypatch, large):
    """A prefill step of ``max_num_batched_tokens`` decompressed tokens whose V rows (``[tokens,
    heads, nope + v]``) pass 2**31 elements takes the prefill kernel's 64-bit-offset variant,
    which the warm-up's scratch prompts never reach: it then also compiles each prefill launch in
    that variant (shapes only)."""
    below = (2**31 - 1) // (HEADS * max(NOPE + ROPE, NOPE + V_DIM))  # the most tokens under 2**31 elements
    config = make_config()
    config.scheduler_config.max_num_batched_tokens = below + int(large)
    builder, asked = _builder_recording_compiles(monkeypatch, config)
    assert builder.warm_up((), prefill_tokens=8, long_prefill_tokens=16) == 7
    _assert_asked_large_variants(asked, 7 if large else 0)


def test_warm_up_in_threads_compiles_the_decode_launches_before_they_run(monkeypatch):
    """``PAGEDATTN_VLLM_WARMUP_JOBS=2``: every decode step's launches are captured and compiled in
    2 threads before the steps run; the prefill calls run after them."""
    builder, asked = _builder_recording_compiles(monkeypatch, make_config())
    monkeypatch.setenv("PAGEDATTN_VLLM_WARMUP_JOBS", "2")
    assert builder.warm_up((((1, 20),), ((1, 40), (1, 9))), prefill_tokens=0) == 2
    assert [fields for _, fields in asked] == [{"jobs": 2}]
    assert len(asked[0][0]) >= 2  # the decode kernel of each step, at least


def test_decode_over_an_fp8_cache_matches_reference():
    """An fp8 latent cache arrives as vLLM allocates it (uint8) and is read through the layer's
    k_scale; the queries stay 16-bit (the impl asks vLLM not to quantize them)."""
    g = torch.Generator().manual_seed(9)
    config = make_config(cache_dtype="fp8", speculative_tokens=1)  # 2-token steps are decodes
    builder = make_builder(config)
    batch = Batch([(1, 50), (2, 21)], g=g, cache_dtype=torch.float8_e4m3fn)
    md = builder.build(0, batch.common)
    assert md.num_decodes == 2 and md.num_prefills == 0
    impl = make_impl(config, kv_cache_dtype="fp8")
    assert impl.supports_quant_query_input is False
    layer = make_layer(config, k_scale=0.5)
    q_nope = torch.randn(batch.num_tokens, HEADS, LATENT, generator=g).half()
    q_pe = torch.randn(batch.num_tokens, HEADS, ROPE, generator=g).half()
    out, _ = impl.forward_mqa((q_nope, q_pe), batch.cache.view(torch.uint8), md, layer)
    ref, _ = mla_decode_ref(q_nope, q_pe, batch.cache, batch.block_table, batch.seq_lens, batch.qsl, scale=SCALE,
                            kv_scale=0.5)
    assert_matches_reference(out, None, ref, None)


def test_overrides_take_vllms_arguments():
    """Every method the MLA backend's classes define over vLLM's takes the call vLLM makes the
    base class's way (vLLM 0.26 passes ``run_prefill_context_chunk`` its arguments by keyword)."""
    for cls in (PagedAttnMLABackend, PagedAttnMLAImpl, PagedAttnMLAMetadataBuilder, PagedAttnMLAPrefill):
        assert override_mismatches(cls) == [], cls.__name__
