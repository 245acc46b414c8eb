"""GPU suite of the MLA model in the engine (``pytest -m gpu``): DeepSeek-V2-Lite's shape with 2
layers, random bf16 weights. CUDA-graph decode with the mla backend against eager decode and
against SDPA over decompressed K/V (also in graphs), prompt logits against the float64
recomputation, ``bench e2e --quick`` on the tiny MLA preset.

Two bf16 runs that round differently may part at a near tie of the top two logits; the token
comparisons accept that only there (``tests/test_gpu_engine.py``'s rule).
"""

import json
from dataclasses import replace

import pytest
import torch

from pagedattn.engine.config import MLA_PRESETS, EngineConfig
from pagedattn.engine.llm import Engine
from pagedattn.engine.sequence import SamplingParams
from tests.test_gpu_engine import assert_same_or_near_tie
from tests.test_mla_model import reference_logits

pytestmark = pytest.mark.gpu

CFG = replace(MLA_PRESETS["deepseek-v2-lite"], num_layers=2)
GRAPH_SIZES = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def model():
    from pagedattn.engine.mla_model import random_mla_model

    return random_mla_model(CFG, device="cuda", dtype=torch.bfloat16, seed=0)


def make_engine(model, attention: str, **kw) -> Engine:
    # the 70-token prompt is prefilled in chunks of 48 beside decodes; 5 sequences pad bucket 8
    ecfg = EngineConfig(max_model_len=160, max_num_seqs=8, max_num_batched_tokens=48, attention=attention,
                        device="cuda", dtype="bfloat16", cuda_graph_sizes=GRAPH_SIZES, **kw)
    return Engine(model, CFG, ecfg, eos_token_ids=())


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in lengths]


def generate(engine: Engine, ps, max_tokens: int):
    engine.step_records = []
    seqs = engine.generate(ps, [SamplingParams(max_tokens=max_tokens)] * len(ps))
    records, engine.step_records = engine.step_records, None
    return [s.output_ids for s in seqs], records


def test_mla_cuda_graph_decode_matches_eager_and_sdpa_gpu(model):
    ps = prompts([5, 17, 70, 2, 33], seed=1)
    graph = make_engine(model, "pagedattn")
    assert sorted(graph.runner.graphs) == GRAPH_SIZES, graph.runner.graph_note
    got, records = generate(graph, ps, 24)
    assert sum(r["graph"] for r in records) >= 20, records
    sizes = {r["num_seqs"] for r in records if r["graph"]}
    assert 5 in sizes and len(sizes) >= 2, sizes  # bucket 8 with padding rows, then fewer as sequences finish
    eager = make_engine(model, "pagedattn", enforce_eager=True)
    expected, eager_records = generate(eager, ps, 24)
    assert not any(r["graph"] for r in eager_records)
    sdpa = make_engine(model, "sdpa")
    assert sorted(sdpa.runner.graphs) == GRAPH_SIZES, sdpa.runner.graph_note
    baseline, sdpa_records = generate(sdpa, ps, 24)
    assert sum(r["graph"] for r in sdpa_records) >= 20
    for p, g, e, b in zip(ps, got, expected, baseline):
        assert_same_or_near_tie(eager, p, g, e)
        assert_same_or_near_tie(eager, p, b, e)


def test_mla_logits_match_float64_gpu(model):
    """A 150-token prompt prefilled in chunks of 48 (decompressed prefill and extends, one absorbed
    6-token extend), both attentions against the float64 recomputation of the same weights."""
    ids = prompts([150], seed=3)[0]
    ref = reference_logits(model, ids)
    for attention in ("pagedattn", "sdpa"):
        logits = make_engine(model, attention, enforce_eager=True).prompt_logits(ids)[-1].double().cpu()
        assert (logits - ref).abs().max() <= 0.05 * ref.abs().max(), attention  # bf16 end to end


def test_bench_e2e_quick_mla_gpu(tmp_path):
    from pagedattn.cli import main

    out = tmp_path / "e2e.json"
    assert main(["bench", "e2e", "--quick", "--model", "tiny-mla", "--json", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert [r["attention"] for r in records] == ["pagedattn"] * 3 + ["sdpa"] * 3
    for r in records:  # every decode step of both attentions is a graph replay
        assert r["decode_steps"] > 0 and r["graph_steps"] == r["decode_steps"], r
        assert r["tpot_ms"] > 0 and r["forward_ms"] > 0
