"""The engine on the CPU interpreter: logits and greedy tokens against transformers, continuous
batching with chunked prefill and preemption against each prompt alone, the block manager, the
scheduler's order and budget, the CLI and bad input."""

import pytest
import torch

from pagedattn.engine import LLM, SamplingParams
from pagedattn.engine.block_manager import BlockManager
from pagedattn.engine.config import EngineConfig
from pagedattn.engine.scheduler import Scheduler
from pagedattn.engine.sequence import Sequence, Status
from pagedattn.testing import TOLERANCES

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def save_checkpoint(path, kind: str = "llama", seed: int = 0):
    """A tiny random transformers model saved as config.json + model.safetensors; returns it (fp32, eval)."""
    torch.manual_seed(seed)
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))
    elif kind == "qwen3-tied":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=True))
    else:
        extra = {"rope_scaling": LLAMA3_ROPE} if kind == "llama3-rope" else {}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, **extra))
    model = model.eval()
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return save_checkpoint(path), str(path)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(
    "kind, budget",
    [
        pytest.param("llama", 2048, id="llama"),
        pytest.param("llama3-rope", 7, id="llama3-rope-chunked"),  # chunks of 7: prefill, then extends
        pytest.param("qwen2", 2048, id="qwen2-bias"),
        pytest.param("qwen3-tied", 2048, id="qwen3-qknorm-tied"),
    ],
)
def test_logits_match_transformers(tmp_path, kind, budget):
    ref_model = save_checkpoint(tmp_path, kind)
    llm = LLM(str(tmp_path), device="cpu", max_model_len=64, max_num_batched_tokens=budget)
    ids = prompt(19, seed=1)
    logits = llm.prompt_logits(ids)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(logits, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("kind", ["llama", "llama3-rope"])
def test_greedy_matches_transformers(tmp_path, kind):
    ref_model = save_checkpoint(tmp_path, kind, seed=3)
    llm = LLM(str(tmp_path), device="cpu", max_model_len=64)
    ids = prompt(11, seed=2)
    out = llm.generate([ids], max_tokens=8)[0]
    with torch.no_grad():
        ref = ref_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):]
    assert out.token_ids == ref.tolist()
    assert out.finish_reason == "length" and out.text  # byte tokenizer: no tokenizer files in the folder


@pytest.mark.parametrize(
    "attention, block_size, num_blocks",
    [
        pytest.param("pagedattn", 4, 9, id="pagedattn-preempt"),  # pages run out: preemption and recompute
        pytest.param("sdpa", 16, None, id="sdpa"),
    ],
)
def test_continuous_batching_matches_alone(llama, attention, block_size, num_blocks):
    _, path = llama
    prompts = [prompt(n, seed=10 + n) for n in (5, 13, 22, 9)]
    alone = LLM(path, device="cpu", max_model_len=48, attention="sdpa")  # fast; the backends agree (below)
    expected = [alone.generate([p], max_tokens=5)[0].token_ids for p in prompts]
    # 3 sequences at most, 8 tokens a step: prompts are chunked and mixed with decodes
    llm = LLM(path, device="cpu", max_model_len=48, attention=attention, max_num_seqs=3,
              max_num_batched_tokens=8, block_size=block_size, num_blocks=num_blocks)
    got = [o.token_ids for o in llm.generate(prompts, max_tokens=5)]
    assert got == expected
    if num_blocks is not None:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.blocks.num_free_blocks == llm.config.num_blocks  # every page returned


GRAPH_KW = dict(device="cpu", max_model_len=32, max_num_seqs=4, max_num_batched_tokens=10, cuda_graph_sizes=[2, 4])


@pytest.fixture(scope="module")
def graph_case(llama):
    """Prompts and their eager tokens (SDPA: the backends agree, see test_attention_backends_agree)."""
    _, path = llama
    ps = [prompt(n, seed=20 + n) for n in (2, 5, 9)]
    return ps, [o.token_ids for o in LLM(path, attention="sdpa", **GRAPH_KW).generate(ps, max_tokens=4)]


@pytest.mark.parametrize("attention", ["pagedattn", "pagedattn-2d", "sdpa"])
def test_graph_decode_path_matches_eager(llama, graph_case, attention, monkeypatch):
    """The CUDA-graph decode path (static buffers, bucket padding, persistent plan.update, the SDPA
    row layout) with replays emulated by running the same forward, against eager decode. Every
    graph step stages its inputs in the same host buffers (pinned only with CUDA) and copies
    them into the same device buffers, which the static views read."""
    _, path = llama
    ps, expected = graph_case
    llm = LLM(path, attention=attention, **GRAPH_KW)
    runner = llm.engine.runner
    runner.capture_graphs(emulate=True)
    inputs = runner.graph_inputs
    buffers = [inputs.ints, inputs.lens, inputs.block_table, inputs.host_ints, inputs.host_lens, inputs.host_table]
    ptrs = [b.data_ptr() for b in buffers]
    assert not any(b.is_pinned() for b in buffers[3:])  # the CPU: nothing pinned
    writes = []
    write = inputs.write
    monkeypatch.setattr(inputs, "write", lambda host, select: (writes.append(len(select)), write(host, select)))
    llm.engine.step_records = []
    got = [o.token_ids for o in llm.generate(ps, max_tokens=4)]
    assert got == expected
    graph_sizes = [r["num_seqs"] for r in llm.engine.step_records if r["graph"]]
    assert 3 in graph_sizes and len(graph_sizes) >= 2  # 3 sequences padded to bucket 4
    assert writes == graph_sizes  # one staging write per graph step
    assert [b.data_ptr() for b in buffers] == ptrs
    for name, view in runner.static.items():
        backing = inputs.block_table if name == "block_table" else inputs.ints if view.dtype == torch.int64 else inputs.lens
        assert view.untyped_storage().data_ptr() == backing.untyped_storage().data_ptr(), name
    assert torch.equal(inputs.ints, inputs.host_ints) and torch.equal(inputs.lens, inputs.host_lens)  # last copy landed
    if attention == "pagedattn":
        assert runner.graph_plan.path == "persistent"


def test_attention_backends_agree(llama):
    _, path = llama
    ids = prompt(9, seed=5)
    tokens = {a: LLM(path, device="cpu", max_model_len=32, attention=a).generate([ids], max_tokens=4)[0].token_ids
              for a in ("pagedattn", "pagedattn-2d", "sdpa")}
    assert tokens["pagedattn"] == tokens["pagedattn-2d"] == tokens["sdpa"]


def test_block_manager_accounting():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = Sequence([1] * 6, SamplingParams()), Sequence([1] * 3, SamplingParams())
    bm.allocate(a, 6)
    assert len(a.block_table) == 2 and bm.num_free_blocks == 8
    bm.allocate(a, 8)  # still two pages
    assert len(a.block_table) == 2
    bm.allocate(a, 9)
    bm.allocate(b, 16)
    assert len(b.block_table) == 4 and bm.num_free_blocks == 3
    assert len(set(a.block_table + b.block_table)) == 7  # no page twice
    assert bm.slot(a, 5) == a.block_table[1] * 4 + 1
    assert not bm.can_allocate(b, 32) and bm.blocks_needed(b, 32) == 4
    with pytest.raises(RuntimeError, match="out of KV-cache pages"):
        bm.allocate(b, 32)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 6
    bm.free(b)
    assert bm.num_free_blocks == 10


def test_scheduler_order_and_budget():
    cfg = EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=10, block_size=4)
    sched = Scheduler(cfg, BlockManager(cfg.num_blocks, cfg.block_size))
    seqs = [Sequence(list(range(n)), SamplingParams(max_tokens=3)) for n in (3, 12, 6)]
    for s in seqs:
        sched.add(s)
    kinds = []
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch.num_tokens <= 10
        order = ["decode"] * batch.num_decode + ["extend"] * batch.num_extend + ["prefill"] * batch.num_prefill
        for seq, n, kind in zip(batch.seqs, batch.num_new, order):  # [decode | extend | prefill]
            assert (kind == "prefill") == (seq.num_computed == 0)
            assert (kind == "decode") == (seq.num_computed > 0 and n == 1)
        kinds.append(order)
        sched.postprocess(batch, [7] * sum(batch.samples(i) for i in range(len(batch.seqs))))
    assert kinds[0] == ["prefill", "prefill"]  # 3 + 7 of 12 tokens; the third waits for budget
    assert kinds[1] == ["decode", "extend", "prefill"]
    assert all(s.status is Status.FINISHED and s.output_ids == [7, 7, 7] for s in seqs)


def test_sampler_temperature():
    from pagedattn.engine.sampler import Sampler

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    a = Sampler("cpu", seed=1)(logits, [0.0, 1.0, 0.7])
    b = Sampler("cpu", seed=1)(logits, [0.0, 1.0, 0.7])
    assert a == b and a[0] == int(logits[0].argmax())
    draws = Sampler("cpu", seed=2)(logits[1:2].expand(4000, 50).contiguous(), [1.0] * 4000)
    freq = torch.bincount(torch.tensor(draws), minlength=50).float() / 4000
    assert torch.allclose(freq, torch.softmax(logits[1], -1), atol=0.03)


def test_generate_with_temperature_and_eos(llama):
    _, path = llama
    llm = LLM(path, device="cpu", max_model_len=32, seed=4)
    ids = prompt(6, seed=6)
    first = llm.generate([ids], max_tokens=6, temperature=0.8)[0].token_ids
    eos = first[2]
    again = LLM(path, device="cpu", max_model_len=32, seed=4)
    again.engine.scheduler.eos_token_ids = {eos}
    out = again.generate([ids], max_tokens=6, temperature=0.8)[0]
    stop = first.index(eos) + 1
    assert out.token_ids == first[:stop] and out.finish_reason == "eos"


def test_cli_generate_tiny(capsys):
    from pagedattn.cli import main

    assert main(["generate", "--model", "tiny", "--prompt", "hello", "--max-tokens", "6"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "6 tokens in" in captured.err and "tokens/s" in captured.err


def test_bench_e2e_quick(tmp_path):
    import json

    from pagedattn.cli import main

    out = tmp_path / "e2e.json"
    assert main(["bench", "e2e", "--quick", "--no-batch", "--attention", "pagedattn,sdpa", "--json", str(out),
                 "--markdown", str(tmp_path / "e2e.md")]) == 0
    records = json.loads(out.read_text())["records"]
    assert [(r["attention"], r["output_len"]) for r in records] == [("pagedattn", 2), ("pagedattn", 4),
                                                                     ("sdpa", 2), ("sdpa", 4)]
    assert all(r["tpot_ms"] > 0 and r["decode_steps"] == r["output_len"] - 1 for r in records)
    assert "| attention |" in (tmp_path / "e2e.md").read_text()


def test_bad_input(tmp_path, capsys):
    from pagedattn.cli import main

    with pytest.raises(ValueError, match="model 'nope' is neither a preset"):
        LLM("nope")
    with pytest.raises(ValueError, match="neither a preset .* nor an existing folder"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="attention must be one of"):
        LLM("tiny", attention="flash")
    with pytest.raises(ValueError, match="bfloat16 does not run on the Triton interpreter"):
        LLM("tiny", device="cpu", dtype="bf16")
    llm = LLM("tiny", device="cpu", max_model_len=32)
    with pytest.raises(ValueError, match="exceeds max_model_len 32"):
        llm.generate(["x" * 30], max_tokens=8)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        llm.generate(["x"], max_tokens=0)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([""], max_tokens=2)
    with pytest.raises(ValueError, match="token ids must lie in"):
        llm.generate([[0, 300]], max_tokens=2)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        llm.generate(["ok", "y" * 40], max_tokens=2)  # nothing queued when any prompt is bad
    assert not llm.engine.scheduler.has_unfinished()
    assert main(["generate", "--model", "nope", "--prompt", "hi"]) == 2
    assert "model 'nope' is neither a preset" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fused_kernels_match_torch(dtype):
    """The GPU path's Triton kernels against the model's torch code (odd sizes, strided q/k)."""
    from pagedattn.engine.kernels import rms_norm, rope, silu_and_mul
    from pagedattn.engine.model import RMSNorm, Rotary

    g = torch.Generator().manual_seed(0)
    atol, rtol = TOLERANCES[dtype]
    x, res = (torch.randn(5, 80, generator=g).to(dtype) for _ in range(2))
    norm = RMSNorm(80, 1e-5, device="cpu", dtype=dtype)
    norm.weight.data = torch.rand(80, generator=g).to(dtype) + 0.5
    ref_out, ref_res = norm(x, res)
    out, new_res = rms_norm(x, norm.weight, 1e-5, res.clone())
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=rtol)
    out, same = rms_norm(x, norm.weight, 1e-5)
    torch.testing.assert_close(out.float(), norm(x)[0].float(), atol=atol, rtol=rtol)
    assert same is x

    class Cfg:  # head 24: half 12 is not a power of two; 6 q heads, 3 kv heads
        head_size, rope_theta, rope_scaling = 24, 10000.0, None

    rot = Rotary(Cfg, device="cpu")
    rot.build(64)
    qkv = torch.randn(7, (6 + 2 * 3) * 24, generator=g).to(dtype)
    q, k = qkv[:, :144].view(7, 6, 24), qkv[:, 144:216].view(7, 3, 24)
    positions = torch.tensor([0, 5, 63, 7, 8, 1, 30])
    ref_q, ref_k = rot(q, k, positions)
    fq, fk = rope(q, k, rot.cos, rot.sin, positions)
    torch.testing.assert_close(fq.float(), ref_q.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(fk.float(), ref_k.float(), atol=atol, rtol=rtol)

    gate_up = torch.randn(3, 2 * 40, generator=g).to(dtype)
    ref = torch.nn.functional.silu(gate_up[:, :40]) * gate_up[:, 40:]
    torch.testing.assert_close(silu_and_mul(gate_up).float(), ref.float(), atol=atol, rtol=rtol)


def test_fused_model_matches_torch(llama):
    _, path = llama
    llm = LLM(path, device="cpu", max_model_len=32, max_num_batched_tokens=5)
    ids = prompt(9, seed=7)
    ref, ref_tokens = llm.prompt_logits(ids), llm.generate([ids], max_tokens=2)[0].token_ids
    llm.model.set_fused(True)
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(llm.prompt_logits(ids), ref, atol=atol, rtol=rtol)
    assert llm.generate([ids], max_tokens=2)[0].token_ids == ref_tokens
