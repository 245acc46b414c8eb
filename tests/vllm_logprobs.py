"""Log-probabilities of a small model under one vLLM attention backend (for tests/test_gpu_vllm.py).

Run in a fresh process per backend, vLLM's engine in the same process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so registering pagedattn here reaches the model runner:

    python -m tests.vllm_logprobs make DIR --kind KIND  # random weights; KIND one of KINDS
    python -m tests.vllm_logprobs run DIR --backend CUSTOM [--broken]  # JSON on the last line

``make`` writes a Hugging Face checkpoint with transformers (random weights of std 0.1, so that
attention, not the weights' noise, decides the outputs; vocabulary 512, no tokenizer). ``run``
prefills four prompts (token ids) and decodes 24 tokens greedily, and prints per prompt the
log-probability of each prompt token, the generated tokens, and each step's top-20
log-probabilities. ``--broken`` registers ``CUSTOM`` as pagedattn's backend with its softmax scale
doubled: the comparison in the test must tell it apart.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

PROMPT_LENS = (5, 37, 130, 300)
DECODE_TOKENS = 24
TOP_LOGPROBS = 20
VOCAB = 512
KINDS = ("llama", "mistral", "gemma2", "gpt-oss", "deepseek", "deepseek-128")
KV_CACHE_BYTES = 1 << 30  # two layers of 1024 tokens need a few MB (MLA at 128 heads included)
WINDOW = 64  # keys of the sliding windows: the two longer prompts pass it


def make(model_dir: str, kind: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  max_position_embeddings=2048, initializer_range=0.1)
    heads = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**heads, **common))
    elif kind == "mistral":  # one sliding window on every layer
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=WINDOW, **heads, **common))
    elif kind == "gemma2":
        # windowed and global layers in turn, a scale from query_pre_attn_scalar (not head_dim), and
        # a logit cap of 5: the random weights' scores have a standard deviation near 2.5, so the
        # cap shapes them (Gemma-2's own 50 would leave them almost linear)
        config = transformers.Gemma2Config(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                                           query_pre_attn_scalar=48, attn_logit_softcapping=5.0, **heads, **common)
        model = transformers.Gemma2ForCausalLM(config)
    elif kind == "gpt-oss":
        # GPT-OSS's attention: windowed and global layers in turn, head 64, a learned sink logit a
        # head; its MoE (4 experts, 2 a token, bf16) runs vLLM's fused-MoE kernels. The sinks are
        # drawn with std 2, near the random scores' spread, so that each takes a real share of the
        # softmax (the initializer's 0.1 would leave them hardly felt)
        config = transformers.GptOssConfig(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                                           layer_types=["sliding_attention", "full_attention"], **heads, **common)
        model = transformers.GptOssForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    else:  # DeepSeek-V2's attention shape (512 + 64 latent, 128 + 64 heads), dense MLPs only: 16 heads
        # as V2-Lite (the portable decode kernel), or 128 as V3 and Kimi K2 (heads in whole 64-row
        # CTAs: on sm90 the warp-specialized Gluon decode kernel)
        heads = 128 if kind == "deepseek-128" else 16
        config = transformers.DeepseekV2Config(
            num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
            qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=128, **common)
        model = transformers.DeepseekV2ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(model_dir, safe_serialization=True)


@functools.lru_cache(maxsize=None)
def _broken_backends():
    """pagedattn's backends with the softmax scale doubled (a wrong result the check must catch);
    made once, so that every lookup of CUSTOM gets the same classes."""
    from pagedattn.integrations.vllm.backend import PagedAttnBackend, PagedAttnImpl
    from pagedattn.integrations.vllm.mla import (PagedAttnMLABackend, PagedAttnMLAImpl,
                                                 PagedAttnMLAMetadataBuilder)

    class BrokenImpl(PagedAttnImpl):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.scale *= 2

    class BrokenBackend(PagedAttnBackend):
        @staticmethod
        def get_impl_cls():
            return BrokenImpl

    class BrokenMLAImpl(PagedAttnMLAImpl):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.scale *= 2

    class BrokenMLABuilder(PagedAttnMLAMetadataBuilder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._prefill_backend.scale *= 2

    class BrokenMLABackend(PagedAttnMLABackend):
        @staticmethod
        def get_impl_cls():
            return BrokenMLAImpl

        @staticmethod
        def get_builder_cls():
            return BrokenMLABuilder

    classes = (BrokenBackend, BrokenMLABackend, BrokenImpl, BrokenMLAImpl, BrokenMLABuilder)
    for cls in classes:
        # vLLM names a backend's classes by f"{__module__}.{__qualname__}" and imports them again
        # from that name: a class local to this function must read as one of this module's
        cls.__qualname__ = cls.__name__
    return classes


def __getattr__(name: str):
    # ``BrokenCustom``: what CUSTOM resolves to under --broken, by the model being built; the
    # broken classes themselves by name (how vLLM finds them again)
    if name == "BrokenCustom":
        from pagedattn.integrations.vllm.compat import current_model_uses_mla

        mha, mla = _broken_backends()[:2]
        return mla if current_model_uses_mla() else mha
    for cls in _broken_backends():
        if cls.__name__ == name:
            return cls
    raise AttributeError(name)


def run(model_dir: str, backend: str, broken: bool) -> dict:
    import pagedattn.integrations.vllm as pa_vllm
    from vllm import LLM, SamplingParams
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    pa_vllm.register()
    if broken:
        register_backend(AttentionBackendEnum.CUSTOM, "tests.vllm_logprobs.BrokenCustom")
    # A fixed KV cache: vLLM then skips its memory profile, which reads the whole device's free
    # memory, so that another test's engine starting or exiting meanwhile cannot upset it (the
    # kinds run side by side under pytest-xdist); the utilization is then only a start-up check.
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", attention_backend=backend,
              enforce_eager=True, gpu_memory_utilization=0.05, kv_cache_memory_bytes=KV_CACHE_BYTES,
              max_model_len=1024, seed=0, enable_prefix_caching=False, enable_flashinfer_autotune=False)
    prompts = [[(7 * i + 13 * n) % VOCAB for i in range(n)] for n in PROMPT_LENS]
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, prompt_logprobs=0, logprobs=TOP_LOGPROBS,
                            detokenize=False, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    result = []
    for prompt, out in zip(prompts, outputs):
        prompt_lp = [None if lp is None else lp[tok].logprob for tok, lp in zip(prompt, out.prompt_logprobs)]
        gen = out.outputs[0]
        steps = [{str(tok): lp.logprob for tok, lp in step.items()} for step in gen.logprobs]
        result.append({"prompt_logprobs": prompt_lp, "tokens": list(gen.token_ids), "steps": steps})
    return {"backend": backend, "broken": broken, "prompts": result}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("model_dir")
    m.add_argument("--kind", choices=KINDS, required=True)
    r = sub.add_parser("run")
    r.add_argument("model_dir")
    r.add_argument("--backend", required=True)
    r.add_argument("--broken", action="store_true")
    args = p.parse_args()
    if args.cmd == "make":
        make(args.model_dir, args.kind)
        return
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    print(json.dumps(run(args.model_dir, args.backend, args.broken)))


if __name__ == "__main__":
    main()
