"""attn_implementation="pagedattn" in Hugging Face transformers: tiny random models (made here,
nothing downloaded) give the same logits as SDPA (eager where the model has no SDPA path)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pagedattn.integrations import transformers as pa_hf  # noqa: E402
from pagedattn.testing import TOLERANCES  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402

ATOL, RTOL = TOLERANCES[torch.float32]
VOCAB = 128
DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    assert pa_hf.register() == "pagedattn"


def _model(cls, config):
    torch.manual_seed(0)
    return cls(config).to(DEVICE).eval()


def _logits(model, impl, **inputs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _compare(model, reference_impl, attention_mask=None, **inputs):
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask
    ref = _logits(model, reference_impl, **inputs)
    got = _logits(model, "pagedattn", **inputs)
    keep = attention_mask.bool() if attention_mask is not None else torch.ones(ref.shape[:2], dtype=torch.bool,
                                                                                   device=ref.device)
    torch.testing.assert_close(got[keep], ref[keep], atol=ATOL, rtol=RTOL)


def _ids(batch=3, length=12, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _padding(side, batch=3, length=12):
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :7] = 0
    return (mask if side == "left" else mask.flip(1)).to(DEVICE)


@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_llama_decoder_matches_sdpa(padding):
    model = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**DECODER))
    mask = None if padding == "none" else _padding(padding)
    _compare(model, "sdpa", input_ids=_ids(), attention_mask=mask)


def test_llama_cached_decode_steps_match_sdpa():
    model = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**DECODER))
    ids, mask = _ids(), _padding("left")
    logits = {}
    for impl in ("sdpa", "pagedattn"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            first = model(input_ids=ids, attention_mask=mask, use_cache=True)
            nxt = first.logits[:, -1:].argmax(-1)
            step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            second = model(input_ids=nxt, attention_mask=step_mask, past_key_values=first.past_key_values,
                           use_cache=True)
            nxt2 = second.logits.argmax(-1)
            third = model(input_ids=torch.cat([nxt2, nxt], 1), past_key_values=second.past_key_values,
                          attention_mask=torch.cat([step_mask, torch.ones_like(mask[:, :2])], 1))
        logits[impl] = (second.logits, third.logits)  # a decode step, then a 2-token extend
    for got, ref in zip(logits["pagedattn"], logits["sdpa"]):
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


def test_llama_generate_same_tokens():
    model = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**DECODER))
    ids, mask = _ids(), _padding("left")
    tokens = {}
    for impl in ("sdpa", "pagedattn"):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(tokens["pagedattn"], tokens["sdpa"])


@pytest.mark.parametrize("padding", ["none", "right"])
def test_bert_encoder_matches_sdpa(padding):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=64)
    model = _model(transformers.BertModel, config)
    mask = None if padding == "none" else _padding("right")
    _compare(model, "sdpa", input_ids=_ids(), attention_mask=mask)


@pytest.mark.parametrize(
    "name, reference_impl",
    [
        pytest.param("mistral", "sdpa", id="mistral-window"),
        pytest.param("gemma2", "eager", id="gemma2-window-softcap"),
        pytest.param("gpt_oss", "eager", id="gptoss-window-sinks"),
    ],
)
def test_decoder_features_match(name, reference_impl):
    common = dict(DECODER, sliding_window=4)
    if name == "mistral":
        model = _model(transformers.MistralForCausalLM, transformers.MistralConfig(**common))
    elif name == "gemma2":
        model = _model(transformers.Gemma2ForCausalLM,
                       transformers.Gemma2Config(**common, attn_logit_softcapping=5.0))
    else:
        common["intermediate_size"] = 64
        model = _model(transformers.GptOssForCausalLM,
                       transformers.GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()  # non-zero sinks
    _compare(model, reference_impl, input_ids=_ids(), attention_mask=_padding("left"))


def test_inexpressible_mask_raises():
    model = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**DECODER))
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool, device=DEVICE).tril()
    mask[..., 5, 2] = False  # a key hidden inside a row
    model.set_attn_implementation("pagedattn")
    with torch.no_grad(), pytest.raises(ValueError, match="not expressible"):
        model(input_ids=_ids(1, 6), attention_mask=mask)


def test_training_dropout_raises():
    model = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**DECODER, attention_dropout=0.1))
    model.set_attn_implementation("pagedattn")
    model.train()
    with torch.no_grad(), pytest.raises(ValueError, match="dropout"):
        model(input_ids=_ids(1, 6))


def test_from_pretrained_with_pagedattn(tmp_path):
    model = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**DECODER))
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="pagedattn")
    loaded = loaded.to(DEVICE).eval()
    assert loaded.config._attn_implementation == "pagedattn"
    ids = _ids()
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, _logits(model, "sdpa", input_ids=ids), atol=ATOL, rtol=RTOL)


def _continuous_batching_config(**kwargs):
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(**kwargs)


@pytest.mark.parametrize(
    "name, chunked",
    [
        pytest.param("llama", False, id="llama-whole-prompts"),
        pytest.param("llama", True, id="llama-chunked-prefill"),
        pytest.param("gemma2", True, id="gemma2-window-softcap-chunked"),
    ],
)
def test_generate_batch_same_tokens_as_greedy(name, chunked, monkeypatch):
    """transformers' continuous batching (its paged cache, packed calls) with attn_implementation="pagedattn"
    gives the tokens of plain greedy generate, one prompt at a time."""
    pytest.importorskip("transformers.generation.continuous_batching")
    calls = []
    packed = pa_hf.varlen_attention_forward

    def spy(query, key, value, cu_q, cu_k, **kw):
        calls.append((cu_q.tolist(), cu_k.tolist()))
        return packed(query, key, value, cu_q, cu_k, **kw)

    monkeypatch.setattr(pa_hf, "varlen_attention_forward", spy)
    if name == "llama":
        model, reference_impl = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**DECODER)), "sdpa"
    else:
        config = transformers.Gemma2Config(**DECODER, sliding_window=4, attn_logit_softcapping=5.0)
        model, reference_impl = _model(transformers.Gemma2ForCausalLM, config), "eager"
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    new = 5
    gen = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    expected = []
    model.set_attn_implementation(reference_impl)
    for p in prompts:
        ids = torch.tensor([p], device=DEVICE)
        tokens = model.generate(input_ids=ids, max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=-1)
        expected.append(tokens[0, len(p):].tolist())
    model.set_attn_implementation("pagedattn")
    cb = transformers.ContinuousBatchingConfig(max_batch_tokens=8 if chunked else None, page_size=16)
    outputs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    assert model.config._attn_implementation == "pagedattn"  # kept, not switched to sdpa / flash
    assert [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))] == expected
    q_lens = [[b - a for a, b in zip(q[:-1], q[1:])] for q, _ in calls]
    k_lens = [[b - a for a, b in zip(k[:-1], k[1:])] for _, k in calls]
    assert any(1 in lens for lens in q_lens)  # decode steps went through pagedattn
    extends = [(q, k) for ql, kl in zip(q_lens, k_lens) for q, k in zip(ql, kl) if 1 < q < k]
    assert bool(extends) == chunked  # a prompt continued on cached tokens (chunked prefill)


def test_continuous_batching_allow_list_wrapped_once():
    cb = pytest.importorskip("transformers.generation.continuous_batching.continuous_api")
    pa_hf.register()
    wrapped = cb.ContinuousBatchingManager.switch_to_cb_friendly_attn
    assert wrapped._pagedattn_wrapped and not getattr(wrapped.__wrapped__, "_pagedattn_wrapped", False)
    pa_hf.register()
    assert cb.ContinuousBatchingManager.switch_to_cb_friendly_attn is wrapped
    model = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**DECODER))
    model.set_attn_implementation("eager")  # another name still goes through transformers' own rule
    wrapped(object.__new__(cb.ContinuousBatchingManager), model, False)
    assert model.config._attn_implementation == "paged|eager"
