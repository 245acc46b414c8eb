"""Backends: selection (name, environment, automatic fallback) and every backend against the
reference. Interpreter-sized."""

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
from pagedattn.reference import paged_attention_ref
from pagedattn.testing import TOLERANCES, feature_kwargs, make_paged_batch
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
    assert {"triton", "torch", "sdpa", "flex", "flashinfer", "mla", "helion"} <= set(list_backends())
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
    if name == "sinks_alibi":  # three score modifiers at once
        return {"sinks": torch.randn(4, generator=g).to(DEVICE), "alibi_slopes": torch.rand(4, generator=g).to(DEVICE),
                "softcap": 3.0}
    return feature_kwargs(name, 4, num_seqs, device=DEVICE, generator=g)


# The kernels' features are covered in tests/ops; the adapters over them get a sample.
KERNEL_SAMPLE = ["causal", "noncausal", "window", "prefix", "sinks_alibi"]
BACKEND_CASES = [
    pytest.param(backend, feature, id=f"{backend}-{feature}")
    for backend, features in (
        ("triton", KERNEL_SAMPLE), ("torch", FEATURE_CASES), ("sdpa", FEATURE_CASES),
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
