"""The decoder: Llama / Mistral / Qwen2 / Qwen3, Gemma2 / Gemma3 (text) and GPT-OSS.

Tokens of all sequences of a step are packed back to back (``[num_tokens, hidden]``); each
layer's attention is an engine attention backend (``pagedattn.engine.attention``), called with
the step's metadata and the layer's attention module, whose ``scale``, ``sliding_window``,
``softcap`` and ``sinks`` the backend applies. Projections are fused: one ``qkv`` matrix (q
rows, then k, then v) and one ``gate_up`` matrix (gate rows, then up), as the weight loader
fills them. GPT-OSS's experts keep the checkpoint's layout (``[experts, hidden, 2 * inter]``,
gate and up interleaved).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedattn.engine.config import FULL, ModelConfig


def _param(*shape, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    """``x_hat = x / sqrt(mean(x^2) + eps)`` in fp32, then by ``style``: ``"llama"``
    ``weight * x_hat.to(dtype)``; ``"gemma"`` ``(x_hat * (1 + weight)).to(dtype)``; ``"fp32"``
    ``(weight * x_hat).to(dtype)`` (GPT-OSS).

    ``forward(x, residual)`` first forms ``x + residual`` (the residual stream) and returns
    (normed, the new residual); ``fused``: one Triton kernel that updates ``residual`` in place.
    """

    def __init__(self, size: int, eps: float, *, device, dtype, style: str = "llama"):
        super().__init__()
        self.eps, self.style = eps, style
        self.weight = _param(size, device=device, dtype=dtype)
        self.fused = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused and x.dim() == 2:
            from pagedattn.engine.kernels import rms_norm

            return rms_norm(x, self.weight, self.eps, residual, style=self.style)
        if residual is not None:
            x = x + residual
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style == "gemma":
            return (x32 * (1.0 + self.weight.float())).to(x.dtype), x
        if self.style == "fp32":
            return (self.weight.float() * x32).to(x.dtype), x
        return self.weight * x32.to(x.dtype), x


class Rotary(nn.Module):
    """cos/sin tables ``[max_len, head_size // 2]`` fp32 (times the RoPE type's attention
    scaling, as transformers applies it); rotates the two halves of each head.

    ``inv_freq`` and the scaling come from transformers' initialiser of the layer type's RoPE
    (:mod:`pagedattn.engine.rope`), or are given directly.
    """

    def __init__(self, cfg: ModelConfig | None = None, *, device, layer_type: str = FULL,
                 inv_freq: torch.Tensor | None = None, scaling: float = 1.0):
        super().__init__()
        self.cfg, self.layer_type = cfg, layer_type
        self.inv_freq, self.scaling = None if inv_freq is None else inv_freq.to(device), scaling
        self.device = torch.device(device)
        self.cos = self.sin = None
        self.max_len = 0
        self.fused = False

    def build(self, max_len: int) -> None:
        if max_len <= self.max_len:
            return
        if self.inv_freq is None or self.cfg is not None:
            from pagedattn.engine.rope import inv_freq_and_scaling

            inv_freq, self.scaling = inv_freq_and_scaling(self.cfg, self.layer_type, max_len)
            self.inv_freq = inv_freq.to(self.device)
        freqs = torch.arange(max_len, device=self.device, dtype=torch.float32)[:, None] * self.inv_freq[None]
        self.cos, self.sin, self.max_len = freqs.cos() * self.scaling, freqs.sin() * self.scaling, max_len

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos = self.cos[positions].to(x.dtype)[:, None]  # [num_tokens, 1, head_size // 2]
        sin = self.sin[positions].to(x.dtype)[:, None]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q ``[num_tokens, num_q_heads, head_size]``, k ``[num_tokens, num_kv_heads, head_size]``,
        positions ``[num_tokens]`` int64 -> rotated (q, k), new contiguous tensors."""
        if self.fused:
            from pagedattn.engine.kernels import rope

            return rope(q, k, self.cos, self.sin, positions)
        return self._rotate(q, positions), self._rotate(k, positions)


class Attention(nn.Module):
    """QKV projection, optional q/k norms, RoPE, the backend's attention, output projection.

    What the backend applies: ``scale`` (None: ``head_size ** -0.5``), ``sliding_window`` (None
    on full layers), ``softcap`` and ``sinks`` (``[num_q_heads]`` fp32, GPT-OSS).
    """

    def __init__(self, cfg: ModelConfig, layer: int, *, device, dtype):
        super().__init__()
        self.layer = layer
        self.num_q_heads, self.num_kv_heads, self.head_size = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size
        qkv_rows = (cfg.num_q_heads + 2 * cfg.num_kv_heads) * cfg.head_size
        self.qkv_weight = _param(qkv_rows, cfg.hidden_size, device=device, dtype=dtype)
        self.qkv_bias = _param(qkv_rows, device=device, dtype=dtype) if cfg.attention_bias else None
        self.o_weight = _param(cfg.hidden_size, cfg.num_q_heads * cfg.head_size, device=device, dtype=dtype)
        self.o_bias = _param(cfg.hidden_size, device=device, dtype=dtype) if cfg.o_bias else None
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            style = "gemma" if cfg.norm == "gemma" else "llama"
            self.q_norm = RMSNorm(cfg.head_size, cfg.rms_norm_eps, device=device, dtype=dtype, style=style)
            self.k_norm = RMSNorm(cfg.head_size, cfg.rms_norm_eps, device=device, dtype=dtype, style=style)
        self.scale = cfg.attn_scale
        self.sliding_window = cfg.window(layer)
        self.softcap = cfg.attn_softcap
        self.sinks = _param(cfg.num_q_heads, device=device, dtype=torch.float32) if cfg.sinks else None

    def forward(self, x, positions, rotary: Rotary, attn, meta) -> torch.Tensor:
        n = x.shape[0]
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_size
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        q, k = rotary(q, k, positions)
        out = attn(self.layer, q, k, v, meta, self)  # [num_tokens, hq, d]
        return F.linear(out.view(n, hq * d), self.o_weight, self.o_bias)


class MLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))``, act SiLU (SwiGLU) or GELU-tanh (Gemma)."""

    def __init__(self, cfg: ModelConfig, *, device, dtype):
        super().__init__()
        self.gate_up_weight = _param(2 * cfg.intermediate_size, cfg.hidden_size, device=device, dtype=dtype)
        self.down_weight = _param(cfg.hidden_size, cfg.intermediate_size, device=device, dtype=dtype)
        self.act = cfg.hidden_act
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, self.gate_up_weight)
        if self.fused and self.act == "silu":
            from pagedattn.engine.kernels import silu_and_mul

            return F.linear(silu_and_mul(gate_up), self.down_weight)
        gate, up = gate_up.chunk(2, dim=-1)
        gate = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        return F.linear(gate * up, self.down_weight)


class MoE(nn.Module):
    """GPT-OSS's mixture of experts: a router picks ``experts_per_token`` experts per token
    (softmax over their logits); each expert is ``down((up + 1) * glu(gate)) + bias`` with
    ``glu(g) = g * sigmoid(alpha * g)`` and gate / up clamped to ``limit``, as transformers
    computes it. Experts run on the tokens routed to them (host-side lists: no CUDA graphs)."""

    graph_safe = False

    def __init__(self, cfg: ModelConfig, *, device, dtype):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.top_k, self.limit, self.alpha = cfg.experts_per_token, cfg.swiglu_limit, cfg.swiglu_alpha
        self.router_weight = _param(e, h, device=device, dtype=dtype)
        self.router_bias = _param(e, device=device, dtype=dtype)
        self.gate_up = _param(e, h, 2 * i, device=device, dtype=dtype)
        self.gate_up_bias = _param(e, 2 * i, device=device, dtype=dtype)
        self.down = _param(e, i, h, device=device, dtype=dtype)
        self.down_bias = _param(e, h, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router_weight, self.router_bias)  # [n, experts]
        top, chosen = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=top.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():
            token, slot = torch.where(chosen == e)
            gate_up = x[token] @ self.gate_up[e] + self.gate_up_bias[e]
            gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
            h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
            y = h @ self.down[e] + self.down_bias[e]
            out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, device, dtype):
        super().__init__()
        norm = dict(device=device, dtype=dtype, style=cfg.norm)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)
        self.attn = Attention(cfg, layer, device=device, dtype=dtype)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)  # before the MLP
        self.sandwich = cfg.sandwich_norm
        if self.sandwich:  # Gemma: post_norm closes the attention; these open and close the MLP
            self.pre_mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)
            self.post_mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)
        self.mlp = MoE(cfg, device=device, dtype=dtype) if cfg.num_experts else MLP(cfg, device=device, dtype=dtype)

    def forward(self, x, residual, positions, rotary, attn, meta):
        """(x, residual) -> (this layer's MLP output, the residual stream before it)."""
        h, residual = self.input_norm(x, residual)
        h = self.attn(h, positions, rotary, attn, meta)
        if not self.sandwich:
            h, residual = self.post_norm(h, residual)
            return self.mlp(h), residual
        h, residual = self.pre_mlp_norm(self.post_norm(h)[0], residual)
        return self.post_mlp_norm(self.mlp(h))[0], residual


class CausalLM(nn.Module):
    """What the runner reads of any decoder (:class:`DecoderModel`, the MLA decoder of
    :mod:`pagedattn.engine.mla_model`): ``embed``, ``lm_head`` (None when tied), ``rotaries`` and
    ``graph_safe``; the device, dtype, rotary tables, fused kernels and weight bytes from them."""

    graph_safe = True

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def build_rotary(self, max_len: int) -> None:
        for r in self.rotaries.values():
            r.build(max_len)

    def set_fused(self, fused: bool) -> None:
        """Norms, RoPE and SiLU-and-multiply as Triton kernels (:mod:`pagedattn.engine.kernels`) or torch."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, Rotary, MLP)):
                m.fused = fused

    def weight_bytes(self, *, read_per_decode_step: bool = False) -> int:
        """Bytes of the parameters; ``read_per_decode_step``: without the input embedding table
        (a decode step gathers a few of its rows) unless it is also the lm_head."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        if read_per_decode_step and self.lm_head is not None:
            total -= self.embed.numel() * self.embed.element_size()
        return total


class DecoderModel(CausalLM):
    """Embedding (times ``embed_scale``, Gemma), decoder layers, final norm and lm_head (the
    embedding when tied), logits softcapped by ``final_softcap`` (Gemma2).

    Parameters are allocated uninitialized; :mod:`pagedattn.engine.weights` fills them.
    ``fused`` (default: on CUDA) runs the norms, RoPE and SiLU-and-multiply as Triton kernels
    (:mod:`pagedattn.engine.kernels`) instead of several torch operations each. One
    :class:`Rotary` per layer type (Gemma3's local and global layers differ).
    ``graph_safe``: False when a layer needs host-side control flow (GPT-OSS's experts), so
    decode runs eagerly.
    """

    def __init__(self, cfg: ModelConfig, *, device="cpu", dtype=torch.float32, fused: bool | None = None):
        super().__init__()
        self.config = cfg
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, device=device, dtype=dtype) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype, style=cfg.norm)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size,
                                                                   device=device, dtype=dtype)
        types = sorted({cfg.layer_type(i) for i in range(cfg.num_layers)})
        self.rotaries = nn.ModuleDict({t: Rotary(cfg, device=device, layer_type=t) for t in types})
        self.graph_safe = not cfg.num_experts  # MoE routing is host-side control flow
        self.set_fused(torch.device(device).type == "cuda" if fused is None else fused)

    @property
    def rotary(self) -> Rotary:
        """The rotary of full-attention layers (of the only layer type when there is one)."""
        return self.rotaries[FULL] if FULL in self.rotaries else next(iter(self.rotaries.values()))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn, meta) -> torch.Tensor:
        """input_ids, positions ``[num_tokens]`` int64 -> final hidden states ``[num_tokens, hidden]``."""
        x, residual = F.embedding(input_ids, self.embed), None
        if self.config.embed_scale is not None:  # the scale rounded to the model's dtype, as transformers does
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, self.rotaries[self.config.layer_type(i)], attn, meta)
        return self.norm(x, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab_size]`` in the model's dtype (fp32 when softcapped)."""
        logits = F.linear(hidden, self.embed if self.lm_head is None else self.lm_head)
        cap = self.config.final_softcap
        if cap:
            logits = torch.tanh(logits.float() / cap) * cap
        return logits