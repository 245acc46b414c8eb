"""The tiny MLA decoder generating through the engine (continuous batching, chunked prefill,
mixed steps, preemption, emulated CUDA-graph decode), with the mla backend and with SDPA over
decompressed K/V, against a float64 full recomputation; ``bench e2e --quick`` on it."""

import math

import pytest
import torch

import pagedattn.api as api
import pagedattn.mla as mla
from pagedattn.engine import LLM, SamplingParams
from pagedattn.testing import TOLERANCES
from tests.conftest import DEVICE

PROMPTS = [list(range(5, 18)), [7, 3, 9], [(11 * i) % 128 for i in range(21)], [42]]  # 13, 3, 21, 1 tokens
# 14 tokens a step, 4 sequences: a 13-token prefill chunk (decompressed), a 2-token extend
# (absorbed), a 10-token extend (decompressed), decodes beside them, then pure decode steps of 3
# and 1 sequences (graph buckets 4 and 2, both padded)
ENGINE = dict(device=DEVICE, max_model_len=32, max_num_seqs=4, max_num_batched_tokens=14, block_size=8,
              cuda_graph_sizes=[2, 4])
POISON = 100.0  # the latent cache before any write: a row read but never written moves the logits far


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




def generate_logged(llm, prompts, max_tokens: int):
    """Greedy outputs and, per step, the scheduled ``(sequence index, new tokens, seq_len)`` and the
    logits ``[sampled, vocab]`` of the sequences that sampled (batch order)."""
    runner, log = llm.engine.runner, []
    forward = runner.forward

    def logged(batch, all_tokens=False):
        logits = forward(batch, all_tokens=all_tokens)
        log.append(([(s, n, s.num_computed + n) for s, n in zip(batch.seqs, batch.num_new)],
                    [s for i, s in enumerate(batch.seqs) if batch.samples(i)], logits, runner.last_used_graph))
        return logits

    runner.forward = logged
    try:
        seqs = llm.engine.generate(prompts, [SamplingParams(max_tokens=max_tokens)] * len(prompts))
    finally:
        runner.forward = forward
    index = {id(s): i for i, s in enumerate(seqs)}
    steps = [([(index[id(s)], n, length) for s, n, length in cases], [index[id(s)] for s in sampled], logits, graph)
             for cases, sampled, logits, graph in log]
    return [s.output_ids for s in seqs], steps


@pytest.mark.parametrize("attention, dtype, extra", [
    pytest.param("pagedattn", torch.float32, {}, id="mla-fp32"),
    pytest.param("pagedattn", torch.float16, {"graphs": True}, id="mla-fp16-graphs"),
    pytest.param("pagedattn", torch.float32, {"graphs": True}, id="mla-fp32-graphs"),
    pytest.param("pagedattn", torch.float32, {"block_size": 4, "num_blocks": 10}, id="mla-fp32-preempt"),
    pytest.param("sdpa", torch.float32, {}, id="sdpa-fp32"),
    pytest.param("sdpa", torch.float32, {"graphs": True}, id="sdpa-fp32-graphs"),
])
def test_tiny_mla_engine_matches_full_recomputation(attention, dtype, extra, monkeypatch):
    """Every sampled row's logits and greedy token against the float64 recomputation of its sequence so far."""
    calls = {"mla_decode": 0, "varlen_attention": 0}
    for mod, name in ((mla, "mla_decode"), (api, "varlen_attention")):
        real = getattr(mod, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(mod, name, counted)
    extra = dict(extra)
    graphs = extra.pop("graphs", False)
    llm = LLM("tiny-mla", attention=attention, dtype=dtype, seed=1, **dict(ENGINE, **extra))
    runner = llm.engine.runner
    if graphs:  # the replays run the captured forward over the static buffers (the CPU has no graphs)
        runner.capture_graphs(emulate=True)
    with torch.inference_mode():  # the engine made the cache in inference mode
        runner.attn.kv_cache.fill_(POISON)
    out, steps = generate_logged(llm, PROMPTS, max_tokens=3)
    assert [len(o) for o in out] == [3, 3, 3, 3]
    cases = {c[1:] for step_cases, _, _, _ in steps for c in step_cases}
    if "block_size" not in extra:
        assert {(13, 13), (2, 3), (10, 21), (1, 5)} <= cases, cases  # prefill, short and long extends, decode
        assert any(len({n > 1 for _, n, _ in c}) == 2 for c, _, _, _ in steps)  # a mixed step
    else:
        assert llm.engine.scheduler.num_preemptions > 0  # a sequence is recomputed from its tokens
    graph_sizes = [len(c) for c, _, _, graph in steps if graph]
    assert graph_sizes == ([3, 2] if graphs else []), graph_sizes  # buckets 4 (a padding row) and 2
    if attention == "pagedattn":
        assert calls["mla_decode"] > 0 and calls["varlen_attention"] > 0
    else:
        assert calls == {"mla_decode": 0, "varlen_attention": 0}
    model = llm.model
    atol, rtol = TOLERANCES[dtype]
    history = [list(p) + o for p, o in zip(PROMPTS, out)]
    checked = 0
    for step_cases, sampled, logits, _ in steps:
        seq_len = {s: n for s, _, n in step_cases}
        for row, s in enumerate(sampled):
            ref = reference_logits(model, history[s][:seq_len[s]])
            torch.testing.assert_close(logits[row].cpu().double(), ref, atol=atol, rtol=rtol)
            assert history[s][seq_len[s]] == int(ref.argmax())  # the greedy token
            checked += 1
    assert checked == 12


def test_tiny_mla_refusals():
    for attention in ("pagedattn-2d", "flashinfer"):
        with pytest.raises(ValueError, match=f"attention '{attention}' cannot serve the MLA model"):
            LLM("tiny-mla", attention=attention, device=DEVICE, max_model_len=32)
    from pagedattn.engine.config import PRESETS
    from pagedattn.engine.weights import load_model, random_model

    with pytest.raises(ValueError, match="std"):
        random_model(PRESETS["tiny-mla"], std=0.1)
    with pytest.raises(ValueError, match="folder"):
        load_model(PRESETS["tiny-mla"], "some/folder")


def test_bench_e2e_quick_mla(tmp_path):
    import json

    from pagedattn.bench.e2e import main

    out = tmp_path / "e2e.json"
    assert main(["--quick", "--model", "tiny-mla", "--no-batch", "--attention", "pagedattn,pagedattn-2d,sdpa",
                 "--json", str(out), "--markdown", str(tmp_path / "e2e.md")]) == 0
    records = json.loads(out.read_text())["records"]
    assert [(r["attention"], r["output_len"]) for r in records] == [("pagedattn", 2), ("pagedattn", 4),
                                                                     ("pagedattn-2d", 0), ("sdpa", 2), ("sdpa", 4)]
    timed = [r for r in records if "status" not in r]
    assert all(r["tpot_ms"] > 0 and r["decode_steps"] == r["output_len"] - 1 for r in timed)
    assert "mla backend" in timed[0]["attention_note"] and "decompressed" in timed[-1]["attention_note"]
    assert records[2]["status"].startswith("not available") and "MLA" in records[2]["status"]
    # the floor counts the latent rows: 2 layers x (32 + 16) values x 4 bytes per token
    assert timed[0]["kv_gb"] == pytest.approx((12 + 1) * 2 * 48 * 4 / 1e9)
    assert "| attention |" in (tmp_path / "e2e.md").read_text()
