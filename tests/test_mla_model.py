"""The tiny MLA decoder generating through the mla backend, against a float64 full recomputation."""

import math

import pytest
import torch

import pagedattn.api as api
import pagedattn.mla as mla
from pagedattn.engine.mla_model import MLA_PRESETS, MLAStepper, random_mla_model
from pagedattn.testing import TOLERANCES
from tests.conftest import DEVICE

PROMPTS = [list(range(5, 18)), [7, 3, 9], [(11 * i) % 128 for i in range(21)], [42]]  # 13, 3, 21, 1 tokens


def _rms(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, positions, theta):
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half))
    f = positions.double()[:, None] * inv_freq[None]
    cos, sin = f.cos()[:, None], f.sin()[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def reference_logits(model, ids: list) -> torch.Tensor:
    """The last token's logits of ``ids``, every layer's attention over K/V decompressed from the
    latent (no cache, no absorption), in float64."""
    cfg = model.config
    d = lambda p: p.detach().cpu().double()  # noqa: E731
    n, h = len(ids), cfg.num_heads
    nope, rope, v_dim, lat = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    pos = torch.arange(n)
    x = d(model.embed)[torch.tensor(ids)]
    residual = torch.zeros_like(x)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for layer in model.layers:
        a = layer.attn
        residual = residual + x
        hs = _rms(residual, d(layer.input_norm.weight), cfg.rms_norm_eps)
        q = (hs @ d(a.q_proj).t()).view(n, h, nope + rope)
        ckv = hs @ d(a.kv_a_proj).t()
        c_kv = _rms(ckv[:, :lat], d(a.kv_a_norm.weight), cfg.rms_norm_eps)
        k_pe = _rope(ckv[:, None, lat:], pos, cfg.rope_theta).expand(n, h, rope)
        q = torch.cat([q[..., :nope], _rope(q[..., nope:], pos, cfg.rope_theta)], dim=-1)
        kv = (c_kv @ d(a.kv_b_proj).t()).view(n, h, nope + v_dim)
        k = torch.cat([kv[..., :nope], k_pe], dim=-1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(nope + rope)
        p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", p, kv[..., nope:]).reshape(n, h * v_dim)
        x = o @ d(a.o_proj).t()
        residual = residual + x
        hs = _rms(residual, d(layer.post_norm.weight), cfg.rms_norm_eps)
        gate, up = (hs @ d(layer.mlp.gate_up_weight).t()).chunk(2, dim=-1)
        x = (torch.nn.functional.silu(gate) * up) @ d(layer.mlp.down_weight).t()
    hs = _rms(residual + x, d(model.norm.weight), cfg.rms_norm_eps)
    return hs[-1] @ d(model.lm_head).t()


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")])
def test_tiny_mla_generates_like_full_recomputation(dtype, monkeypatch):
    calls = {"mla_decode": 0, "varlen_attention": 0}
    for mod, name in ((mla, "mla_decode"), (api, "varlen_attention")):
        real = getattr(mod, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(mod, name, counted)
    model = random_mla_model(MLA_PRESETS["tiny-mla"], device=DEVICE, dtype=dtype, seed=1)
    stepper = MLAStepper(model, num_seqs=len(PROMPTS), max_len=32, block_size=8, chunk_tokens=10)
    out = stepper.generate(PROMPTS, max_tokens=3)
    assert [len(o) for o in out] == [3, 3, 3, 3]
    # the steps mix prefill chunks, an extend, short extends (absorbed) and decodes
    cases = [c for _, step_cases, _, _ in stepper.step_log for c in step_cases]
    assert (10, 10) in cases and (10, 20) in cases and (3, 13) in cases and (1, 4) in cases
    assert calls["mla_decode"] > 0 and calls["varlen_attention"] > 0
    atol, rtol = TOLERANCES[dtype]
    history = [list(p) + o for p, o in zip(PROMPTS, out)]
    checked = 0
    for seqs, step_cases, sampled, logits in stepper.step_log:
        seq_len = {s: n for s, (_, n) in zip(seqs, step_cases)}
        for row, s in enumerate(sampled):
            ref = reference_logits(model, history[s][:seq_len[s]])
            torch.testing.assert_close(logits[row].cpu().double(), ref, atol=atol, rtol=rtol)
            assert history[s][seq_len[s]] == int(ref.argmax())  # the greedy token
            checked += 1
    assert checked == 12


def test_tiny_mla_sdpa_baseline_generates_the_same_tokens():
    """The SDPA baseline over decompressed K/V and the mla backend agree (fp32, same weights)."""
    model = random_mla_model(MLA_PRESETS["tiny-mla"], device=DEVICE, dtype=torch.float32, seed=2)
    outs, logs = [], []
    for attention in ("mla", "sdpa"):
        stepper = MLAStepper(model, num_seqs=len(PROMPTS), max_len=32, block_size=8, chunk_tokens=10,
                             attention=attention)
        outs.append(stepper.generate(PROMPTS, max_tokens=3))
        logs.append(stepper.step_log)
    assert outs[0] == outs[1]
    lat = stepper.latency()
    assert 0 < lat["ttft"] and 0 < lat["tpot"] and len(stepper.token_times[0]) == 3
    atol, rtol = TOLERANCES[torch.float32]
    for (_, _, _, a), (_, _, _, b) in zip(*logs):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
    with pytest.raises(ValueError, match="attention"):
        MLAStepper(model, num_seqs=1, max_len=32, attention="flash")
