"""The ``mla`` backend against MLA attention computed directly in float64, and its routing."""

import math

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
HEADS, NOPE, ROPE, V_DIM, LATENT, BLOCK = 4, 16, 16, 16, 32, 16


def make_mla_case(cases, dtype, seed=0):
    """Random latent rows in a shuffled paged cache, random per-head queries and a random kv_b_proj."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // BLOCK) for _, n in cases]
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
        kv_cache=torch.randn(num_blocks, BLOCK, LATENT + ROPE, **f),
        q_nope=torch.randn(num_tokens, HEADS, NOPE, **f),
        q_pe=torch.randn(num_tokens, HEADS, ROPE, **f),
        # unit-variance K and V after decompression
        kv_b_proj=torch.randn(HEADS * (NOPE + V_DIM), LATENT, **f) / math.sqrt(LATENT),
    )
    case = {k: v.to(dtype=dtype, device=DEVICE) for k, v in case.items()}
    qsl = [0]
    for q, _ in cases:
        qsl.append(qsl[-1] + q)
    case.update(
        block_table=block_table.to(DEVICE),
        seq_lens=torch.tensor([n for _, n in cases], dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
    )
    return case


def mla_attention_ref(case, cases, scale):
    """Decompress every sequence's latent rows with kv_b_proj and attend in float64, causally."""
    f64 = torch.float64
    w = case["kv_b_proj"].to(f64).view(HEADS, NOPE + V_DIM, LATENT)
    ks, vs = [], []
    for s, (_, n) in enumerate(cases):
        pages = case["block_table"][s, : -(-n // BLOCK)].long()
        rows = case["kv_cache"][pages].reshape(-1, LATENT + ROPE)[:n].to(f64)
        kv = torch.einsum("tl,hdl->thd", rows[:, :LATENT], w)
        ks.append(torch.cat([kv[..., :NOPE], rows[:, None, LATENT:].expand(-1, HEADS, ROPE)], dim=-1))
        vs.append(kv[..., NOPE:])
    cu_k = [0]
    for _, n in cases:
        cu_k.append(cu_k[-1] + n)
    q = torch.cat([case["q_nope"], case["q_pe"]], dim=-1).to(f64)
    out, _ = varlen_attention_ref(q, torch.cat(ks), torch.cat(vs), case["query_start_loc"].cpu(),
                                  torch.tensor(cu_k), scale=scale, causal=True)
    return out


def mla_config(dtype):
    return BackendConfig(DEVICE, dtype, head_size=NOPE + ROPE, num_q_heads=HEADS, num_kv_heads=1)


def run_backend(case, dtype, **plan_options):
    backend = get_backend("mla")
    md = backend.plan(case["block_table"], case["seq_lens"], case["query_start_loc"], mla_config(dtype),
                      **plan_options)
    weights = MLAWeights.from_kv_b_proj(case["kv_b_proj"], num_heads=HEADS, qk_nope_head_dim=NOPE, v_head_dim=V_DIM)
    out = torch.full((case["q_nope"].shape[0], HEADS, V_DIM), float("nan"), dtype=dtype, device=DEVICE)
    res = backend.forward(case["q_nope"], case["q_pe"], case["kv_cache"], md, weights=weights,
                          scale=1.0 / math.sqrt(NOPE + ROPE), out=out)
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
    ref = mla_attention_ref(case, cases, 1.0 / math.sqrt(NOPE + ROPE))
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.cpu().double(), ref, atol=atol, rtol=rtol)


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
