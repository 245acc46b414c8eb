"""pagedattn as vLLM's CUSTOM attention backend, tested against the real classes of the vLLM
installed: ``.ci/run`` runs this file once with vLLM 0.26.0 and once with 0.33.0, the oldest and
newest releases the backend serves.

Skipped where vLLM is not installed (the default environment: vLLM pins another torch and
triton); ``.ci/run`` builds one environment per vLLM release and runs this file in each. vLLM's
backend, impl, builder, metadata, registry, KV-cache spec, layout and view code are the real
ones; only the ``VllmConfig`` handed to the builder is a stand-in, because vLLM cannot build one
without a GPU ("Failed to infer device type"), and ``test_config_stand_in_matches_vllm`` checks
that every attribute the stand-in provides exists on vLLM's config classes.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import random
import sys
import types
import zlib

import pytest
import torch

from tests.vllm_support import require_vllm

require_vllm()

from vllm.config import CUDAGraphMode  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec, FullAttentionSpec  # noqa: E402

import pagedattn.integrations.vllm as pa_vllm  # noqa: E402
from pagedattn.integrations.vllm.backend import (  # noqa: E402
    PagedAttnBackend,
    PagedAttnImpl,
    PagedAttnMetadataBuilder,
)
from pagedattn.reference import paged_attention_ref, varlen_attention_ref  # noqa: E402
from pagedattn.testing import assert_matches_reference  # noqa: E402
from tests.vllm_support import assert_stand_in_matches, override_mismatches, paged_layout  # noqa: E402

DEVICE = torch.device("cpu")
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 32
PAD_TOKENS = 2  # tokens past the last request's, slot -1 (vLLM pads a batch to a graph size)


def _softcap_runs() -> bool:
    """Triton 3.8's interpreter rejects ``constexpr * tensor`` inside ``tl.exp2``, which the softcap
    helper (ops/common/attention_math.py, ``tanh``) writes; compiled GPU code is not affected."""
    import pagedattn

    q = torch.randn(1, 1, 16)
    kc = torch.randn(1, 16, 1, 16)
    try:
        pagedattn.paged_attention(q, kc, kc, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                                  torch.tensor([0, 1], dtype=torch.int32), softcap=2.0)
    except Exception as e:  # noqa: BLE001 - the interpreter wraps the TypeError
        if "cannot convert" in str(e):
            return False
        raise
    return True


# ---------------------------------------------------------------------------------------------
# the stand-in config and the layer: attributes the builder and impl read, nothing more

def make_config(*, cudagraph_mode=CUDAGraphMode.NONE, capture_sizes=(), dtype=torch.float16, max_model_len=256,
                num_q_heads=NUM_Q_HEADS, num_gpu_blocks=None):
    model_config = types.SimpleNamespace(dtype=dtype, max_model_len=max_model_len,
                                         get_num_attention_heads=lambda parallel_config: num_q_heads)
    compilation = types.SimpleNamespace(cudagraph_mode=cudagraph_mode, cudagraph_capture_sizes=list(capture_sizes),
                                        static_forward_context={})
    return types.SimpleNamespace(model_config=model_config, compilation_config=compilation,
                                 parallel_config=types.SimpleNamespace(decode_context_parallel_size=1),
                                 scheduler_config=types.SimpleNamespace(max_num_seqs=64), speculative_config=None,
                                 cache_config=types.SimpleNamespace(num_gpu_blocks=num_gpu_blocks))


def make_layer(k_scale=1.0, v_scale=1.0):
    """The attention layer's fields the impl reads (vLLM's ``AttentionLayer`` protocol)."""
    return types.SimpleNamespace(_k_scale=torch.tensor(k_scale), _v_scale=torch.tensor(v_scale),
                                 mm_prefix_clamp_sliding_window=False)


def test_config_stand_in_matches_vllm():
    from vllm.config import CacheConfig, CompilationConfig, ModelConfig, ParallelConfig, SchedulerConfig

    stand_in = make_config()
    assert_stand_in_matches(stand_in, {ModelConfig: stand_in.model_config, CompilationConfig: stand_in.compilation_config,
                                       ParallelConfig: stand_in.parallel_config,
                                       SchedulerConfig: stand_in.scheduler_config, CacheConfig: stand_in.cache_config})


# ---------------------------------------------------------------------------------------------
# a KV cache allocated the way vLLM's worker allocates it, and one engine step

def vllm_kv_cache(num_blocks, block_size, layout, cache_dtype, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                  spec_cls=FullAttentionSpec):
    """One layer's cache (``layout`` "NHD" or "HND"): a flat int8 buffer viewed as the installed
    vLLM views it. 0.33: its own ``create_kv_cache_views``. 0.26, where the backend shapes the
    cache: the backend's ``get_kv_cache_shape`` laid out in memory in the order of its
    ``get_kv_cache_stride_order``, then permuted back to the logical shape, as 0.26's worker
    does for pages without padding (its module imports most of vLLM's GPU stack, too much to
    install for a CPU test)."""
    spec = spec_cls(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=cache_dtype)
    page = spec.page_size_bytes
    raw = torch.zeros(num_blocks * page, dtype=torch.int8)
    try:
        from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:
        from vllm.v1.attention.backends.utils import set_kv_cache_layout

        set_kv_cache_layout(layout)
        try:
            shape = PagedAttnBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
            order = PagedAttnBackend.get_kv_cache_stride_order()
        finally:
            set_kv_cache_layout(None)
        in_memory = raw.view(spec.dtype).view(*(shape[i] for i in order))
        return spec, in_memory.permute(*(order.index(i) for i in range(len(order))))
    tensor = KVCacheTensor(size=num_blocks * page, layers=["layer.0"], layer_stride=num_blocks * page,
                           block_stride=page)
    layouts = {"NHD": KVCacheLayout.LBNHC, "HND": KVCacheLayout.LBHNC}
    (view,) = create_kv_cache_views(raw, spec, num_blocks, layouts[layout], tensor)
    return spec, view


def fill_random(kv_cache, fp8: bool, g):
    data = torch.randn(kv_cache.shape, generator=g)
    if fp8:
        kv_cache.view(torch.float8_e4m3fn).copy_(data.to(torch.float8_e4m3fn))
    else:
        kv_cache.copy_(data.to(kv_cache.dtype))


class Step:
    """A batch of (query_len, seq_len) requests with vLLM's metadata, new K/V and slot mapping."""

    def __init__(self, cases, *, block_size, num_blocks, dtype, g, mm_ranges=None, causal=True, seq_lens=None,
                 num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, pad=PAD_TOKENS):
        self.cases = cases
        self.num_real = sum(q for q, _ in cases)
        self.num_tokens = self.num_real + pad
        kv_lens = [kv for _, kv in cases]
        self.block_table, self.qsl, slots = paged_layout(cases, block_size, num_blocks, g)
        self.seq_lens = torch.tensor(seq_lens if seq_lens is not None else kv_lens, dtype=torch.int32)
        self.slot_mapping = torch.tensor(slots + [-1] * pad, dtype=torch.int64)
        self.query = torch.randn(self.num_tokens, num_q_heads, head_size, generator=g).to(dtype)
        self.key = torch.randn(self.num_tokens, num_kv_heads, head_size, generator=g).to(dtype)
        self.value = torch.randn(self.num_tokens, num_kv_heads, head_size, generator=g).to(dtype)
        self.common = CommonAttentionMetadata(
            query_start_loc=self.qsl.to(DEVICE), query_start_loc_cpu=self.qsl, seq_lens=self.seq_lens.to(DEVICE),
            num_reqs=len(cases), num_actual_tokens=self.num_tokens, max_query_len=max(q for q, _ in cases),
            max_seq_len=int(self.seq_lens.max()), block_table_tensor=self.block_table.to(DEVICE),
            slot_mapping=self.slot_mapping.to(DEVICE), causal=causal, seq_lens_cpu_upper_bound=self.seq_lens.clone(),
            mm_req_doc_ranges=mm_ranges,
        )

    def output(self, num_q_heads=NUM_Q_HEADS, head_size=HEAD_SIZE):
        return torch.full((self.num_tokens, num_q_heads, head_size), float("nan"), dtype=self.query.dtype)


def make_builder(spec, config=None, layer_names=("layer.0",), impl=None):
    config = config or make_config()
    if impl is not None:
        config.compilation_config.static_forward_context[layer_names[0]] = types.SimpleNamespace(impl=impl)
    return PagedAttnMetadataBuilder(spec, list(layer_names), config, DEVICE)


def run_step(impl, builder, kv_cache, step, layer):
    impl.do_kv_cache_update(layer, step.key, step.value, kv_cache, step.common.slot_mapping)
    md = builder.build(0, step.common)
    out = step.output(impl.num_heads, impl.head_size)
    impl.forward(layer, step.query, step.key, step.value, kv_cache, md, out)
    return md, out


# (query_len, seq_len): decode, extend, prefill, decode, a padding request (0, 0)
MIXED = [(1, 37), (5, 18), (20, 20), (1, 9), (0, 0)]

FEATURES = [
    pytest.param("causal", {}, id="causal"),
    pytest.param("window", {"sliding_window": 7}, id="window"),
    pytest.param("softcap", {"logits_soft_cap": 1.5}, id="softcap"),
    pytest.param("alibi", {"alibi_slopes": [0.25, 0.5, 0.125, 0.0625]}, id="alibi"),
    pytest.param("alibi_sqrt", {"alibi_slopes": [0.25, 0.5, 0.125, 0.0625], "use_alibi_sqrt": True},
                 id="alibi_sqrt"),
    pytest.param("sinks", {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float16), "sliding_window": 9},
                 id="sinks_window"),
    pytest.param("mm_prefix", {}, id="mm_prefix"),
    pytest.param("noncausal", {}, id="noncausal"),
    pytest.param("per_request_causal", {}, id="per_request_causal"),
]


def _ref_features(impl):
    return dict(scale=impl.scale, sliding_window=impl.sliding_window, softcap=impl.logits_soft_cap,
                alibi_slopes=impl.alibi_slopes, alibi_sqrt=impl.use_alibi_sqrt,
                sinks=None if impl.sinks is None else impl.sinks.float())


@pytest.mark.parametrize("name, impl_kwargs", FEATURES)
def test_forward_features(name, impl_kwargs):
    if name == "softcap" and not _softcap_runs():
        pytest.skip("Triton 3.8 interpreter: softcap's tanh helper writes constexpr * tensor inside tl.exp2, which "
                    "this interpreter rejects (GPU code is unaffected)")
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    block_size, num_blocks = 16, 12
    spec, kv_cache = vllm_kv_cache(num_blocks, block_size, "NHD", torch.float16)
    fill_random(kv_cache, False, g)
    impl = PagedAttnImpl(NUM_Q_HEADS, HEAD_SIZE, 0.2, NUM_KV_HEADS, impl_kwargs.get("alibi_slopes"),
                         impl_kwargs.get("sliding_window"), "auto", impl_kwargs.get("logits_soft_cap"),
                         sinks=impl_kwargs.get("sinks"), use_alibi_sqrt=impl_kwargs.get("use_alibi_sqrt", False))
    builder = make_builder(spec, impl=impl)
    mm_ranges, causal, ref_causal, ref_ranges = None, True, True, None
    if name == "mm_prefix":
        # request 2 (a prefill of positions 0..19) holds an image at positions 3..11 (vLLM: inclusive)
        mm_ranges = {2: [(3, 11)], 1: [(14, 16)]}
        ref_ranges = torch.zeros(len(MIXED), 1, 2, dtype=torch.int32)
        ref_ranges[2, 0] = torch.tensor([3, 12])
        ref_ranges[1, 0] = torch.tensor([14, 17])
    if name == "noncausal":
        causal = ref_causal = False
    step = Step(MIXED, block_size=block_size, num_blocks=num_blocks, dtype=torch.float16, g=g, mm_ranges=mm_ranges,
                causal=causal)
    if name == "per_request_causal":
        step.common.causal = torch.tensor([True, False, False, True, True])
    layer = make_layer()
    md, out = run_step(impl, builder, kv_cache, step, layer)
    k_cache, v_cache = impl.cache_views(kv_cache)
    feats = _ref_features(impl)
    n = step.num_real
    if name == "per_request_causal":
        for s, c in enumerate([True, False, False, True]):
            q0, q1 = int(step.qsl[s]), int(step.qsl[s + 1])
            one = slice(s, s + 1)
            qsl = torch.tensor([0, q1 - q0], dtype=torch.int32)
            ref, _ = paged_attention_ref(step.query[q0:q1], k_cache, v_cache, step.block_table[one], step.seq_lens[one],
                                         qsl, causal=c, **feats)
            assert_matches_reference(out[q0:q1], None, ref, None)
        return
    ref, _ = paged_attention_ref(step.query[:n], k_cache, v_cache, step.block_table, step.seq_lens, step.qsl,
                                 causal=ref_causal, prefix_ranges=ref_ranges, **feats)
    assert_matches_reference(out[:n], None, ref, None)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_kv_update_writes_views_and_skips_padding(layout):
    """do_kv_cache_update writes every real token into vLLM's own cache memory and nothing else."""
    g = torch.Generator().manual_seed(1)
    block_size, num_blocks = 8, 16
    spec, kv_cache = vllm_kv_cache(num_blocks, block_size, layout, torch.float16)
    fill_random(kv_cache, False, g)
    impl = PagedAttnImpl(NUM_Q_HEADS, HEAD_SIZE, 0.2, NUM_KV_HEADS, None, None, "auto")
    k_cache, v_cache = impl.cache_views(kv_cache)
    assert k_cache.untyped_storage().data_ptr() == kv_cache.untyped_storage().data_ptr()  # views, not copies
    assert tuple(k_cache.shape) == (num_blocks, block_size, NUM_KV_HEADS, HEAD_SIZE)
    step = Step(MIXED, block_size=block_size, num_blocks=num_blocks, dtype=torch.float16, g=g)
    before = kv_cache.clone()
    impl.do_kv_cache_update(make_layer(), step.key, step.value, kv_cache, step.common.slot_mapping)
    expect = before.transpose(1, 2).clone()  # [blocks, slots, heads, 2 * head_size]
    for t, slot in enumerate(step.slot_mapping.tolist()):
        if slot >= 0:
            expect[slot // block_size, slot % block_size, :, :HEAD_SIZE] = step.key[t]
            expect[slot // block_size, slot % block_size, :, HEAD_SIZE:] = step.value[t]
    assert torch.equal(kv_cache.transpose(1, 2), expect)


def test_fp8_cache_with_scales_gqa_odd_block_hnd():
    """fp8 e4m3 cache (vLLM allocates uint8), per-tensor scales, 8:1 GQA, head 40, 5-token pages, HND."""
    g = torch.Generator().manual_seed(2)
    num_q, num_kv, head, block_size, num_blocks = 8, 1, 40, 5, 24
    spec, kv_cache = vllm_kv_cache(num_blocks, block_size, "HND", torch.uint8, num_kv_heads=num_kv,
                                   head_size=head)
    fill_random(kv_cache, True, g)
    impl = PagedAttnImpl(num_q, head, head ** -0.5, num_kv, None, None, "fp8")
    builder = make_builder(spec, config=make_config(num_q_heads=num_q), impl=impl)
    step = Step(MIXED, block_size=block_size, num_blocks=num_blocks, dtype=torch.float16, g=g, num_q_heads=num_q,
                num_kv_heads=num_kv, head_size=head)
    layer = make_layer(k_scale=0.5, v_scale=2.0)
    md, out = run_step(impl, builder, kv_cache, step, layer)
    k_cache, v_cache = impl.cache_views(kv_cache)
    assert k_cache.dtype == torch.float8_e4m3fn
    n = step.num_real
    ref, _ = paged_attention_ref(step.query[:n], k_cache, v_cache, step.block_table, step.seq_lens, step.qsl,
                                 scale=impl.scale, k_scale=0.5, v_scale=2.0)
    assert_matches_reference(out[:n], None, ref, None)


def test_fp32_model():
    g = torch.Generator().manual_seed(3)
    spec, kv_cache = vllm_kv_cache(10, 16, "NHD", torch.float32)
    fill_random(kv_cache, False, g)
    impl = PagedAttnImpl(NUM_Q_HEADS, HEAD_SIZE, 0.3, NUM_KV_HEADS, None, None, "auto")
    builder = make_builder(spec, config=make_config(dtype=torch.float32), impl=impl)
    step = Step(MIXED, block_size=16, num_blocks=10, dtype=torch.float32, g=g)
    md, out = run_step(impl, builder, kv_cache, step, make_layer())
    k_cache, v_cache = impl.cache_views(kv_cache)
    n = step.num_real
    ref, _ = paged_attention_ref(step.query[:n], k_cache, v_cache, step.block_table, step.seq_lens, step.qsl, scale=0.3)
    assert_matches_reference(out[:n], None, ref, None)


def test_builder_maps_metadata_and_plans_the_step():
    g = torch.Generator().manual_seed(4)
    spec, _ = vllm_kv_cache(12, 16, "NHD", torch.float16)
    builder = make_builder(spec)
    assert builder.persistent_plan is None  # no full CUDA graphs configured
    step = Step(MIXED, block_size=16, num_blocks=12, dtype=torch.float16, g=g)
    md = builder.build(0, step.common)
    assert md.query_start_loc is step.common.query_start_loc and md.seq_lens is step.common.seq_lens
    assert md.block_table is step.common.block_table_tensor and md.slot_mapping is step.common.slot_mapping
    assert md.num_actual_tokens == step.num_tokens and md.causal is True and md.prefix_ranges is None
    assert md.plan.path == "unified" and md.plan.max_num_tokens >= step.num_tokens
    prefill = Step([(1, 30), (130, 130)], block_size=16, num_blocks=12, dtype=torch.float16, g=g)
    assert builder.build(0, prefill.common).plan.path == "prefill"


def test_cuda_graph_steps_share_one_persistent_plan():
    """With full CUDA graphs, decode steps (capture and replay) go through one plan updated in place."""
    g = torch.Generator().manual_seed(5)
    block_size, num_blocks = 16, 12
    spec, kv_cache = vllm_kv_cache(num_blocks, block_size, "NHD", torch.float16)
    fill_random(kv_cache, False, g)
    impl = PagedAttnImpl(NUM_Q_HEADS, HEAD_SIZE, 0.2, NUM_KV_HEADS, None, 6, "auto")
    config = make_config(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, capture_sizes=[1, 2, 4, 8])
    assert PagedAttnMetadataBuilder.get_cudagraph_support(config, spec) == AttentionCGSupport.UNIFORM_BATCH
    builder = make_builder(spec, config=config, impl=impl)
    plan = builder.persistent_plan
    assert plan is not None and plan.path == "persistent"
    capture = Step([(1, 1)] * 4, block_size=block_size, num_blocks=num_blocks, dtype=torch.float16, g=g, pad=4)
    assert builder.build_for_cudagraph_capture(capture.common).plan is plan
    layer = make_layer()
    for cases in ([(1, 40), (1, 3), (1, 17), (0, 0)], [(1, 60), (1, 33), (1, 1), (1, 9)]):
        step = Step(cases, block_size=block_size, num_blocks=num_blocks, dtype=torch.float16, g=g,
                    pad=8 - sum(q for q, _ in cases))
        md, out = run_step(impl, builder, kv_cache, step, layer)
        assert md.plan is plan
        k_cache, v_cache = impl.cache_views(kv_cache)
        n = step.num_real
        ref, _ = paged_attention_ref(step.query[:n], k_cache, v_cache, step.block_table, step.seq_lens, step.qsl,
                                     scale=0.2, sliding_window=6)
        assert_matches_reference(out[:n], None, ref, None)
    mixed = Step(MIXED, block_size=block_size, num_blocks=num_blocks, dtype=torch.float16, g=g)
    assert builder.build(0, mixed.common).plan is not plan  # not a graph batch: a fresh plan


def test_cross_attention_reads_encoder_cache():
    """ENCODER_DECODER: decoder queries over the encoder's cached K/V, non-causal (vLLM's cross
    builder passes seq_lens = encoder lengths, causal=False); query_len may exceed seq_len."""
    g = torch.Generator().manual_seed(6)
    block_size, num_blocks = 16, 8
    spec, kv_cache = vllm_kv_cache(num_blocks, block_size, "NHD", torch.float16)
    fill_random(kv_cache, False, g)
    impl = PagedAttnImpl(NUM_Q_HEADS, HEAD_SIZE, 0.2, NUM_KV_HEADS, None, None, "auto",
                         attn_type=AttentionType.ENCODER_DECODER)
    builder = make_builder(spec, impl=impl)
    step = Step([(1, 12), (20, 9), (3, 30)], block_size=block_size, num_blocks=num_blocks, dtype=torch.float16, g=g,
                causal=False)
    md = builder.build(0, step.common)
    out = step.output()
    impl.forward(make_layer(), step.query, step.key, step.value, kv_cache, md, out)
    k_cache, v_cache = impl.cache_views(kv_cache)
    n = step.num_real
    ref, _ = paged_attention_ref(step.query[:n], k_cache, v_cache, step.block_table, step.seq_lens, step.qsl,
                                 scale=0.2, causal=False)
    assert_matches_reference(out[:n], None, ref, None)


@pytest.mark.parametrize("attn_type", [AttentionType.ENCODER_ONLY, AttentionType.ENCODER])
def test_encoder_attention_without_cache(attn_type):
    g = torch.Generator().manual_seed(7)
    spec = EncoderOnlyAttentionSpec(block_size=16, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                                    dtype=torch.float16)
    impl = PagedAttnImpl(NUM_Q_HEADS, HEAD_SIZE, 0.2, NUM_KV_HEADS, None, 5, "auto", attn_type=attn_type)
    builder = make_builder(spec, impl=impl)
    cases = [(7, 7), (19, 19), (1, 1)]
    step = Step(cases, block_size=16, num_blocks=4, dtype=torch.float16, g=g, causal=False)
    md = builder.build(0, step.common)
    assert md.plan is None and md.causal is False
    impl.do_kv_cache_update(make_layer(), step.key, step.value, torch.empty(0), step.common.slot_mapping)  # no cache
    out = step.output()
    impl.forward(make_layer(), step.query, step.key, step.value, torch.empty(0), md, out)
    n = step.num_real
    ref, _ = varlen_attention_ref(step.query[:n], step.key[:n], step.value[:n], step.qsl, step.qsl, scale=0.2,
                                  causal=False, sliding_window=5)
    assert_matches_reference(out[:n], None, ref, None)


def test_profiling_run_without_metadata():
    spec, kv_cache = vllm_kv_cache(4, 16, "NHD", torch.float16)
    impl = PagedAttnImpl(NUM_Q_HEADS, HEAD_SIZE, 0.2, NUM_KV_HEADS, None, None, "auto")
    out = torch.full((6, NUM_Q_HEADS, HEAD_SIZE), float("nan"), dtype=torch.float16)
    q = torch.randn(6, NUM_Q_HEADS, HEAD_SIZE, dtype=torch.float16)
    k = torch.randn(6, NUM_KV_HEADS, HEAD_SIZE, dtype=torch.float16)
    assert impl.forward(make_layer(), q, k, k, kv_cache, None, out) is out
    assert torch.equal(out, torch.zeros_like(out))


def test_register_is_idempotent_and_selects_the_backend():
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES

    custom = AttentionBackendEnum.CUSTOM
    custom.clear_override()
    overrides = dict(_ATTN_OVERRIDES)
    pa_vllm.register()
    pa_vllm.register()
    assert custom.get_path() == pa_vllm.BACKEND_CLASS_PATH
    assert custom.get_class() is PagedAttnBackend
    assert AttentionBackendEnum[PagedAttnBackend.get_name()] is custom  # what vLLM's Attention layer looks up
    assert {k: v for k, v in _ATTN_OVERRIDES.items() if k is not custom} == overrides


def test_entry_point_reaches_register():
    """The installed distribution's vllm.general_plugins entry point is pagedattn's register."""
    from importlib.metadata import entry_points

    points = [p for p in entry_points(group="vllm.general_plugins") if p.value.startswith("pagedattn")]
    if not points:
        pytest.skip("pagedattn is not installed as a distribution here (pip install -e . declares the entry point)")
    assert [p.value for p in points] == ["pagedattn.integrations.vllm:register"]
    assert points[0].load() is pa_vllm.register


def test_validate_configuration_reasons():
    cap = DeviceCapability(9, 0)

    def reasons(**over):
        args = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16, use_mla=False,
                    has_sink=True, use_sparse=False, use_mm_prefix=True, use_per_head_quant_scales=False,
                    device_capability=cap, attn_type=AttentionType.DECODER, has_sliding_window=True,
                    use_non_causal=True, use_batch_invariant=True)
        args.update(over)
        return PagedAttnBackend.validate_configuration(**args)

    # keywords of the newer releases (0.26.0 has none of them): each checked where vLLM takes it
    takes = set(inspect.signature(PagedAttnBackend.validate_configuration).parameters)
    assert reasons() == []
    for ok in (dict(head_size=8), dict(head_size=80), dict(head_size=256), dict(block_size=5), dict(block_size=1),
               dict(kv_cache_dtype="fp8"), dict(kv_cache_dtype="fp8_e4m3"), dict(dtype=torch.float32),
               dict(attn_type=AttentionType.ENCODER_ONLY), dict(attn_type=AttentionType.ENCODER_DECODER)):
        assert reasons(**ok) == [], ok
    assert reasons(head_size=12) == ["head_size not supported"]
    assert reasons(head_size=264) == ["head_size not supported"]
    assert reasons(kv_cache_dtype="fp8_e5m2") == ["kv_cache_dtype not supported"]
    assert reasons(kv_cache_dtype="int8_per_token_head") == ["kv_cache_dtype not supported"]
    assert reasons(use_mla=True) == ["MLA not supported"]
    assert reasons(use_sparse=True) == ["sparse not supported"]
    assert reasons(use_per_head_quant_scales=True) == ["per-head quant scales not supported"]
    if "use_dcp" in takes:
        assert reasons(use_dcp=True) == ["DCP not supported"]
    assert reasons(use_pcp=True) == ["PCP not supported"]
    if "use_rswa" in takes:
        assert reasons(use_rswa=True) == ["R-SWA not supported"]
    if "use_adaptive_verification" in takes:
        assert reasons(use_adaptive_verification=True)[0].startswith("device-cpu query lens mismatch")
    import vllm.v1.attention.backend

    if hasattr(vllm.v1.attention.backend, "max_decode_query_len"):  # 0.33's interface: none of them skipped
        assert {"use_dcp", "use_rswa", "use_adaptive_verification"} <= takes
    mismatch = reasons(kv_cache_dtype="float16")
    assert len(mismatch) == 1 and "differs from the model dtype" in mismatch[0]
    # the kernels take any strides: no layout asked for (0.26 names the query get_required_kv_cache_layout)
    layouts = getattr(PagedAttnBackend, "supported_kv_cache_layouts", None) or PagedAttnBackend.get_required_kv_cache_layout
    assert layouts() is None


@pytest.mark.parametrize("kwargs, match", [
    pytest.param(dict(head_size=12), "head_size 12", id="head_size"),
    pytest.param(dict(num_kv_heads=3), "multiple of num_kv_heads", id="heads"),
    pytest.param(dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype", id="kv_dtype"),
    pytest.param(dict(use_alibi_sqrt=True), "alibi_slopes", id="alibi_sqrt"),
    pytest.param(dict(sinks=torch.zeros(3)), "sinks", id="sinks"),
    pytest.param(dict(sliding_window=0), "sliding_window", id="window"),
])
def test_impl_rejects_what_it_cannot_serve(kwargs, match):
    args = dict(num_heads=NUM_Q_HEADS, head_size=HEAD_SIZE, scale=0.2, num_kv_heads=NUM_KV_HEADS, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="auto")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        PagedAttnImpl(**args)


def test_builder_rejects_different_value_head_size():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=NUM_KV_HEADS, head_size=64, head_size_v=32,
                             dtype=torch.float16)
    with pytest.raises(ValueError, match="head_size_v"):
        make_builder(spec)


def test_module_import_does_not_import_vllm():
    """``import pagedattn.integrations.vllm`` (what the entry point loads first) stays cheap."""
    import subprocess

    code = "import sys, pagedattn.integrations.vllm; print('vllm' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


def test_warm_up_runs_each_distinct_layer_through_prefill_steps(monkeypatch):
    """The builder's warm-up (run at construction on a GPU, so the first prompt does not wait for
    Triton to compile the prefill kernel) builds vLLM metadata for each step and runs it through one
    layer per distinct feature set, on a scratch cache, with every launch a real one."""
    spec, _ = vllm_kv_cache(4, 16, "NHD", torch.float16)
    config = make_config()
    plain = PagedAttnImpl(NUM_Q_HEADS, HEAD_SIZE, 0.2, NUM_KV_HEADS, None, None, "auto")
    twin = PagedAttnImpl(NUM_Q_HEADS, HEAD_SIZE, 0.3, NUM_KV_HEADS, None, None, "auto")  # only the scale differs
    windowed = PagedAttnImpl(NUM_Q_HEADS, HEAD_SIZE, 0.2, NUM_KV_HEADS, None, 8, "auto")
    context = config.compilation_config.static_forward_context
    for name, impl in (("layer.0", plain), ("layer.1", twin), ("layer.2", windowed)):
        context[name] = types.SimpleNamespace(impl=impl, **vars(make_layer()))
    builder = PagedAttnMetadataBuilder(spec, ["layer.0", "layer.1", "layer.2"], config, DEVICE)  # CPU: no warm-up
    seen = []
    for impl in (plain, twin, windowed):
        forward = impl.forward

        def counting(layer, q, k, v, kv_cache, md, out, _forward=forward, _impl=impl):
            result = _forward(layer, q, k, v, kv_cache, md, out)
            assert torch.isfinite(result).all()  # a zero cache and zero queries: every row written, finite
            seen.append((_impl, md.max_query_len, kv_cache.shape))
            return result
        monkeypatch.setattr(impl, "forward", counting)
    steps = (((20, 20),), ((1, 9), (18, 40)))
    assert builder.warm_up(steps) == 4
    assert {impl for impl, _, _ in seen} == {plain, windowed}
    assert [q for impl, q, _ in seen if impl is plain] == [20, 18]
    assert all(shape == (3, NUM_KV_HEADS, 16, 2 * HEAD_SIZE) for _, _, shape in seen)  # the longest step's pages


# blocks of [16, NUM_KV_HEADS, 2 * HEAD_SIZE]: the most whose K and V views stay under 2**31 elements
BLOCKS_BELOW_2_31 = 2**31 // (16 * NUM_KV_HEADS * 2 * HEAD_SIZE)


@pytest.mark.parametrize("num_gpu_blocks, large", [(None, False), (BLOCKS_BELOW_2_31, False),
                                                   (BLOCKS_BELOW_2_31 + 1, True)], ids=["unsized", "below", "past"])
def test_warm_up_also_compiles_the_64_bit_offset_variants_of_a_large_cache(monkeypatch, num_gpu_blocks, large):
    """Where the cache vLLM sized gives each layer K/V views past 2**31 elements (Gemma-3-12B's
    hybrid cache on the H200), the kernels take their 64-bit-offset variants, which the warm-up's
    small scratch cache never reaches: the warm-up then also compiles each of its launches in that
    variant, so the first request compiles nothing. Shapes only: no large cache is allocated."""
    from pagedattn.integrations.vllm import backend as vllm_backend

    spec, _ = vllm_kv_cache(4, 16, "NHD", torch.float16)
    config = make_config(num_gpu_blocks=num_gpu_blocks)
    impl = PagedAttnImpl(NUM_Q_HEADS, HEAD_SIZE, 0.2, NUM_KV_HEADS, None, None, "auto")
    config.compilation_config.static_forward_context["layer.0"] = types.SimpleNamespace(impl=impl,
                                                                                        **vars(make_layer()))
    builder = PagedAttnMetadataBuilder(spec, ["layer.0"], config, DEVICE)  # CPU: no warm-up at construction
    asked = []
    monkeypatch.setattr(vllm_backend, "compile_ahead", lambda launched, **fields: asked.append((launched, fields)))
    assert builder.real_cache_is_large() is large
    assert builder.warm_up((((20, 20),), ((1, 9), (18, 40)))) == 2
    if not large:
        assert asked == []
        return
    assert [fields for _, fields in asked] == [{"LARGE_CACHE": True}] * 2
    for launched, _ in asked:  # the step's attention launches as made on the scratch cache
        assert launched and all(kwargs["CFG"].LARGE_CACHE is False for _, _, kwargs in launched)


@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
def test_warm_up_in_threads_compiles_every_launch_before_the_steps_run(monkeypatch, large):
    """``PAGEDATTN_VLLM_WARMUP_JOBS=3``: the warm-up captures every launch of every step, compiles
    them in 3 threads (and their 64-bit-offset variants where the real cache needs them), then runs
    each step on the compiled kernels; a value that is not a positive integer is refused."""
    from pagedattn.integrations.vllm import backend as vllm_backend
    from pagedattn.ops.common import launching

    spec, _ = vllm_kv_cache(4, 16, "NHD", torch.float16)
    config = make_config(num_gpu_blocks=BLOCKS_BELOW_2_31 + 1 if large else None)
    impl = PagedAttnImpl(NUM_Q_HEADS, HEAD_SIZE, 0.2, NUM_KV_HEADS, None, None, "auto")
    config.compilation_config.static_forward_context["layer.0"] = types.SimpleNamespace(impl=impl,
                                                                                        **vars(make_layer()))
    builder = PagedAttnMetadataBuilder(spec, ["layer.0"], config, DEVICE)  # CPU: no warm-up at construction
    asked, ran = [], []
    monkeypatch.setattr(vllm_backend, "compile_ahead",
                        lambda launched, **fields: asked.append((list(launched), fields, len(ran))))
    forward = impl.forward
    monkeypatch.setattr(impl, "forward", lambda *a: ran.append(launching._CAPTURING.get() is not None) or forward(*a))
    monkeypatch.setenv("PAGEDATTN_VLLM_WARMUP_JOBS", "3")
    assert builder.warm_up((((20, 20),), ((1, 9), (18, 40)))) == 2
    assert ran == [True, True, False, False]  # both steps captured, then both run
    assert [fields for _, fields, _ in asked] == [{"jobs": 3}] + ([{"jobs": 3, "LARGE_CACHE": True}] if large else [])
    assert all(before == 2 for _, _, before in asked)  # compiled before any step ran
    launched = asked[0][0]
    assert len(launched) >= 2 and all(kwargs["CFG"].LARGE_CACHE is False for _, _, kwargs in launched)
    for bad in ("0", "two"):
        monkeypatch.setenv("PAGEDATTN_VLLM_WARMUP_JOBS", bad)
        with pytest.raises(ValueError, match="PAGEDATTN_VLLM_WARMUP_JOBS"):
            builder.warm_up((((20, 20),),))


@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_size", [(32, 8, 128), (8, 2, 128), (32, 8, 64), (16, 16, 256)])
def test_warm_up_steps_cover_the_prefill_tiles_of_real_batches(monkeypatch, num_q_heads, num_kv_heads, head_size):
    """Planned for the H200 (the tiles the GPU compiles), the warm-up's steps reach every tile
    choice of the prefill kernel that prompts, extends and mixed batches of real sizes take, so no
    prefill variant is left to compile during a request."""
    from pagedattn.integrations.vllm.backend import WARMUP_STEPS
    from pagedattn.ops.common.target import props_for, targeting
    from pagedattn.plan import plan_attention

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the GPU's tiles, not the interpreter's

    def prefill_tiles(step):
        qsl = [0]
        for q, _ in step:
            qsl.append(qsl[-1] + q)
        plan = plan_attention(qsl, [kv for _, kv in step], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                              head_size=head_size, device="cpu", max_num_tokens=qsl[-1], dtype=torch.bfloat16)
        return plan.prefill_tiles if plan.path == "prefill" else None

    real = {"prompt 1k": [(1024, 1024)], "prompt 8k": [(8192, 8192)], "prompt 32k": [(32768, 32768)],
            "8 prompts of 2k": [(2048, 2048)] * 8, "4 extends of 512 on 4k": [(512, 4096)] * 4,
            "a 2k prompt among 63 decodes": [(2048, 2048)] + [(1, 4096)] * 63,
            "an 8k chunk on 16k": [(8192, 16384)], "a chunk among decodes": [(1, 300)] * 8 + [(300, 900)]}
    with targeting(props_for("sm90")):
        warmed = {prefill_tiles(step) for step in WARMUP_STEPS} - {None}
        for name, step in real.items():
            tiles = prefill_tiles(step)
            assert tiles is None or tiles in warmed, f"{name}: prefill tiles {tiles} are not warmed up"


def _vllm_block_table(spec, config, num_reqs: int) -> torch.Tensor:
    """The first ``num_reqs`` rows of the block table vLLM's model runner keeps for ``spec``'s
    group (``MultiGroupBlockTable``, built as the runner builds it)."""
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    max_len = config.model_config.max_model_len
    table = dict(max_num_reqs=max(4, num_reqs), max_num_batched_tokens=64, pin_memory=False,
                 device=torch.device(DEVICE), block_sizes=[spec.block_size],
                 max_num_blocks=[spec.max_num_blocks_per_req(config, max_len)])
    if "kernel_block_sizes" in inspect.signature(MultiGroupBlockTable).parameters:  # 0.26
        table["kernel_block_sizes"] = [spec.block_size]
    return MultiGroupBlockTable(**table).block_tables[0].get_device_tensor(num_reqs)


@pytest.mark.parametrize("max_model_len", [1000, 1100, 8192])
def test_warm_up_block_tables_have_the_rows_of_vllms_own_table(monkeypatch, max_model_len):
    """Triton specializes a kernel on its block table's row stride (a multiple of 16 or not), so
    the warm-up's steps take the row length of the table vLLM's model runner keeps, built here as
    the runner builds it; with rows only as long as its steps', a real step compiled during
    inference what the warm-up had compiled for other rows (the unified kernel beside a prefill
    launch, on the H200). 1000 tokens: 63 blocks, 64 a row; 1100: 69, 72 a row."""
    spec, _ = vllm_kv_cache(4, 16, "NHD", torch.float16)
    config = make_config(max_model_len=max_model_len)
    vllm_rows = _vllm_block_table(spec, config, 2).stride(0)
    impl = PagedAttnImpl(NUM_Q_HEADS, HEAD_SIZE, 0.2, NUM_KV_HEADS, None, None, "auto")
    config.compilation_config.static_forward_context["layer.0"] = types.SimpleNamespace(impl=impl,
                                                                                        **vars(make_layer()))
    builder = PagedAttnMetadataBuilder(spec, ["layer.0"], config, DEVICE)  # CPU: no warm-up at construction
    rows = []
    forward = impl.forward
    monkeypatch.setattr(impl, "forward", lambda layer, q, k, v, kv_cache, md, out: (
        rows.append(md.block_table.stride(0)), forward(layer, q, k, v, kv_cache, md, out))[1])
    assert builder.warm_up((((20, 20),), ((1, 9), (18, 40)))) == 2
    assert rows == [vllm_rows] * 2


def _chunked_prefill_steps(count: int, seed: int = 0) -> list:
    """``count`` steps as vLLM's scheduler makes them under chunked prefill of 8192 tokens:
    prompts of 64-4096 tokens (log-uniform), some over a cached context, packed into the budget,
    beside 0, 3 or 20 decodes of contexts of 64-4096."""
    rng = random.Random(seed)
    steps = []
    for _ in range(count):
        step, budget = [], 8192
        for _ in range(rng.choice([0, 0, 3, 20])):
            step.append((1, rng.randint(64, 4096)))
            budget -= 1
        while budget > 0:
            q = min(int(2 ** rng.uniform(6, 12)), budget)
            context = rng.choice([0, 0, rng.randint(0, 3000)])
            step.append((q, context + q))
            budget -= q
        steps.append(tuple(step))
    return steps


def _scheduled_steps(num_prompts: int, prompt_len: int, budget: int = 8192, decodes: int = 2) -> list:
    """The steps vLLM's scheduler makes for ``num_prompts`` equal prompts arriving together under
    chunked prefill of ``budget`` tokens, until each has decoded ``decodes`` tokens: the running
    requests first (a decode's one token, a partial prompt's next chunk), then new prompts, in
    arrival order. A prompt cut at the budget leaves a tail of a few tokens for the next step."""
    done = [0] * num_prompts  # tokens computed (prompt, then decoded) per request
    steps = []
    while any(d < prompt_len + decodes for d in done):
        step, left = [], budget
        for r in range(num_prompts):
            if left == 0 or done[r] >= prompt_len + decodes:
                continue
            q = 1 if done[r] >= prompt_len else min(prompt_len - done[r], left)
            step.append((q, done[r] + q))
            done[r] += q
            left -= q
        steps.append(tuple(step))
    return steps


@pytest.mark.parametrize("shape", ["llama-8192", "llama-8704", "gemma2-8192"])
def test_warm_up_compiles_every_kernel_variant_that_eager_steps_launch(monkeypatch, shape):
    """A step with a prompt or a chunk never replays a full CUDA graph, nor does any step without
    full graphs: whatever it launches and the warm-up did not compiles at the first such request
    (vLLM's "Triton kernel JIT compilation during inference"). Planned for the H200, every launch
    of 24 chunked-prefill steps, of the grid's points scheduled under that budget and of decode
    batches of the vLLM grid's sizes, on vLLM's own block table, has the Triton cache key of a warm-up launch (``compile_matrix.launch_key``: the
    specialization Triton's launcher looks a compiled kernel up by). The Gluon prefill kernel,
    which wants an sm90 tensor, is not reached on the CPU."""
    from pagedattn.compile_matrix import launch_key
    from pagedattn.integrations.vllm.backend import WARMUP_STEPS
    from pagedattn.ops.common.launching import capturing
    from pagedattn.ops.common.target import props_for, targeting

    # the CUDA backend that binds the launches imports Gluon, whose import asserts that a kernel
    # decorated under TRITON_INTERPRET=1 is read while the interpreter is on
    importlib.import_module("triton.experimental.gluon")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the GPU's tiles and warps, not the interpreter's
    model, max_model_len = shape.split("-")
    # Llama-3.1-8B's heads; Gemma-2-9B's, with the window and logit cap of its windowed layers
    heads, kv_heads, head_size, window, cap = (32, 8, 128, None, None) if model == "llama" else (16, 8, 256, 4096, 50.0)
    page = 16
    spec, kv_cache = vllm_kv_cache(8, page, "NHD", torch.bfloat16, num_kv_heads=kv_heads, head_size=head_size)
    config = make_config(max_model_len=int(max_model_len), num_q_heads=heads, dtype=torch.bfloat16)
    impl = PagedAttnImpl(heads, head_size, head_size ** -0.5, kv_heads, None, window, "auto", logits_soft_cap=cap)
    layer = types.SimpleNamespace(impl=impl, **vars(make_layer()))
    config.compilation_config.static_forward_context["layer.0"] = layer
    builder = PagedAttnMetadataBuilder(spec, ["layer.0"], config, DEVICE)  # CPU: no warm-up at construction

    def keys(launched):
        return {launch_key(kernel, kwargs, "sm90") for kernel, _, kwargs in launched}

    with targeting(props_for("sm90")):
        with capturing() as launched:
            builder.warm_up()  # no full CUDA graphs: the decode steps too
        warmed = keys(launched)
        decodes = [((1, length),) * batch for batch, length in ((1, 500), (1, 8192), (4, 1000), (16, 4096), (64, 2048),
                                                               (128, 1024), (3, 77))]
        # the grid's points under the traffic run's 8192-token budget (the 16 x 4096 point once
        # compiled the unified kernel at a step with a prompt's 2-token tail)
        grid = _scheduled_steps(16, 4096) + _scheduled_steps(64, 2048) + _scheduled_steps(128, 1024)
        for step in _chunked_prefill_steps(24) + grid + decodes:
            qsl = torch.tensor([0] + list(itertools.accumulate(q for q, _ in step)), dtype=torch.int32)
            lens = torch.tensor([kv for _, kv in step], dtype=torch.int32)
            n = int(qsl[-1])
            common = CommonAttentionMetadata(
                query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=lens, num_reqs=len(step), num_actual_tokens=n,
                max_query_len=max(q for q, _ in step), max_seq_len=int(lens.max()),
                block_table_tensor=_vllm_block_table(spec, config, len(step)),
                slot_mapping=torch.zeros(n, dtype=torch.int64), causal=True, seq_lens_cpu_upper_bound=lens)
            q = torch.zeros(n, heads, head_size, dtype=torch.bfloat16)
            kv = torch.zeros(n, kv_heads, head_size, dtype=torch.bfloat16)
            with capturing() as launched:
                impl.forward(layer, q, kv, kv, kv_cache, builder.build(0, common), torch.empty_like(q))
            missing = keys(launched) - warmed
            assert not missing, f"step {step[:4]}... ({len(step)} requests) launches {sorted(k for k, _ in missing)} " \
                                "in a variant the warm-up did not compile"


def test_overrides_take_vllms_arguments():
    """Every method the backend's classes define over vLLM's takes the call vLLM makes the base
    class's way: no argument name of the base's missing, no required argument the base lacks."""
    for cls in (PagedAttnBackend, PagedAttnImpl, PagedAttnMetadataBuilder):
        assert override_mismatches(cls) == [], cls.__name__


@pytest.mark.parametrize("cache_block_size", [16, 32])
def test_window_layers_get_full_pages(cache_block_size):
    """vLLM's own Attention.get_kv_cache_spec (each release picks a window layer's page size
    itself) gives a window layer on this backend pages of at least 16 tokens, not 1."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    layer = types.SimpleNamespace(attn_type=AttentionType.DECODER, kv_cache_dtype="auto", sliding_window=4096,
                                  attn_backend=PagedAttnBackend, num_kv_heads=8, head_size=128, head_size_v=128,
                                  kv_cache_torch_dtype=torch.bfloat16)
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=cache_block_size,
                                                                      skip_page_size_padded=None))
    spec = Attention.get_kv_cache_spec(layer, config)
    assert isinstance(spec, SlidingWindowSpec) and spec.sliding_window == 4096
    assert spec.block_size >= 16 and spec.block_size % 16 == 0, spec
    full = Attention.get_kv_cache_spec(types.SimpleNamespace(**{**vars(layer), "sliding_window": None}), config)
    assert full.block_size == cache_block_size
