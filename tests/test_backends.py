"""Backends: selection (name, environment, automatic fallback), every backend against the
reference, and the router's ordering and chunked extend path. Interpreter-sized."""

import dataclasses
import logging
import zlib

import pytest
import torch

from pagedattn.backends import (
    ENV_VAR,
    BackendConfig,
    BatchMetadata,
    get_backend,
    list_backends,
    select_backend,
)
from pagedattn.backends.router import route_order
from pagedattn.reference import paged_attention_ref
from pagedattn.testing import TOLERANCES, captured, feature_kwargs, make_paged_batch
from tests.conftest import DEVICE

MIXED = [(20, 20), (1, 163), (5, 18), (0, 7), (9, 49), (1, 1), (17, 40)]


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def config(dtype=torch.float32, features=("causal",), device=DEVICE, head_size=32):
    return BackendConfig(device, dtype, head_size, 4, 2, features=frozenset(features))


def assert_matches_reference(batch, out, lse, kwargs):
    ref_out, ref_lse = paged_attention_ref(*batch.args(), **kwargs)
    atol, rtol = TOLERANCES[out.dtype]
    assert not torch.isnan(out).any(), "unwritten or NaN output"
    torch.testing.assert_close(out.double().cpu(), ref_out.cpu(), atol=atol, rtol=rtol)
    if lse is not None:
        finite = torch.isfinite(ref_lse)
        assert torch.equal(finite.cpu(), torch.isfinite(lse).cpu()), "lse -inf pattern differs"
        torch.testing.assert_close(lse.double()[finite].cpu(), ref_lse[finite].cpu(), atol=atol, rtol=rtol)


# --- selection --------------------------------------------------------------------------


def test_registry_lists_builtins_and_rejects_unknown():
    assert {"triton", "torch", "sdpa", "flex", "flashinfer", "router"} <= set(list_backends())
    with pytest.raises(ValueError, match="unknown attention backend 'nope'.*registered"):
        get_backend("nope")
    with pytest.raises(ValueError, match="unknown feature"):
        BackendConfig("cpu", torch.float32, 32, 4, 2, features={"causal", "dropout"})


def test_select_by_name_env_and_default(monkeypatch):
    cfg = config()
    assert select_backend(cfg).name == "triton"  # the default: the interpreter is on in these tests
    assert select_backend(cfg, name="torch").name == "torch"
    monkeypatch.setenv(ENV_VAR, "sdpa")  # read at selection time
    assert select_backend(cfg).name == "sdpa"
    assert select_backend(cfg, name="torch").name == "torch"  # the argument wins
    monkeypatch.setenv(ENV_VAR, "router")
    assert select_backend(cfg).name == "router"


def test_explicit_backend_that_cannot_serve_raises(monkeypatch):
    cfg = config(features={"causal", "sinks", "lse"})
    with pytest.raises(ValueError, match=r"'sdpa' \(requested by argument\).*'lse'.*'sinks'"):
        select_backend(cfg, name="sdpa")
    monkeypatch.setenv(ENV_VAR, "sdpa")
    with pytest.raises(ValueError, match=r"requested by \$PAGEDATTN_BACKEND.*sinks"):
        select_backend(cfg)
    with pytest.raises(ValueError, match="flashinfer"):
        select_backend(cfg, name="flashinfer")
    with pytest.raises(ValueError, match="head_size 12"):
        select_backend(config(head_size=12), name="triton")


def test_automatic_choice_falls_back_and_logs(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="pagedattn.backends")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU without the interpreter: no Triton
    cpu = config(device="cpu")
    assert select_backend(cpu).name == "sdpa"
    log = caplog.text
    assert "skipping attention backend 'triton'" in log and "TRITON_INTERPRET=1" in log
    assert "skipping attention backend 'flashinfer'" in log
    caplog.clear()
    # softcap: sdpa cannot, flex (when importable) or torch can
    chosen = select_backend(config(device="cpu", features={"causal", "softcap"})).name
    assert chosen == ("flex" if get_backend("flex").is_available() else "torch")
    assert "skipping attention backend 'sdpa': feature 'softcap' is not supported" in caplog.text
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    caplog.clear()
    # bf16 on the interpreter is computed in fp32 by the public functions: triton serves it
    assert select_backend(config(dtype=torch.bfloat16, device="cpu")).name == "triton"


def test_capability_queries():
    sdpa, triton_be = get_backend("sdpa"), get_backend("triton")
    assert not sdpa.supports_feature("softcap") and sdpa.supports_feature("alibi")
    assert triton_be.supports_feature("sinks") and triton_be.supports_dtype(torch.float16)
    assert triton_be.supports_head_size(80) and not triton_be.supports_head_size(12)
    with pytest.raises(ValueError, match="unknown feature"):
        sdpa.supports_feature("bogus")
    assert sdpa.validate(config(features={"causal", "softcap", "sinks", "lse"})) == [
        "feature 'lse' is not supported", "feature 'sinks' is not supported", "feature 'softcap' is not supported",
    ]


def test_metadata_from_another_backend_is_rejected():
    g = torch.Generator().manual_seed(0)
    batch = make_paged_batch([(1, 20)], dtype=torch.float32, device=DEVICE, generator=g)
    cfg = config()
    md = get_backend("torch").plan(batch.block_table, batch.seq_lens, batch.query_start_loc, cfg)
    assert isinstance(md, BatchMetadata) and md.query_lens_host == [1]
    with pytest.raises(ValueError, match="planned by backend 'torch'"):
        get_backend("triton").forward(batch.q, batch.k_cache, batch.v_cache, md)


# --- every backend against the reference -------------------------------------------------

FEATURE_CASES = ["causal", "noncausal", "window", "softcap", "alibi", "alibi_sqrt", "sinks", "prefix", "sinks_alibi"]


def _feature(name, num_seqs, g):
    if name == "sinks_alibi":  # position-independent mix (the router's chunked path takes it)
        return {"sinks": torch.randn(4, generator=g).to(DEVICE), "alibi_slopes": torch.rand(4, generator=g).to(DEVICE),
                "softcap": 3.0}
    return feature_kwargs(name, 4, num_seqs, device=DEVICE, generator=g)


# The kernels' features are covered in tests/ops; the adapters over them get a sample.
KERNEL_SAMPLE = ["causal", "noncausal", "window", "prefix", "sinks_alibi"]
BACKEND_CASES = [
    pytest.param(backend, feature, id=f"{backend}-{feature}")
    for backend, features in (
        ("triton", KERNEL_SAMPLE), ("router", KERNEL_SAMPLE), ("torch", FEATURE_CASES), ("sdpa", FEATURE_CASES),
        ("flex", ["causal", "noncausal", "softcap", "alibi_sqrt", "prefix", "sinks_alibi"]),
    )
    for feature in features
]


@pytest.mark.parametrize("backend_name, feature", BACKEND_CASES)
def test_backend_matches_reference(backend_name, feature):
    backend = get_backend(backend_name)
    if not backend.is_available():
        pytest.skip(backend.unavailable_reason())
    g = torch.Generator().manual_seed(zlib.crc32(f"{backend_name}-{feature}".encode()))
    cases = MIXED + ([(7, 3)] if feature == "noncausal" else [])  # cross attention: more queries than keys
    batch = make_paged_batch(cases, dtype=torch.float32, device=DEVICE, generator=g)
    kwargs = _feature(feature, len(cases), g)
    cfg = BackendConfig.for_call(batch.q, batch.k_cache, return_lse=True, **kwargs)
    reasons = backend.validate(cfg)
    if reasons:  # capability gaps are declared, never silently wrong: drop lse and retry
        cfg = BackendConfig.for_call(batch.q, batch.k_cache, **kwargs)
        if backend.validate(cfg):
            assert any(f in r for r in reasons for f in ("softcap", "sinks"))
            pytest.skip(f"{backend_name}: {reasons}")
    want_lse = "lse" in cfg.features
    md = backend.plan(batch.block_table, batch.seq_lens, batch.query_start_loc, cfg)
    out = torch.full_like(batch.q, float("nan"))
    res = backend.forward(batch.q, batch.k_cache, batch.v_cache, md, out=out, return_lse=want_lse, **kwargs)
    got, lse = res if want_lse else (res, None)
    assert got.data_ptr() == out.data_ptr()
    assert_matches_reference(batch, got, lse, kwargs)


def test_torch_backend_fp16_fp8():
    g = torch.Generator().manual_seed(11)
    batch = make_paged_batch(MIXED, dtype=torch.float16, cache_dtype=torch.float8_e4m3fn, device=DEVICE, generator=g)
    kwargs = {"k_scale": 0.5, "v_scale": 1.25}
    for name in ("torch", "sdpa"):
        backend = get_backend(name)
        cfg = BackendConfig.for_call(batch.q, batch.k_cache, **kwargs)
        md = backend.plan(batch.block_table, batch.seq_lens, batch.query_start_loc, cfg)
        out = backend.forward(batch.q, batch.k_cache, batch.v_cache, md, **kwargs)
        assert out.dtype == torch.float16
        assert_matches_reference(batch, out, None, kwargs)


# --- the router -------------------------------------------------------------------------


def test_route_order_groups_and_inverts():
    cases = [(20, 20), (1, 463), (5, 18), (0, 7), (33, 129), (1, 1), (7, 3), (17, 40)]
    qsl = [0]
    for q, _ in cases:
        qsl.append(qsl[-1] + q)
    order = route_order(qsl, [n for _, n in cases])
    assert order.seq_perm_host == [1, 5, 2, 4, 7, 0, 6, 3]  # decode | extend | prefill | empty
    assert order.counts == {"decode": 2, "extend": 3, "prefill": 2, "empty": 1}
    assert order.seq_range("extend") == (2, 5) and order.token_range("decode") == (0, 2)
    n = len(cases)
    assert torch.equal(order.seq_perm[order.seq_inv_perm], torch.arange(n))
    assert torch.equal(order.seq_inv_perm[order.seq_perm], torch.arange(n))
    tokens = torch.arange(qsl[-1])
    routed = tokens[order.token_perm]
    assert torch.equal(routed[order.token_inv_perm], tokens)
    assert routed[:2].tolist() == [20, 1 + 5 + 33 + 20]  # the two decode tokens come first
    assert not order.is_identity
    again = route_order([0, 1, 2, 7, 27], [463, 1, 18, 20])
    assert again.is_identity


@pytest.mark.parametrize(
    "dtype, cache_dtype, feature",
    [
        pytest.param(torch.float32, None, "causal", id="fp32"),
        pytest.param(torch.float32, None, "sinks_alibi", id="fp32-sinks-alibi-softcap"),
        pytest.param(torch.float16, None, "noncausal", id="fp16-noncausal"),
        pytest.param(torch.float32, torch.float8_e4m3fn, "causal", id="fp32-fp8cache"),
    ],
)
def test_router_chunked_extend(dtype, cache_dtype, feature):
    g = torch.Generator().manual_seed(zlib.crc32(f"chunks-{feature}-{dtype}".encode()))
    cases = [(3, 90), (1, 50), (12, 12), (9, 61), (4, 21)]  # extend contexts 87, 52, 17
    batch = make_paged_batch(cases, dtype=dtype, cache_dtype=cache_dtype, device=DEVICE, generator=g)
    kwargs = _feature(feature, len(cases), g)
    if cache_dtype is not None:
        kwargs.update(k_scale=0.5, v_scale=torch.tensor([1.5], device=DEVICE))
    router = get_backend("router")
    cfg = BackendConfig.for_call(batch.q, batch.k_cache, return_lse=True, **kwargs)
    md = router.plan(batch.block_table, batch.seq_lens, batch.query_start_loc, cfg, chunk_tokens=40,
                     block_size=batch.k_cache.shape[1])
    chunks = md.state.parts["extend"].chunks
    assert chunks is not None and len(chunks.context) >= 3  # 156 context keys in chunks of <= 40
    assert all(sum(b - a for a, b in step.ranges) <= 40 for step in chunks.context)
    out = torch.full_like(batch.q, float("nan"))
    got, lse = router.forward(batch.q, batch.k_cache, batch.v_cache, md, out=out, return_lse=True, **kwargs)
    assert got.data_ptr() == out.data_ptr()
    assert_matches_reference(batch, got, lse, kwargs)


def test_router_positional_features_run_extend_unchunked():
    g = torch.Generator().manual_seed(5)
    batch = make_paged_batch([(1, 70), (6, 40)], dtype=torch.float32, device=DEVICE, generator=g)
    router = get_backend("router")
    plain = router.plan(batch.block_table, batch.seq_lens, batch.query_start_loc, config())
    with pytest.raises(ValueError, match="plan with those features"):
        router.forward(batch.q, batch.k_cache, batch.v_cache, plain, sliding_window=8)
    windowed = router.plan(batch.block_table, batch.seq_lens, batch.query_start_loc,
                           config(features={"causal", "window"}))
    assert windowed.state.parts["extend"].chunks is None
    out = router.forward(batch.q, batch.k_cache, batch.v_cache, windowed, sliding_window=8)
    assert_matches_reference(batch, out, None, {"sliding_window": 8})


def test_router_per_layer_call_uses_the_step_plan(monkeypatch):
    """After plan(block_size=...), forward builds nothing from host data and reuses the plan's workspaces
    (what CUDA-graph capture needs), layer after layer, and still matches the reference."""
    g = torch.Generator().manual_seed(23)
    cases = [(12, 12), (3, 90), (1, 50), (9, 61), (1, 7), (4, 21)]  # caller order: prefill first
    batch = make_paged_batch(cases, dtype=torch.float16, device=DEVICE, generator=g)
    second = {name: torch.randn(getattr(batch, name).shape, generator=g).to(DEVICE, torch.float16)
              for name in ("q", "k_cache", "v_cache")}
    layers = [batch, dataclasses.replace(batch, **second)]
    kwargs = _feature("sinks_alibi", len(cases), g)
    router = get_backend("router")
    cfg = BackendConfig.for_call(batch.q, batch.k_cache, return_lse=True, **kwargs)
    md = router.plan(batch.block_table, batch.seq_lens, batch.query_start_loc, cfg, chunk_tokens=40,
                     block_size=batch.k_cache.shape[1])
    plan = md.state
    assert not plan.order.is_identity and len(plan.parts["extend"].chunks.context) >= 3

    def buffers():
        chunks = plan.parts["extend"].chunks
        return {name: t.data_ptr() for name, t in [*plan.workspaces.items(), ("ws_k", chunks.ws_k),
                                                   ("ws_out", chunks.ws_out)]}

    before = buffers()
    assert {"q", "out", "ws_k", "ws_out"} <= set(before)

    def no_host_data(*args, **kw):
        raise AssertionError("a per-layer call built a tensor from host data")

    monkeypatch.setattr(torch, "tensor", no_host_data)
    for layer in layers:  # the layers of one step share the metadata, not q or the cache
        out = torch.full_like(layer.q, float("nan"))
        got, lse = router.forward(layer.q, layer.k_cache, layer.v_cache, md, out=out, return_lse=True, **kwargs)
        monkeypatch.undo()
        assert got.data_ptr() == out.data_ptr()
        assert_matches_reference(layer, got, lse, kwargs)
        monkeypatch.setattr(torch, "tensor", no_host_data)
    after = buffers()
    assert after.pop("lse") and after == before  # the lse workspace is made at the first return_lse call
    monkeypatch.undo()
    with pytest.raises(ValueError, match="plan's config"):  # the workspaces are shaped by the plan's config
        router.forward(batch.q.float(), batch.k_cache.float(), batch.v_cache.float(), md, **kwargs)


@pytest.mark.gpu
def test_router_cuda_graph_capture_replay():
    """The router's per-layer call (decode | chunked extend | prefill, caller's order) captured once and
    replayed on new q and cache contents (same metadata) gives the eager result."""
    g = torch.Generator().manual_seed(31)
    cases = [(300, 300), (1, 5000), (40, 3000), (1, 900), (130, 2200), (1, 1)]
    batch = make_paged_batch(cases, num_q_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
                             device="cuda", generator=g)
    router = get_backend("router")
    cfg = BackendConfig.for_call(batch.q, batch.k_cache)
    md = router.plan(batch.block_table, batch.seq_lens, batch.query_start_loc, cfg, chunk_tokens=2048,
                     block_size=batch.k_cache.shape[1])
    assert len(md.state.parts["extend"].chunks.context) >= 2 and not md.state.order.is_identity
    out = torch.empty_like(batch.q)
    graph = captured(lambda: router.forward(batch.q, batch.k_cache, batch.v_cache, md, out=out))
    for _ in range(2):
        for t in (batch.q, batch.k_cache, batch.v_cache):
            t.copy_(torch.randn(t.shape, generator=g).to(t))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = router.forward(batch.q, batch.k_cache, batch.v_cache, md)
        assert torch.equal(out, eager)
        assert_matches_reference(batch, out, None, {})
