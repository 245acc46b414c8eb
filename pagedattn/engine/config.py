"""Model shapes (named presets or a Hugging Face ``config.json``) and engine settings.

Two shapes of decoder: :class:`ModelConfig` (Llama-family attention over a K/V cache) and
:class:`MLAModelConfig` (DeepSeek-V2's multi-head latent attention over a latent cache);
``PRESETS`` names both kinds.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "gpt_oss")
ATTENTION_BACKENDS = ("pagedattn", "pagedattn-2d", "sdpa", "flashinfer")
# What the engine imports beside torch and triton (pyproject's "engine" extra provides them)
ENGINE_PACKAGES = {"transformers": "model configs, RoPE tables and tokenizers"}
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape and features.

    Llama / Mistral / Qwen2 / Qwen3: RMSNorm, RoPE, GQA, SwiGLU. Gemma2 / Gemma3 add zero-centred
    norms (``norm="gemma"``), norms around attention and MLP (``sandwich_norm``), a scaled
    embedding, GELU-tanh, a query scale from ``query_pre_attn_scalar`` and logit softcaps.
    GPT-OSS adds attention sinks, biases on every projection and a top-k MoE (``num_experts``).
    ``layer_types[i]`` is ``"sliding_attention"`` (window ``sliding_window``) or
    ``"full_attention"``; empty: every layer full. ``rope_parameters``: transformers 5's dict
    (``rope_type``, ``rope_theta``, scaling keys), nested by layer type when the types differ
    (Gemma3); the tables come from transformers' own initialisers (``pagedattn.engine.rope``).
    ``hf``: the transformers config a folder was read from (what the RoPE initialisers take).
    """

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
    attention_bias: bool = False  # biases on q/k/v (Qwen2, GPT-OSS)
    o_bias: bool = False  # a bias on o_proj (GPT-OSS)
    qk_norm: bool = False  # Qwen3, Gemma3: RMSNorm of each q and k head before RoPE
    eos_token_ids: tuple = ()
    model_type: str = "llama"
    layer_types: tuple = ()
    sliding_window: int | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    attn_scale: float | None = None  # default head_size ** -0.5
    sinks: bool = False
    norm: str = "llama"  # "llama": w * x_hat cast first; "gemma": (1 + w) * x_hat in fp32; "fp32": w * x_hat in fp32
    sandwich_norm: bool = False
    embed_scale: float | None = None
    hidden_act: str = "silu"  # or "gelu_tanh"
    num_experts: int = 0
    experts_per_token: int = 0
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    rope_parameters: dict | None = None
    hf: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads {self.num_q_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if any(t not in (FULL, SLIDING) for t in self.layer_types):
            raise ValueError(f"layer_types must be {FULL!r} or {SLIDING!r}, got {sorted(set(self.layer_types))}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need sliding_window")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act must be silu or gelu_tanh, got {self.hidden_act!r}")

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (keys p - W < k <= p), or None."""
        return self.sliding_window if self.layer_type(layer) == SLIDING else None

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V one token keeps in the cache, all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * element_size

    def hf_kwargs(self) -> dict:
        """transformers config arguments of this shape (what a preset's RoPE is computed from)."""
        rope = self.rope_parameters or {"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling or {})}
        kw = dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                  num_hidden_layers=self.num_layers, num_attention_heads=self.num_q_heads,
                  num_key_value_heads=self.num_kv_heads, head_dim=self.head_size,
                  max_position_embeddings=self.max_position_embeddings, rope_parameters=dict(rope))
        if self.layer_types:
            kw.update(layer_types=list(self.layer_types), sliding_window=self.sliding_window)
        return kw


LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _alternate(n: int, period: int) -> tuple:
    """Layers ``period - 1`` sliding, then one full, repeated (Gemma2: 2, Gemma3: 6, GPT-OSS: 2)."""
    return tuple(FULL if (i + 1) % period == 0 else SLIDING for i in range(n))


_GEMMA = dict(norm="gemma", sandwich_norm=True, hidden_act="gelu_tanh", tie_word_embeddings=True, rms_norm_eps=1e-6)


def _gemma2(**kw) -> ModelConfig:
    n = kw["num_layers"]
    return ModelConfig(**_GEMMA, model_type="gemma2", layer_types=_alternate(n, 2), attn_softcap=50.0,
                       final_softcap=30.0, embed_scale=kw["hidden_size"] ** 0.5, **kw)


def _gemma3(*, local_theta=10000.0, global_rope=None, **kw) -> ModelConfig:
    n = kw["num_layers"]
    rope = {SLIDING: {"rope_type": "default", "rope_theta": local_theta},
            FULL: dict(global_rope or {"rope_type": "default", "rope_theta": 1e6})}
    return ModelConfig(**_GEMMA, model_type="gemma3_text", layer_types=_alternate(n, 6), qk_norm=True,
                       embed_scale=kw["hidden_size"] ** 0.5, rope_parameters=rope, **kw)


GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


def _gpt_oss(**kw) -> ModelConfig:
    n = kw["num_layers"]
    # YaRN stretches original_max_position_embeddings by factor to max_position_embeddings
    rope = dict(GPT_OSS_YARN, original_max_position_embeddings=kw["max_position_embeddings"] // 32)
    return ModelConfig(model_type="gpt_oss", layer_types=_alternate(n, 2), sinks=True, attention_bias=True,
                       o_bias=True, norm="fp32", rope_parameters=rope, **kw)


_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_q_heads=4, num_kv_heads=2,
             head_size=16)

PRESETS = {
    # meta-llama/Llama-3.1-8B's shape (config.json of the release)
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_q_heads=32,
        num_kv_heads=8, head_size=128, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE),
        max_position_embeddings=131072, tie_word_embeddings=False,
    ),
    # mistralai/Mistral-7B-v0.1's shape: every layer a 4096-token window
    "mistral-7b": ModelConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_q_heads=32, num_kv_heads=8,
        head_size=128, max_position_embeddings=32768, model_type="mistral", layer_types=(SLIDING,) * 32,
        sliding_window=4096,
    ),
    # google/gemma-2-9b's shape: local (4096) and global layers alternate, softcaps 50 / 30
    "gemma2-9b": _gemma2(vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_layers=42, num_q_heads=16,
                         num_kv_heads=8, head_size=256, sliding_window=4096, attn_scale=256 ** -0.5,
                         max_position_embeddings=8192),
    # google/gemma-3-4b's text decoder: 5 local (1024) layers to 1 global, global RoPE linear x8
    "gemma3-4b": _gemma3(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_layers=34, num_q_heads=8,
                         num_kv_heads=4, head_size=256, sliding_window=1024, attn_scale=256 ** -0.5,
                         max_position_embeddings=131072,
                         global_rope={"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}),
    # openai/gpt-oss-20b's attention (sinks, 128-token windows on every other layer, YaRN) with the
    # MoE replaced by a dense SwiGLU MLP of the active size (4 experts x 2880)
    "gpt-oss-20b": _gpt_oss(vocab_size=201088, hidden_size=2880, intermediate_size=4 * 2880, num_layers=24,
                            num_q_heads=64, num_kv_heads=8, head_size=64, sliding_window=128, rms_norm_eps=1e-5,
                            max_position_embeddings=131072),
    # small enough for the Triton interpreter: a 16-token generation in seconds on a CPU
    "tiny": ModelConfig(**_TINY, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048),
    "tiny-mistral": ModelConfig(**_TINY, model_type="mistral", max_position_embeddings=2048,
                                layer_types=(SLIDING,) * 2, sliding_window=8),
    "tiny-gemma2": _gemma2(**_TINY, sliding_window=8, attn_scale=16 ** -0.5, max_position_embeddings=2048),
    "tiny-gemma3": _gemma3(**dict(_TINY, num_layers=3), sliding_window=8, attn_scale=16 ** -0.5,
                           max_position_embeddings=2048),
    "tiny-gpt-oss": _gpt_oss(**dict(_TINY, vocab_size=256), sliding_window=8, max_position_embeddings=2048),
}


@dataclass(frozen=True)
class MLAModelConfig:
    """The shape of an MLA decoder (names as in DeepSeek-V2's config.json; no q compression, as
    V2-Lite). Each layer's attention caches one row ``[c_kv | k_pe]`` of ``kv_lora_rank +
    qk_rope_head_dim`` values per token, shared by every head (:mod:`pagedattn.engine.mla_model`)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int  # the dense MLP: the MoE's active size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    eos_token_ids: tuple = ()
    model_type: str = "deepseek_v2"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.qk_head_dim ** -0.5

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of the latent row one token keeps in the cache, all layers."""
        return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * element_size


MLA_PRESETS = {
    # DeepSeek-V2-Lite: 27 layers, hidden 2048, 16 heads, latent 512 + rope 64, MoE active 8 x 1408
    # (2.66 B parameters with the dense MLP, embeddings included)
    "deepseek-v2-lite": MLAModelConfig(vocab_size=102400, hidden_size=2048, num_layers=27, num_heads=16,
                                       kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                       v_head_dim=128, intermediate_size=11264, max_position_embeddings=163840),
    # the same structure at interpreter size (dims multiples of 16, as mla_decode requires)
    "tiny-mla": MLAModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, kv_lora_rank=32,
                               qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, intermediate_size=96,
                               max_position_embeddings=2048),
}

PRESETS.update(MLA_PRESETS)


def _eos(value) -> tuple:
    return () if value is None else tuple(value) if isinstance(value, (list, tuple)) else (value,)


def from_hf_config(cfg: dict) -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face ``config.json`` dict, read through transformers'
    own config class of the model type (which fills defaults and standardizes the RoPE keys)."""
    model_type = cfg.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json model_type {model_type!r} is not supported; expected one of "
                         f"{SUPPORTED_MODEL_TYPES}")
    from transformers import AutoConfig

    c = AutoConfig.for_model(**cfg)
    eos = _eos(getattr(c, "eos_token_id", None))
    if model_type == "gemma3":  # the multimodal checkpoint: its text decoder
        c, model_type = c.get_text_config(), "gemma3_text"
        eos = eos or _eos(getattr(c, "eos_token_id", None))
    gemma = model_type in ("gemma2", "gemma3_text")
    act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", "silu")
    acts = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
    if act not in acts:
        raise ValueError(f"config.json hidden activation {act!r} is not supported ({', '.join(acts)})")
    if getattr(c, "mlp_bias", False):
        raise ValueError("config.json mlp_bias=true is not supported")
    if getattr(c, "use_bidirectional_attention", False):
        raise ValueError("config.json use_bidirectional_attention=true (an encoder) is not supported")
    heads = c.num_attention_heads
    window = getattr(c, "sliding_window", None)
    layer_types = tuple(getattr(c, "layer_types", None) or ())
    if not window:
        window, layer_types = None, ()
    elif not layer_types:  # Mistral: the window on every layer
        layer_types = (SLIDING,) * c.num_hidden_layers
    if SLIDING not in layer_types:
        window, layer_types = None, ()
    rope = dict(getattr(c, "rope_parameters", None) or {})
    for params in ([rope] if "rope_type" in rope else list(rope.values())):
        kind = params.get("rope_type", "default")
        if kind not in ("default", "linear", "dynamic", "yarn", "llama3"):
            raise ValueError(f"config.json rope type {kind!r} is not supported (default, linear, dynamic, yarn, "
                             "llama3)")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("config.json partial_rotary_factor != 1 is not supported")
    qkv_bias = bool(getattr(c, "attention_bias", False)) or model_type == "qwen2"
    moe = model_type == "gpt_oss"
    return ModelConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers, num_q_heads=heads, num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_size=getattr(c, "head_dim", None) or c.hidden_size // heads,
        rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6), rope_theta=float(rope.get("rope_theta", 10000.0)),
        max_position_embeddings=getattr(c, "max_position_embeddings", 4096),
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        attention_bias=qkv_bias, o_bias=qkv_bias and model_type != "qwen2",
        qk_norm=model_type in ("qwen3", "gemma3_text"), eos_token_ids=eos, model_type=model_type,
        layer_types=layer_types, sliding_window=window,
        attn_softcap=getattr(c, "attn_logit_softcapping", None) if model_type == "gemma2" else None,
        final_softcap=getattr(c, "final_logit_softcapping", None) if gemma else None,
        attn_scale=c.query_pre_attn_scalar ** -0.5 if gemma else None,
        sinks=moe, norm="gemma" if gemma else "fp32" if moe else "llama", sandwich_norm=gemma,
        embed_scale=c.hidden_size ** 0.5 if gemma else None, hidden_act=acts[act],
        num_experts=c.num_local_experts if moe else 0, experts_per_token=c.num_experts_per_tok if moe else 0,
        swiglu_limit=getattr(c, "swiglu_limit", 7.0), swiglu_alpha=getattr(c, "swiglu_alpha", 1.702),
        rope_parameters=rope, hf=c,
    )


def resolve_model(model: str) -> tuple[ModelConfig | MLAModelConfig, str | None]:
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
