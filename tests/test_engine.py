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
    temps = [SamplingParams(temperature=t) for t in (0.0, 1.0, 0.7)]
    a = Sampler("cpu", seed=1)(logits, _seqs(temps))
    b = Sampler("cpu", seed=1)(logits, _seqs(temps))
    assert a == b and a[0] == int(logits[0].argmax())
    draws = Sampler("cpu", seed=2)(logits[1:2].expand(4000, 50).contiguous(), _seqs([temps[1]] * 4000))
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
    for style in ("gemma", "fp32"):  # Gemma's (1 + w) and GPT-OSS's fp32 product
        other = RMSNorm(80, 1e-5, device="cpu", dtype=dtype, style=style)
        other.weight.data = norm.weight.data - 1.0
        ref_out, ref_res = other(x, res)
        out, new_res = rms_norm(x, other.weight, 1e-5, res.clone(), style=style)
        torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=rtol)
    out, same = rms_norm(x, norm.weight, 1e-5)
    torch.testing.assert_close(out.float(), norm(x)[0].float(), atol=atol, rtol=rtol)
    assert same is x

    # head 24: half 12 is not a power of two; 6 q heads, 3 kv heads
    rot = Rotary(device="cpu", inv_freq=1.0 / 10000.0 ** (torch.arange(0, 24, 2).float() / 24))
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


@pytest.mark.parametrize("model", ["llama-folder", "tiny-gemma3"])  # Gemma: (1 + w) norms, GELU, two RoPEs
def test_fused_model_matches_torch(llama, model):
    path = llama[1] if model == "llama-folder" else model
    llm = LLM(path, device="cpu", max_model_len=32, max_num_batched_tokens=5)
    ids = prompt(9, seed=7)
    ref, ref_tokens = llm.prompt_logits(ids), llm.generate([ids], max_tokens=2)[0].token_ids
    llm.model.set_fused(True)
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(llm.prompt_logits(ids), ref, atol=atol, rtol=rtol)
    assert llm.generate([ids], max_tokens=2)[0].token_ids == ref_tokens


# ---- sampling ---------------------------------------------------------------------------------
def _seqs(params, token_ids=((1, 2),)):
    return [Sequence(list(token_ids[i % len(token_ids)]), p) for i, p in enumerate(params)]


def _draws(logits_row, params, n=3000, seed=0):
    """n draws from one row of logits with ``params`` (one sequence per draw, the engine's generator)."""
    from pagedattn.engine.sampler import Sampler

    return torch.tensor(Sampler("cpu", seed=seed)(logits_row.expand(n, -1).contiguous(), _seqs([params] * n)))


def test_sampler_filters():
    from pagedattn.engine.sampler import Sampler

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 40, generator=g) * 2
    greedy = logits.argmax(-1).tolist()
    top1 = [SamplingParams(temperature=t, top_k=1) for t in (0.5, 1.0, 2.0, 5.0)]
    assert Sampler("cpu", seed=3)(logits, _seqs(top1)) == greedy  # top_k=1 is greedy at any temperature
    assert Sampler("cpu")(logits, _seqs([SamplingParams(temperature=1.0, top_p=1e-6)] * 4)) == greedy
    assert Sampler("cpu")(logits, _seqs([SamplingParams(temperature=1.0, min_p=1.0)] * 4)) == greedy

    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    draws = _draws(logits[0], SamplingParams(temperature=1.0, top_k=5))
    assert set(draws.tolist()) == set(order[:5].tolist())  # only, and all of, the 5 most likely
    nucleus = int((probs[order].cumsum(0) < 0.6).sum()) + 1  # smallest set of mass >= 0.6
    draws = _draws(logits[0], SamplingParams(temperature=1.0, top_p=0.6))
    assert set(draws.tolist()) == set(order[:nucleus].tolist())
    freq = torch.bincount(draws, minlength=40).float() / len(draws)
    kept = torch.zeros(40).index_fill_(0, order[:nucleus], 1.0) * probs
    assert torch.allclose(freq, kept / kept.sum(), atol=0.03)  # renormalized over the nucleus
    draws = _draws(logits[0], SamplingParams(temperature=1.0, min_p=0.3))
    assert set(draws.tolist()) == set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    hot = _draws(logits[0], SamplingParams(temperature=50.0))  # high temperature: close to uniform
    assert len(set(hot.tolist())) > 35


def test_sampler_repetition_penalty():
    from pagedattn.engine.sampler import Sampler

    logits = torch.tensor([[3.0, -1.0, 2.5, 0.5, -2.0]])
    seq = Sequence([0, 1, 1], SamplingParams(repetition_penalty=2.0))
    penalized = Sampler.penalize(logits, [seq])
    assert penalized.tolist() == [[1.5, -2.0, 2.5, 0.5, -2.0]]  # positive / r, negative * r, others unchanged
    assert Sampler("cpu")(logits, [seq]) == [2]  # greedy moves off the repeated token
    assert Sampler("cpu")(logits, [Sequence([0, 1, 1], SamplingParams())]) == [0]


def test_seed_reproducible_in_any_batch():
    llm = LLM("tiny", device="cpu", attention="sdpa", max_model_len=32, max_num_seqs=4)
    p = prompt(5, seed=30)
    alone = llm.generate([p], max_tokens=6, temperature=1.0, seed=11)[0].token_ids
    batch = llm.generate([prompt(7, seed=31), p, prompt(3, seed=32)], sampling_params=[
        SamplingParams(max_tokens=6, temperature=1.0, seed=5), SamplingParams(max_tokens=6, temperature=1.0, seed=11),
        SamplingParams(max_tokens=6, temperature=1.0)])
    assert batch[1].token_ids == alone  # its own generator: the other requests do not change it
    other = llm.generate([p], max_tokens=6, temperature=1.0, seed=12)[0].token_ids
    assert other != alone


def test_top_k_one_equals_greedy_in_engine():
    llm = LLM("tiny", device="cpu", max_model_len=32)
    p = prompt(6, seed=33)
    greedy = llm.generate([p], max_tokens=5)[0].token_ids
    assert llm.generate([p], max_tokens=5, temperature=1.3, top_k=1, seed=2)[0].token_ids == greedy


def test_stop_strings_and_stop_tokens():
    llm = LLM("tiny", device="cpu", attention="sdpa", max_model_len=48)
    p = prompt(6, seed=34)
    full = llm.generate([p], max_tokens=12, ignore_eos=True)[0]
    text = full.text
    decode = llm.tokenizer.decode
    stop = text[5:7]
    cut = text.find(stop)
    n = next(m for m in range(1, 13) if stop in decode(full.token_ids[:m]))  # the step where it appears
    out = llm.generate([p], max_tokens=12, stop=[stop, "never-in-bytes\x00\x01"])[0]
    assert out.finish_reason == "stop" and out.text == text[:cut] and out.token_ids == full.token_ids[:n]
    tok = full.token_ids[4]
    out = llm.generate([p], max_tokens=12, stop_token_ids=[tok])[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:full.token_ids.index(tok) + 1]
    with pytest.raises(ValueError, match="top_p must lie in"):
        llm.generate([p], top_p=0.0)
    with pytest.raises(ValueError, match="stop must be non-empty strings"):
        llm.generate([p], stop=[""])


def test_cli_generate_several_prompts_json(tmp_path, capsys):
    import json

    from pagedattn.cli import main

    lines = tmp_path / "prompts.jsonl"
    lines.write_text('{"prompt": "abc", "seed": 7, "max_tokens": 3}\nplain line\n')
    assert main(["generate", "--model", "tiny", "--prompt", "hello", "--prompts-file", str(lines), "--max-tokens",
                 "4", "--temperature", "0.9", "--top-k", "20", "--request-seed", "1", "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["random_weights"] is True and "RANDOM weights" in captured.err and "gibberish" in captured.err
    outs = doc["outputs"]
    assert [o["prompt"] for o in outs] == ["hello", "abc", "plain line"]
    assert [len(o["token_ids"]) for o in outs] == [4, 3, 4]
    assert [o["sampling"]["seed"] for o in outs] == [1, 7, 3]
    assert main(["generate", "--model", "tiny", "--prompt", "abc", "--max-tokens", "3", "--temperature", "0.9",
                 "--top-k", "20", "--request-seed", "7", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"] == outs[1]["token_ids"]  # seeded
    assert main(["generate", "--model", "tiny"]) == 2
    assert "no prompt" in capsys.readouterr().err


def test_chat_template(tmp_path, capsys):
    """A folder with a tokenizer that has a chat template: prompts are wrapped in it (CLI default)."""
    tokenizers = pytest.importorskip("tokenizers")
    from pagedattn.cli import main

    save_checkpoint(tmp_path)
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", "<user>", "<bot>", "hello", "world"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    template = "{% for m in messages %}<user> {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                                chat_template=template)
    fast.save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), device="cpu", attention="sdpa", max_model_len=32)
    assert llm.has_chat_template
    assert llm.encode("hello world", chat=True) == [2, 4, 5, 3]
    assert llm.encode([{"role": "user", "content": "world"}]) == [2, 5, 3]
    assert llm.encode("hello world") == [4, 5]
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hello", "--max-tokens", "2", "--json",
                 "--attention", "sdpa"]) == 0
    doc = __import__("json").loads(capsys.readouterr().out)
    assert doc["chat_template"] is True and doc["random_weights"] is False
    with pytest.raises(ValueError, match="chat template"):
        LLM("tiny", device="cpu", attention="sdpa", max_model_len=32).encode("hi", chat=True)


# ---- model families against transformers ------------------------------------------------------
WINDOW = 5  # shorter than the prompts: the window changes the answer
GREEDY_STEPS = 4
FAMILY_SMALL = dict(SMALL, head_dim=16)


def family_config(kind: str):
    """A tiny transformers config of each family the engine runs (what docs/engine.md's table lists)."""
    t = transformers
    if kind == "mistral-window":
        return t.MistralConfig(**FAMILY_SMALL, sliding_window=WINDOW)
    if kind == "qwen2-window":  # the window on layers >= max_window_layers only
        return t.Qwen2Config(**FAMILY_SMALL, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if kind == "gemma2":
        return t.Gemma2Config(**FAMILY_SMALL, sliding_window=WINDOW, query_pre_attn_scalar=24,
                              attn_logit_softcapping=4.0, final_logit_softcapping=3.0)
    if kind == "gemma3":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}
        return t.Gemma3TextConfig(**dict(FAMILY_SMALL, num_hidden_layers=3), sliding_window=WINDOW,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  rope_parameters=rope, query_pre_attn_scalar=12)
    if kind == "gpt-oss":
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 64}
        return t.GptOssConfig(**dict(FAMILY_SMALL, intermediate_size=32), sliding_window=WINDOW,
                              num_local_experts=4, num_experts_per_tok=2, rope_parameters=rope)
    rope = {"llama-yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
            "llama-linear": {"rope_type": "linear", "factor": 2.0},
            "llama-dynamic": {"rope_type": "dynamic", "factor": 2.0}}[kind]
    return t.LlamaConfig(**FAMILY_SMALL, rope_parameters=dict(rope, rope_theta=10000.0))


FAMILIES = ["mistral-window", "qwen2-window", "gemma2", "gemma3", "gpt-oss", "llama-yarn", "llama-linear",
            "llama-dynamic"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_family_matches_transformers(tmp_path, kind):
    """Logits of an 11-token prompt (prefilled in chunks of 6: a prefill, then an extend across the
    window) and GREEDY_STEPS greedy tokens against transformers' own model on the same random
    weights (sinks, biases and norm weights randomized too)."""
    torch.manual_seed(5)
    config = family_config(kind)
    ref_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random sinks, biases and norms too, so that each feature shows
        for name, p in ref_model.named_parameters():
            if name.endswith(("sinks", "bias", "norm.weight")):
                p.normal_(0.0, 0.5)
    ref_model.save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), device="cpu", max_model_len=40, max_num_batched_tokens=6)
    assert llm.model_config.model_type == config.model_type
    ids = prompt(11, seed=8)
    with torch.no_grad():
        ref_logits = ref_model(torch.tensor([ids])).logits[0]
        ref_tokens = ref_model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_STEPS, do_sample=False)
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(llm.prompt_logits(ids), ref_logits, atol=atol, rtol=rtol)
    out = llm.generate([ids], max_tokens=GREEDY_STEPS, ignore_eos=True)[0].token_ids
    assert out == ref_tokens[0, len(ids):].tolist()


@pytest.mark.parametrize("preset", ["tiny-mistral", "tiny-gemma2", "tiny-gemma3", "tiny-gpt-oss"])
def test_family_presets(preset):
    """Each family's random-weight preset runs; SDPA runs the windowed ones and the sinks (an
    extra zero key) with the same tokens, and refuses what it cannot compute (softcap)."""
    llm = LLM(preset, device="cpu", max_model_len=32)
    ids = prompt(12, seed=9)
    tokens = llm.generate([ids], max_tokens=3, ignore_eos=True)[0].token_ids
    assert len(tokens) == 3
    cfg = llm.model_config
    assert cfg.sliding_window and any(cfg.window(i) for i in range(cfg.num_layers))
    if cfg.attn_softcap:
        with pytest.raises(ValueError, match="sdpa cannot compute"):
            LLM(preset, device="cpu", attention="sdpa", max_model_len=32)
    else:
        sdpa = LLM(preset, device="cpu", attention="sdpa", max_model_len=32, max_num_batched_tokens=5)
        assert sdpa.generate([ids], max_tokens=3, ignore_eos=True)[0].token_ids == tokens


def test_sdpa_sinks_match_pagedattn():
    """SDPA's sinks (an extra zero key whose mask is the sink logit) give pagedattn's logits on the
    GPT-OSS preset, a prompt long enough to reach its windows; sinks scaled away change them."""
    ids = prompt(40, seed=11)
    llms = {a: LLM("tiny-gpt-oss", device="cpu", attention=a, max_model_len=64, max_num_batched_tokens=16)
            for a in ("pagedattn", "sdpa")}
    atol, rtol = TOLERANCES[torch.float32]
    logits = {a: llm.prompt_logits(ids) for a, llm in llms.items()}
    torch.testing.assert_close(logits["sdpa"], logits["pagedattn"], atol=atol, rtol=rtol)
    with torch.no_grad():
        for layer in llms["sdpa"].model.layers:
            layer.attn.sinks.mul_(0.0).add_(4.0)  # every head's sink logit 4: most weight on no key
    assert (llms["sdpa"].prompt_logits(ids) - logits["sdpa"]).abs().max() > 100 * atol


def test_unsupported_configs(tmp_path):
    import json

    from pagedattn.engine.config import from_hf_config

    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        from_hf_config({"model_type": "bert"})
    with pytest.raises(ValueError, match="rope type 'longrope' is not supported"):
        from_hf_config(dict(FAMILY_SMALL, model_type="llama", rope_parameters={
            "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
            "original_max_position_embeddings": 64}))
    (tmp_path / "config.json").write_text(json.dumps(dict(FAMILY_SMALL, model_type="llama", hidden_act="relu")))
    with pytest.raises(ValueError, match="hidden activation 'relu' is not supported"):
        LLM(str(tmp_path), device="cpu")


def test_bench_e2e_family_preset(tmp_path):
    import json

    from pagedattn.bench.e2e import main

    out = tmp_path / "e2e.json"
    assert main(["--quick", "--model", "tiny-gpt-oss", "--no-batch", "--attention", "pagedattn,sdpa", "--json",
                 str(out), "--markdown", str(tmp_path / "e2e.md")]) == 0
    records = json.loads(out.read_text())["records"]
    assert [r["attention"] for r in records] == ["pagedattn", "pagedattn", "sdpa", "sdpa"]
    assert all(r["tpot_ms"] > 0 for r in records)  # SDPA computes the sinks (an extra zero key)


def test_gemma3_multimodal_folder_text_decoder(tmp_path):
    """A Gemma3ForConditionalGeneration folder: the engine runs its text decoder (the vision
    tower's tensors are skipped) and matches transformers on a text-only prompt."""
    text = dict(FAMILY_SMALL, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                query_pre_attn_scalar=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(6)
    ref_model = transformers.Gemma3ForConditionalGeneration(
        transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)).eval()
    with torch.no_grad():
        for name, p in ref_model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    ref_model.save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), device="cpu", max_model_len=32)
    assert llm.model_config.model_type == "gemma3_text"
    ids = prompt(11, seed=10)
    with torch.no_grad():
        ref = ref_model(input_ids=torch.tensor([ids])).logits[0]
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(llm.prompt_logits(ids), ref, atol=atol, rtol=rtol)


# ---- FlashInfer attention (metadata and call sequence, with a stand-in module) --------------
class _FakeWrapper:
    """FlashInfer's paged wrappers as the engine calls them, each run computed with pagedattn's
    reference from the planned indptr / indices / last_page_len (FlashInfer's documented meaning:
    ``window_left`` keys left of the query besides its own, causal queries at the end)."""

    plans: list = []

    def __init__(self, workspace, layout, use_cuda_graph=False, use_tensor_cores=False, backend="auto",
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        assert layout == "NHD" and workspace.dtype == torch.uint8
        self.fixed = len(paged_kv_last_page_len_buffer) if use_cuda_graph else None
        self.indices_room = len(paged_kv_indices_buffer) if use_cuda_graph else None

    def _plan(self, qo, indptr, indices, last, hq, hkv, d, page, *, causal, window_left=-1, logits_soft_cap=None,
              sm_scale=None, q_data_type=None, kv_data_type=None):
        n = len(last)
        if self.fixed is not None:
            assert n == self.fixed and len(indices) <= self.indices_room
        pages = (indptr[1:] - indptr[:-1]).tolist()
        table = torch.zeros(n, max(pages + [1]), dtype=torch.int32)
        for i, p in enumerate(pages):
            table[i, :p] = indices[int(indptr[i]):int(indptr[i]) + p]
        lens = torch.tensor([(p - 1) * page + int(x) for p, x in zip(pages, last)], dtype=torch.int32)
        self.args = dict(block_table=table, seq_lens=lens, query_start_loc=qo.to(torch.int32),
                         scale=sm_scale, causal=causal, softcap=logits_soft_cap,
                         sliding_window=window_left + 1 if window_left >= 0 else None)
        _FakeWrapper.plans.append((type(self).__name__, self.fixed is not None, window_left, logits_soft_cap))

    def run(self, q, kv):
        from pagedattn.reference import paged_attention_ref

        return paged_attention_ref(q, kv[0], kv[1], **self.args)[0].to(q.dtype)


class _FakeDecode(_FakeWrapper):
    def plan(self, indptr, indices, last, *shape, **kw):
        self._plan(torch.arange(len(last) + 1), indptr, indices, last, *shape, causal=True, **kw)


class _FakePrefill(_FakeWrapper):
    def plan(self, qo, indptr, indices, last, *shape, causal=False, **kw):
        self._plan(qo, indptr, indices, last, *shape, causal=causal, **kw)


def test_flashinfer_metadata_and_calls(monkeypatch):
    import types

    from pagedattn.adapters import flashinfer as adapter
    from pagedattn.engine import flashinfer_backend as fb

    csr = adapter.paged_csr(torch.tensor([[7, 0, 0], [3, 4, 0], [9, 8, 2], [6, 0, 0]], dtype=torch.int32),
                            [5, 16, 17, 1], 16)
    assert csr.indptr.tolist() == [0, 1, 2, 4, 5] and csr.indices.tolist() == [7, 3, 9, 8, 6]
    assert csr.last_page_len.tolist() == [5, 16, 1, 1]
    tail = csr.rows(2, 4)
    assert tail.indptr.tolist() == [0, 2, 3] and tail.indices.tolist() == [9, 8, 6]
    with pytest.raises(ValueError, match="flashinfer"):
        LLM("tiny", device="cpu", attention="flashinfer", max_model_len=32)  # not installed, or no CUDA here
    fake = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_FakeDecode,
                                 BatchPrefillWithPagedKVCacheWrapper=_FakePrefill, __version__="stand-in")
    monkeypatch.setattr(adapter, "load", lambda: fake)
    monkeypatch.setattr(fb.FlashInferBackend, "requires_cuda", False)
    monkeypatch.setattr(_FakeWrapper, "plans", [])
    with pytest.raises(ValueError, match="sinks"):
        LLM("tiny-gpt-oss", device="cpu", attention="flashinfer", max_model_len=32)
    ps = [prompt(n, seed=40 + n) for n in (3, 12, 7)]
    kw = dict(device="cpu", max_model_len=32, max_num_seqs=4, max_num_batched_tokens=8, cuda_graph_sizes=[2, 4])
    expected = [o.token_ids for o in LLM("tiny-gemma2", **kw).generate(ps, max_tokens=4)]
    llm = LLM("tiny-gemma2", attention="flashinfer", **kw)  # softcap, windows on alternate layers, scale
    llm.engine.runner.capture_graphs(emulate=True)
    llm.engine.step_records = []
    assert [o.token_ids for o in llm.generate(ps, max_tokens=4)] == expected
    records = llm.engine.step_records
    assert any(r["graph"] for r in records) and any(not r["decode"] for r in records)
    kinds = {plan[:3] for plan in _FakeWrapper.plans}  # (wrapper, graph mode, window_left)
    for w in (7, -1):  # window 8 and full layers: mixed steps split decode / prefill, graph decode
        assert {("_FakeDecode", False, w), ("_FakePrefill", False, w), ("_FakeDecode", True, w)} <= kinds
    assert all(cap == 50.0 for *_, cap in _FakeWrapper.plans)
