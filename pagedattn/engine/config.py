"""Model shapes (named presets or a Hugging Face ``config.json``) and engine settings."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ATTENTION_BACKENDS = ("pagedattn", "pagedattn-2d", "sdpa")


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape: Llama / Mistral / Qwen2 / Qwen3 (RMSNorm, RoPE, GQA, SwiGLU)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q/k/v
    qk_norm: bool = False  # Qwen3: RMSNorm of each q and k head before RoPE
    eos_token_ids: tuple = ()
    model_type: str = "llama"

    def __post_init__(self):
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads {self.num_q_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")


LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS = {
    # meta-llama/Llama-3.1-8B's shape (config.json of the release)
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_q_heads=32,
        num_kv_heads=8, head_size=128, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE),
        max_position_embeddings=131072, tie_word_embeddings=False,
    ),
    # small enough for the Triton interpreter: a 16-token generation in seconds on a CPU
    "tiny": ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_q_heads=4, num_kv_heads=2,
        head_size=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
    ),
}


def from_hf_config(cfg: dict) -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face ``config.json`` dict (transformers 4 or 5 keys)."""
    model_type = cfg.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json model_type {model_type!r} is not supported; expected one of "
                         f"{SUPPORTED_MODEL_TYPES}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", model_type == "mistral"):
        raise ValueError(f"config.json sliding_window={window}: sliding-window models are not supported")
    # transformers 5 keeps theta and scaling in rope_parameters; 4.x in rope_theta / rope_scaling
    rope = dict(cfg.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = rope or cfg.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind != "llama3":
            raise ValueError(f"config.json rope type {kind!r} is not supported (default or llama3)")
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    return ModelConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"], num_q_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_size=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type == "qwen3", eos_token_ids=eos, model_type=model_type,
    )


def resolve_model(model: str) -> tuple[ModelConfig, str | None]:
    """(config, folder): a preset name gives (preset, None); a folder gives its config.json."""
    if model in PRESETS:
        return PRESETS[model], None
    if not os.path.isdir(model):
        raise ValueError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor an existing folder")
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model folder {model!r} has no config.json")
    with open(path) as f:
        return from_hf_config(json.load(f)), model


@dataclass
class EngineConfig:
    """How the engine runs a model.

    ``max_num_batched_tokens`` is the token budget of one step (prompts longer than it are
    prefilled in chunks); ``num_blocks`` defaults to enough pages for ``max_num_seqs`` sequences
    of ``max_model_len`` tokens (plus one spare). ``cuda_graph_sizes``: the decode batch sizes
    captured as CUDA graphs (default 1, 2, 4, 8, then multiples of 16 up to ``max_num_seqs``).
    """

    max_model_len: int = 2048
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_blocks: int | None = None
    attention: str = "pagedattn"
    device: str = "cpu"
    dtype: str = "float32"
    enforce_eager: bool = False
    cuda_graph_sizes: list = field(default_factory=list)
    seed: int = 0

    def __post_init__(self):
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {self.attention!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks is None:
            self.num_blocks = self.max_num_seqs * -(-self.max_model_len // self.block_size) + 1
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not self.cuda_graph_sizes:
            sizes = [b for b in (1, 2, 4, 8) if b < self.max_num_seqs]
            sizes += list(range(16, self.max_num_seqs, 16)) + [self.max_num_seqs]
            self.cuda_graph_sizes = sorted(set(sizes))
        self.cuda_graph_sizes = sorted({int(b) for b in self.cuda_graph_sizes if 0 < int(b) <= self.max_num_seqs})
