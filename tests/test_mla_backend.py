"""The ``mla`` backend against MLA attention computed directly in float64, and its routing."""

import math
from dataclasses import dataclass

import pytest
import torch

import pagedattn.api as api
import pagedattn.mla as mla
from pagedattn.backends import AUTO_PRIORITY, BackendConfig, get_backend, select_backend
from pagedattn.backends.mla import MLAWeights
from pagedattn.reference import varlen_attention_ref
from pagedattn.testing import TOLERANCES
from tests.conftest import DEVICE

# (query_len, seq_len) per sequence: prefill, decode, extend, spec decode, empty, short prompt, decode
MIXED = [(20, 20), (1, 33), (12, 40), (4, 29), (0, 7), (3, 3), (1, 1)]
@dataclass(frozen=True)
class Dims:
    heads: int = 4
    nope: int = 16
    rope: int = 16
    v: int = 16
    latent: int = 32
    block: int = 16

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.nope + self.rope)


TINY = Dims()
DEEPSEEK = Dims(heads=2, nope=128, rope=64, v=128, latent=512, block=16)  # q/k head 192, v head 128
HEADS, NOPE, ROPE, V_DIM, LATENT, BLOCK = TINY.heads, TINY.nope, TINY.rope, TINY.v, TINY.latent, TINY.block


def make_mla_case(cases, dtype, seed=0, dims=TINY, cache_dtype=None, kv_scale=None):
    """Random latent rows in a shuffled paged cache, random per-head queries and a random kv_b_proj.

    With an fp8 ``cache_dtype`` the cache holds ``randn / kv_scale`` rounded to fp8."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // dims.block) for _, n in cases]
    num_blocks = sum(pages) + 2
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.zeros(len(cases), max(pages), dtype=torch.int32)
    used = 0
    for s, p in enumerate(pages):
        block_table[s, :p] = perm[used:used + p].to(torch.int32)
        used += p
    num_tokens = sum(q for q, _ in cases)
    f = dict(generator=g, dtype=torch.float32)
    case = dict(
        q_nope=torch.randn(num_tokens, dims.heads, dims.nope, **f),
        q_pe=torch.randn(num_tokens, dims.heads, dims.rope, **f),
        # unit-variance K and V after decompression
        kv_b_proj=torch.randn(dims.heads * (dims.nope + dims.v), dims.latent, **f) / math.sqrt(dims.latent),
    )
    case = {k: v.to(dtype=dtype, device=DEVICE) for k, v in case.items()}
    cache = torch.randn(num_blocks, dims.block, dims.latent + dims.rope, **f)
    if cache_dtype is None:
        case["kv_cache"] = cache.to(dtype=dtype, device=DEVICE)
    else:
        case["kv_cache"] = (cache / (1.0 if kv_scale is None else kv_scale)).to(device=DEVICE, dtype=cache_dtype)
    qsl = [0]
    for q, _ in cases:
        qsl.append(qsl[-1] + q)
    case.update(
        block_table=block_table.to(DEVICE),
        seq_lens=torch.tensor([n for _, n in cases], dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
    )
    return case


def mla_attention_ref(case, cases, scale, dims=TINY, kv_scale=None):
    """Decompress every sequence's latent rows with kv_b_proj and attend in float64, causally."""
    f64 = torch.float64
    d = dims
    w = case["kv_b_proj"].to(f64).view(d.heads, d.nope + d.v, d.latent)
    ks, vs = [], []
    for s, (_, n) in enumerate(cases):
        pages = case["block_table"][s, : -(-n // d.block)].long()
        rows = case["kv_cache"][pages].reshape(-1, d.latent + d.rope)[:n].to(f64)
        if case["kv_cache"].dtype == torch.float8_e4m3fn:
            rows = rows * (1.0 if kv_scale is None else float(kv_scale))
        kv = torch.einsum("tl,hdl->thd", rows[:, :d.latent], w)
        ks.append(torch.cat([kv[..., :d.nope], rows[:, None, d.latent:].expand(-1, d.heads, d.rope)], dim=-1))
        vs.append(kv[..., d.nope:])
    cu_k = [0]
    for _, n in cases:
        cu_k.append(cu_k[-1] + n)
    q = torch.cat([case["q_nope"], case["q_pe"]], dim=-1).to(f64)
    out, _ = varlen_attention_ref(q, torch.cat(ks), torch.cat(vs), case["query_start_loc"].cpu(),
                                  torch.tensor(cu_k), scale=scale, causal=True)
    return out


def mla_config(dtype, dims=TINY, fp8=False):
    return BackendConfig(DEVICE, dtype, head_size=dims.nope + dims.rope, num_q_heads=dims.heads, num_kv_heads=1,
                         features={"causal", "fp8"} if fp8 else {"causal"})


def run_backend(case, dtype, dims=TINY, kv_scale=None, **plan_options):
    backend = get_backend("mla")
    fp8 = case["kv_cache"].dtype == torch.float8_e4m3fn
    md = backend.plan(case["block_table"], case["seq_lens"], case["query_start_loc"], mla_config(dtype, dims, fp8),
                      **plan_options)
    weights = MLAWeights.from_kv_b_proj(case["kv_b_proj"], num_heads=dims.heads, qk_nope_head_dim=dims.nope,
                                        v_head_dim=dims.v)
    out = torch.full((case["q_nope"].shape[0], dims.heads, dims.v), float("nan"), dtype=dtype, device=DEVICE)
    res = backend.forward(case["q_nope"], case["q_pe"], case["kv_cache"], md, weights=weights, scale=dims.scale,
                          kv_scale=kv_scale, out=out)
    assert res is out
    return out


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")])
@pytest.mark.parametrize("cases", [
    pytest.param(MIXED, id="mixed"),
    pytest.param([(1, 33), (12, 40), (20, 20), (4, 29)], id="interleaved"),
    pytest.param([(1, 17), (8, 21), (2, 2)], id="absorbed-only"),
    pytest.param([(9, 9), (17, 50)], id="decompressed-only"),
])
def test_mla_backend_matches_reference(cases, dtype):
    case = make_mla_case(cases, dtype)
    out = run_backend(case, dtype)
    ref = mla_attention_ref(case, cases, TINY.scale)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.cpu().double(), ref, atol=atol, rtol=rtol)


def test_mla_backend_deepseek_dims():
    """The DeepSeek-V2 head shapes: latent 512 + rope 64, decompressed q/k head 192, v head 128."""
    cases = [(9, 9), (1, 20), (3, 12), (10, 24)]
    case = make_mla_case(cases, torch.float32, seed=3, dims=DEEPSEEK)
    out = run_backend(case, torch.float32, dims=DEEPSEEK)
    ref = mla_attention_ref(case, cases, DEEPSEEK.scale, dims=DEEPSEEK)
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(out.cpu().double(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype, kv_scale", [
    pytest.param(torch.float32, 0.5, id="fp32-scale-float"),
    pytest.param(torch.float16, torch.tensor([0.25]), id="fp16-scale-tensor"),
])
def test_mla_backend_fp8_cache(dtype, kv_scale):
    if isinstance(kv_scale, torch.Tensor):
        kv_scale = kv_scale.to(DEVICE)
    case = make_mla_case(MIXED, dtype, seed=5, cache_dtype=torch.float8_e4m3fn, kv_scale=kv_scale)
    out = run_backend(case, dtype, kv_scale=kv_scale)
    ref = mla_attention_ref(case, MIXED, TINY.scale, kv_scale=kv_scale)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.cpu().double(), ref, atol=atol, rtol=rtol)
    # an fp8 cache under a config without "fp8" is refused by name
    backend = get_backend("mla")
    md = backend.plan(case["block_table"], case["seq_lens"], case["query_start_loc"], mla_config(dtype))
    weights = MLAWeights.from_kv_b_proj(case["kv_b_proj"], num_heads=HEADS, qk_nope_head_dim=NOPE, v_head_dim=V_DIM)
    with pytest.raises(TypeError, match="kv_cache"):
        backend.forward(case["q_nope"], case["q_pe"], case["kv_cache"], md, weights=weights)


def counting(monkeypatch):
    """Wrap mla_decode and varlen_attention; record each call's per-sequence query lengths."""
    calls = {"mla_decode": [], "varlen_attention": []}
    real_decode, real_varlen = mla.mla_decode, api.varlen_attention

    def decode(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, **kw):
        calls["mla_decode"].append((query_start_loc.diff().tolist(), seq_lens.tolist()))
        return real_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, **kw)

    def varlen(q, k, v, cu_q, cu_k, **kw):
        calls["varlen_attention"].append((cu_q.diff().tolist(), cu_k.diff().tolist(), q.shape[2], v.shape[2]))
        return real_varlen(q, k, v, cu_q, cu_k, **kw)

    monkeypatch.setattr(mla, "mla_decode", decode)
    monkeypatch.setattr(api, "varlen_attention", varlen)
    return calls


def test_mla_backend_routes_each_phase(monkeypatch):
    calls = counting(monkeypatch)
    case = make_mla_case(MIXED, torch.float32)
    run_backend(case, torch.float32)
    # decode, spec decode and the 3-token prompt: one absorbed launch, in batch order
    assert calls["mla_decode"] == [([1, 4, 3, 1], [33, 29, 3, 1])]
    # prefill and extend: one decompressed launch with q/k heads nope + rope and v heads v_head_dim
    assert calls["varlen_attention"] == [([20, 12], [20, 40], NOPE + ROPE, V_DIM)]


def test_mla_backend_slots_planned():
    """With block_size the plan holds the cache rows; the layer call reuses them."""
    case = make_mla_case(MIXED, torch.float32)
    backend = get_backend("mla")
    md = backend.plan(case["block_table"], case["seq_lens"], case["query_start_loc"], mla_config(torch.float32),
                      block_size=BLOCK)
    part = md.state.parts["decompressed"]
    slots = part.slots
    assert slots is not None and slots.shape == (20 + 40,)
    weights = MLAWeights.from_kv_b_proj(case["kv_b_proj"], num_heads=HEADS, qk_nope_head_dim=NOPE, v_head_dim=V_DIM)
    out = backend.forward(case["q_nope"], case["q_pe"], case["kv_cache"], md, weights=weights)
    assert part.slots is slots
    torch.testing.assert_close(out, run_backend(case, torch.float32), atol=0, rtol=0)


def test_mla_backend_decode_threshold(monkeypatch):
    calls = counting(monkeypatch)
    case = make_mla_case(MIXED, torch.float32)
    run_backend(case, torch.float32, decode_threshold=1)
    assert calls["mla_decode"] == [([1, 1], [33, 1])]
    assert calls["varlen_attention"] == [([20, 12, 4, 3], [20, 40, 29, 3], NOPE + ROPE, V_DIM)]
    with pytest.raises(ValueError, match="decode_threshold"):
        run_backend(case, torch.float32, decode_threshold=9)


def test_mla_backend_chosen_by_name_only(monkeypatch):
    monkeypatch.delenv("PAGEDATTN_BACKEND", raising=False)
    assert "mla" not in AUTO_PRIORITY
    cfg = mla_config(torch.float32)
    assert select_backend(cfg, name="mla").name == "mla"
    assert select_backend(cfg).name != "mla"
    bad = BackendConfig(DEVICE, torch.float32, head_size=32, num_q_heads=4, num_kv_heads=2, features={"window"})
    reasons = get_backend("mla").validate(bad)
    assert any("num_kv_heads" in r for r in reasons) and any("window" in r for r in reasons)
    with pytest.raises(ValueError, match="num_kv_heads"):
        select_backend(bad, name="mla")


def test_mla_backend_rejects_mismatched_inputs():
    case = make_mla_case(MIXED, torch.float32)
    backend = get_backend("mla")
    md = backend.plan(case["block_table"], case["seq_lens"], case["query_start_loc"], mla_config(torch.float32))
    weights = MLAWeights.from_kv_b_proj(case["kv_b_proj"], num_heads=HEADS, qk_nope_head_dim=NOPE, v_head_dim=V_DIM)
    with pytest.raises(TypeError, match="weights"):
        backend.forward(case["q_nope"], case["q_pe"], case["kv_cache"], md, weights=case["kv_b_proj"])
    with pytest.raises(TypeError, match="q_nope"):
        backend.forward(case["q_nope"].half(), case["q_pe"], case["kv_cache"], md, weights=weights)
    with pytest.raises(ValueError, match="kv_cache"):
        backend.forward(case["q_nope"], case["q_pe"], case["kv_cache"][..., :-16], md, weights=weights)
    with pytest.raises(ValueError, match="kv_b_proj"):
        MLAWeights.from_kv_b_proj(case["kv_b_proj"][:-1], num_heads=HEADS, qk_nope_head_dim=NOPE, v_head_dim=V_DIM)
