"""A minimal inference engine on pagedattn: ``LLM(model).generate(prompts, max_tokens, temperature, ...)``.

One file per concern: config (presets, engine settings), tokenizer, weights, model, mla_model (the
DeepSeek-V2-shaped MLA decoder and its latent-cache attention), rope (tables from transformers'
initialisers), attention (backends: pagedattn, pagedattn-2d, sdpa),
block_manager, scheduler, sampler, runner (per-step metadata, plans, CUDA graphs), llm (the
user-facing API), cli (``pagedattn generate``). docs/engine.md describes what it runs.
"""

from pagedattn.engine.config import PRESETS, EngineConfig, ModelConfig
from pagedattn.engine.llm import LLM, Engine, RequestOutput
from pagedattn.engine.sequence import SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "ModelConfig", "PRESETS", "RequestOutput", "SamplingParams"]
