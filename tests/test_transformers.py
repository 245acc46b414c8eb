"""attn_implementation="pagedattn" in Hugging Face transformers: tiny random models of each family
(made here, nothing downloaded) give the logits of SDPA, or of eager where the family's feature
(softcap, sinks, bidirectional image blocks) has no SDPA path, padded and unpadded; ``generate``
and ``generate_batch`` (continuous batching) give the reference's greedy tokens."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pagedattn.integrations import transformers as pa_hf  # noqa: E402
from pagedattn.reference import visible_mask  # noqa: E402
from pagedattn.testing import TOLERANCES  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402

ATOL, RTOL = TOLERANCES[torch.float32]
VOCAB = 128
IMAGE_TOKEN = VOCAB - 1
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
               eos_token_id=2)
ENCODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               max_position_embeddings=64, pad_token_id=0)
TWO_LAYER_TYPES = ["sliding_attention", "full_attention"]
ONE_LAYER = dict(DECODER, num_hidden_layers=1)  # families whose layers are all alike


@pytest.fixture(scope="module", autouse=True)
def _registered():
    assert pa_hf.register() == "pagedattn"


def _model(cls, config):
    torch.manual_seed(0)
    return cls(config).to(DEVICE).eval()


def _gpt_oss():
    config = transformers.GptOssConfig(**dict(DECODER, intermediate_size=32), sliding_window=4, num_local_experts=4,
                                       num_experts_per_tok=2)
    model = _model(transformers.GptOssForCausalLM, config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()  # non-zero sinks
    return model


# family -> (build the model, reference implementation). Windows of 4 keys on 12-token prompts.
DECODERS = {
    "llama": (lambda: _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**ONE_LAYER)), "sdpa"),
    "mistral-window": (lambda: _model(transformers.MistralForCausalLM,
                                      transformers.MistralConfig(**ONE_LAYER, sliding_window=4)), "sdpa"),
    "qwen2-window": (lambda: _model(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        **DECODER, use_sliding_window=True, sliding_window=4, max_window_layers=1)), "sdpa"),
    "qwen3": (lambda: _model(transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**ONE_LAYER)), "sdpa"),
    "phi3": (lambda: _model(transformers.Phi3ForCausalLM, transformers.Phi3Config(**ONE_LAYER)), "sdpa"),
    "gemma2-window-softcap": (lambda: _model(transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        **DECODER, sliding_window=4, attn_logit_softcapping=5.0)), "eager"),
    "gemma3-text-window": (lambda: _model(transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
        **DECODER, sliding_window=4, layer_types=TWO_LAYER_TYPES)), "eager"),
    "gptoss-window-sinks": (_gpt_oss, "eager"),
}
_built: dict = {}


def _decoder(name):
    if name not in _built:
        _built[name] = DECODERS[name][0]()
    return _built[name], DECODERS[name][1]


def _outputs(model, impl, **inputs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _compare(model, reference_impl, attention_mask=None, keep=None, **inputs):
    """The outputs of pagedattn and of ``reference_impl`` agree on the real tokens (``keep``,
    default the unmasked tokens of ``attention_mask``)."""
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask
    ref = _outputs(model, reference_impl, **inputs)
    got = _outputs(model, "pagedattn", **inputs)
    if keep is None:
        keep = attention_mask.bool() if attention_mask is not None else torch.ones(ref.shape[:2], dtype=torch.bool)
    keep = keep.to(ref.device)
    assert torch.isfinite(got[keep]).all()
    torch.testing.assert_close(got[keep], ref[keep], atol=ATOL, rtol=RTOL)


def _ids(batch=3, length=12, seed=1):
    return torch.randint(3, VOCAB - 1, (batch, length), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _padding(side, batch=3, length=12):
    if side == "none":
        return None
    mask = torch.ones(batch, length, dtype=torch.long)
    for row, pad in zip(range(1, batch), (4, 7)):
        mask[row, :pad] = 0
    return (mask if side == "left" else mask.flip(1)).to(DEVICE)


def _same_greedy_tokens(model, reference_impl, new=3, **inputs):
    tokens = {}
    for impl in (reference_impl, "pagedattn"):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(**inputs, max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=-1)
    assert torch.equal(tokens["pagedattn"], tokens[reference_impl])


# ----------------------------------------------------------------------------------- decoders

@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("name", list(DECODERS))
def test_decoder_matches_reference(name, padding):
    model, reference_impl = _decoder(name)
    _compare(model, reference_impl, input_ids=_ids(), attention_mask=_padding(padding))


def test_llama_right_padding_matches_sdpa():
    model, reference_impl = _decoder("llama")
    _compare(model, reference_impl, input_ids=_ids(), attention_mask=_padding("right"))


@pytest.mark.parametrize("name", list(DECODERS))
def test_decoder_generate_same_tokens(name):
    model, reference_impl = _decoder(name)
    _same_greedy_tokens(model, reference_impl, input_ids=_ids(2, 7), attention_mask=_padding("left", 2, 7))


def test_llama_cached_decode_steps_match_sdpa():
    model, _ = _decoder("llama")
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


CB_FAMILIES = [
    pytest.param("llama", False, id="llama-whole-prompts"),
    pytest.param("llama", True, id="llama-chunked-prefill"),
    *(pytest.param(name, True, id=f"{name}-chunked") for name in DECODERS if name != "llama"),
]


@pytest.mark.parametrize("name, chunked", CB_FAMILIES)
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
    model, reference_impl = _decoder(name)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
    new = 3
    expected = []
    model.set_attn_implementation(reference_impl)
    for p in prompts:
        ids = torch.tensor([p], device=DEVICE)
        tokens = model.generate(input_ids=ids, max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=-1)
        expected.append(tokens[0, len(p):].tolist())
    model.set_attn_implementation("pagedattn")
    gen = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # num_blocks given: without it the manager sizes its cache from the free memory (seconds of zeroing on a CPU)
    cb = transformers.ContinuousBatchingConfig(max_batch_tokens=8 if chunked else None, page_size=16, num_blocks=16,
                                               max_requests_per_batch=4)
    outputs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    assert model.config._attn_implementation == "pagedattn"  # kept, not switched to sdpa / flash
    assert [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))] == expected
    q_lens = [[b - a for a, b in zip(q[:-1], q[1:])] for q, _ in calls]
    k_lens = [[b - a for a, b in zip(k[:-1], k[1:])] for _, k in calls]
    assert any(1 in lens for lens in q_lens)  # decode steps went through pagedattn
    extends = [(q, k) for ql, kl in zip(q_lens, k_lens) for q, k in zip(ql, kl) if 1 < q < k]
    assert bool(extends) == chunked  # a prompt continued on cached tokens (chunked prefill)


def test_model_without_the_attention_interface_is_refused():
    """BLOOM's attention module computes ALiBi scores itself: transformers alone would keep it (a
    logged warning) or fail with a KeyError while building the model."""
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=4)
    model = _model(transformers.BloomForCausalLM, config)
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match="BloomForCausalLM computes attention in its own modules"):
        model.set_attn_implementation("pagedattn")
    assert model.config._attn_implementation == before
    with pytest.raises(ValueError, match="not through transformers' AttentionInterface"):
        transformers.BloomForCausalLM._from_config(copy.deepcopy(config), attn_implementation="pagedattn")


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


def test_from_pretrained_with_pagedattn(tmp_path):
    model, _ = _decoder("llama")
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="pagedattn")
    loaded = loaded.to(DEVICE).eval()
    assert loaded.config._attn_implementation == "pagedattn"
    ids = _ids()
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, _outputs(model, "sdpa", input_ids=ids), atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------------- encoders

@pytest.mark.parametrize("padding", ["none", "right"])
def test_bert_encoder_matches_sdpa(padding):
    config = transformers.BertConfig(**ENCODER)
    _compare(_model(transformers.BertModel, config), "sdpa", input_ids=_ids(), attention_mask=_padding(padding))


@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_modernbert_local_global_matches_sdpa(padding):
    """Bidirectional windows (|q - k| <= 2 on local layers) beside global layers, padded on either side."""
    config = transformers.ModernBertConfig(**ENCODER, local_attention=4, global_attn_every_n_layers=2,
                                           bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    assert config.layer_types == TWO_LAYER_TYPES[::-1] and config.sliding_window == 2
    _compare(_model(transformers.ModernBertModel, config), "sdpa", input_ids=_ids(), attention_mask=_padding(padding))


@pytest.mark.parametrize("padding", ["none", "right"])
def test_gemma3_bidirectional_window_matches_sdpa(padding):
    """Gemma 3 with use_bidirectional_attention (embedding models): |q - k| < 4 on sliding layers."""
    config = transformers.Gemma3TextConfig(**DECODER, sliding_window=4, layer_types=TWO_LAYER_TYPES,
                                           use_bidirectional_attention=True)
    _compare(_model(transformers.Gemma3TextModel, config), "sdpa", input_ids=_ids(), attention_mask=_padding(padding))


# ----------------------------------------------------------------------------------- encoder-decoders

def _bart():
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                                     eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    return _model(transformers.BartForConditionalGeneration, config)


@pytest.mark.parametrize("padding", ["none", "right"])
def test_bart_matches_sdpa(padding):
    """Bidirectional encoder (padded), causal decoder self-attention, cross attention."""
    decoder_ids = _ids(3, 5, seed=2)
    _compare(_bart(), "sdpa", input_ids=_ids(), attention_mask=_padding(padding), decoder_input_ids=decoder_ids,
             keep=torch.ones(3, 5, dtype=torch.bool))


def test_bart_generate_same_tokens():
    _same_greedy_tokens(_bart(), "sdpa", input_ids=_ids(2, 9), attention_mask=_padding("right", 2, 9))


def _whisper():
    config = transformers.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=1,
                                        decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                                        encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=8,
                                        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                        decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None)
    return _model(transformers.WhisperForConditionalGeneration, config)


def _features(batch=2):
    return torch.randn(batch, 8, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)  # 16 frames: 8 positions


def test_whisper_matches_sdpa():
    """Whisper's encoder reads fixed-length features (no padding mask); its decoder is padded on the right."""
    mask = torch.ones(2, 5, dtype=torch.long, device=DEVICE)
    mask[1, 3:] = 0
    _compare(_whisper(), "sdpa", input_features=_features(), decoder_input_ids=_ids(2, 5, seed=2),
             decoder_attention_mask=mask, keep=mask.bool())


def test_whisper_generate_same_tokens():
    _same_greedy_tokens(_whisper(), "sdpa", input_features=_features())


# ----------------------------------------------------------------------------------- vision-language

def _llava():
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=14, patch_size=7)
    config = transformers.LlavaConfig(vision_config=vision, text_config=transformers.LlamaConfig(**ONE_LAYER),
                                      image_token_index=IMAGE_TOKEN, image_seq_length=4, projector_hidden_act="gelu")
    return _model(transformers.LlavaForConditionalGeneration, config)


def _with_image(ids, at, size=4):
    """Put ``size`` image tokens at column ``at[b]`` of each row; token_type_ids mark them."""
    ids = ids.clone()
    types = torch.zeros_like(ids)
    for b, col in enumerate(at):
        ids[b, col:col + size] = IMAGE_TOKEN
        types[b, col:col + size] = 1
    return ids, types


def _pixels(batch, size):
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(4)).to(DEVICE)


@pytest.mark.parametrize("padding", ["none", "left"])
def test_llava_matches_sdpa(padding):
    mask = _padding(padding, 2, 12)
    ids, _ = _with_image(_ids(2, 12), at=[2, 7])
    _compare(_llava(), "sdpa", input_ids=ids, attention_mask=mask, pixel_values=_pixels(2, 14))


def test_llava_generate_same_tokens():
    mask = _padding("left", 2, 10)
    ids, _ = _with_image(_ids(2, 10), at=[1, 5])
    _same_greedy_tokens(_llava(), "sdpa", new=3, input_ids=ids, attention_mask=mask, pixel_values=_pixels(2, 14))


def _gemma3_vision():
    text = dict(DECODER, sliding_window=8, layer_types=TWO_LAYER_TYPES)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=7)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=IMAGE_TOKEN, boi_token_index=VOCAB - 3,
                                       eoi_token_index=VOCAB - 2)
    return _model(transformers.Gemma3ForConditionalGeneration, config)


@pytest.mark.parametrize("padding", ["none", "left"])
def test_gemma3_image_tokens_match_eager(padding):
    """Image tokens see each other both ways (prefix_ranges read from the mask), on sliding and global layers."""
    mask = _padding(padding, 2, 12)
    ids, types = _with_image(_ids(2, 12), at=[2, 7])
    model = _gemma3_vision()
    inputs = dict(input_ids=ids, attention_mask=mask, pixel_values=_pixels(2, 28))
    causal_only = _outputs(model, "eager", **inputs)
    _compare(model, "eager", token_type_ids=types, **inputs)
    blocks = _outputs(model, "eager", token_type_ids=types, **inputs)
    keep = mask.bool() if mask is not None else torch.ones(2, 12, dtype=torch.bool)
    assert not torch.allclose(blocks[keep], causal_only[keep], atol=ATOL, rtol=RTOL)  # the blocks mattered


def test_gemma3_image_tokens_generate_same_tokens():
    mask = _padding("left", 2, 10)
    ids, types = _with_image(_ids(2, 10), at=[1, 5])
    _same_greedy_tokens(_gemma3_vision(), "eager", new=3, input_ids=ids, attention_mask=mask, token_type_ids=types,
                        pixel_values=_pixels(2, 28))


def _visible(ranges, lo, length, window):
    """[length, length] visibility of one row's tokens (columns lo..) under pagedattn's rule."""
    n = length - lo
    pos = torch.arange(n)
    vis = visible_mask(pos, pos, causal=True, sliding_window=window, prefix_ranges=ranges)
    out = torch.zeros(length, length, dtype=torch.bool)
    out[lo:, lo:] = vis
    return out


@pytest.mark.parametrize("window", [None, 4])
def test_prefix_ranges_from_token_type_ids_match_transformers_mask(window):
    """The mapping of token_type_ids onto prefix_ranges gives, under pagedattn's visibility rule, the
    mask transformers builds for Gemma 3 (create_masks_for_vision_model) on the real tokens."""
    from transformers.models.gemma3.modeling_gemma3 import create_masks_for_vision_model, \
        get_block_sequence_ids_for_mask

    types = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0, 0, 1],
                          [0, 0, 0, 1, 1, 1, 1, 0, 1, 1],
                          [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    mask = torch.ones_like(types)
    mask[1, :2] = 0
    ranges = pa_hf.prefix_ranges_from_token_type_ids(types, mask)
    assert ranges.dtype == torch.int32 and ranges.shape == (3, 3, 2)
    assert ranges[0].tolist() == [[1, 4], [5, 7], [9, 10]]
    assert ranges[1].tolist() == [[1, 5], [6, 8], [0, 0]]  # positions from the row's first real token
    config = transformers.Gemma3TextConfig(**DECODER, sliding_window=window or 64, layer_types=TWO_LAYER_TYPES)
    config._attn_implementation = "sdpa"
    masks = create_masks_for_vision_model(config=config, inputs_embeds=torch.zeros(3, 10, 32),
                                          attention_mask=mask, cache=None, position_ids=None,
                                          block_sequence_ids=get_block_sequence_ids_for_mask(types))
    hf = masks["sliding_attention" if window else "full_attention"][:, 0]
    for b in range(3):
        lo = int((mask[b] == 0).sum())
        got = _visible(ranges[b], lo, 10, window)
        # transformers' sliding layers: (causal or same block) and window; equal to pagedattn's
        # (causal and window) or same block where no block is longer than the window reaches back
        torch.testing.assert_close(got[lo:, lo:], hf[b, lo:, lo:], rtol=0, atol=0)


# ----------------------------------------------------------------------------------- what is refused

def test_training_with_grad_raises_and_no_grad_works():
    model, _ = _decoder("llama")
    model.set_attn_implementation("pagedattn")
    ids = _ids(1, 6)
    model.train()
    try:
        with pytest.raises(RuntimeError, match="no backward pass.*no_grad.*sdpa"):
            model(input_ids=ids, labels=ids).loss.backward()
    finally:
        model.eval()
    with torch.no_grad():
        got = model(input_ids=ids).logits
    with torch.inference_mode():
        again = model(input_ids=ids).logits
    torch.testing.assert_close(got, _outputs(model, "sdpa", input_ids=ids), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(again, got, atol=0, rtol=0)


def test_grad_through_attention_function_raises():
    """Whatever requires grad (query, key, value or the sinks) is named; nothing is launched."""
    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (torch.randn(1, 2, 3, 16, device=DEVICE) for _ in range(3))
    with pytest.raises(RuntimeError, match="but key requires grad"):
        pa_hf.paged_attention_forward(module, q, k.clone().requires_grad_(), v, None)
    module.sinks = torch.nn.Parameter(torch.randn(2, device=DEVICE))
    with pytest.raises(RuntimeError, match="but sinks requires grad"):
        pa_hf.paged_attention_forward(module, q, k, v, None)
    cu = torch.tensor([0, 3], device=DEVICE)
    with pytest.raises(RuntimeError, match="but query requires grad"):
        pa_hf.varlen_attention_forward(q.clone().requires_grad_(), k[:1], v[:1], cu, cu)


def test_training_dropout_raises():
    model = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**DECODER, attention_dropout=0.1))
    model.set_attn_implementation("pagedattn")
    model.train()
    with torch.no_grad(), pytest.raises(ValueError, match="dropout"):
        model(input_ids=_ids(1, 6))


def test_output_attentions_raises():
    model, _ = _decoder("llama")
    model.set_attn_implementation("pagedattn")
    with torch.no_grad(), pytest.raises(ValueError, match="output_attentions.*eager"):
        model(input_ids=_ids(1, 6), output_attentions=True)
    with pytest.raises(ValueError, match="output_attentions"):  # in the config: transformers' own check
        model.config.output_attentions = True


def test_unregistered_name_error_names_register(monkeypatch):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.delitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "pagedattn")
    monkeypatch.setattr(pa_hf, "_REGISTERED", set())
    with pytest.raises(ValueError, match=r"not supported.*pagedattn\.integrations\.transformers\.register\(\)"):
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER, attn_implementation="pagedattn"))


def test_inexpressible_mask_raises():
    model, _ = _decoder("llama")
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool, device=DEVICE).tril()
    mask[..., 5, 2] = False  # a key hidden inside a row
    model.set_attn_implementation("pagedattn")
    with torch.no_grad(), pytest.raises(ValueError, match="not expressible"):
        model(input_ids=_ids(1, 6), attention_mask=mask)


def test_block_longer_than_window_raises():
    """transformers' sliding layers (Gemma 3) hide a block's keys beyond the window, pagedattn's
    prefix ranges do not: such a mask raises rather than computing something else."""
    model, _ = _decoder("mistral-window")  # window 4
    ar = torch.arange(8, device=DEVICE)
    block = (ar < 6)[:, None] & (ar < 6)[None, :]  # tokens 0..5: one block, longer than the window
    mask = ((ar[None] <= ar[:, None]) | block) & (ar[None] > ar[:, None] - 4)
    model.set_attn_implementation("pagedattn")
    with torch.no_grad(), pytest.raises(ValueError, match="not expressible"):
        model(input_ids=_ids(1, 8), attention_mask=mask[None, None])
