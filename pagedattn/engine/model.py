"""The decoder: Llama / Mistral / Qwen2 / Qwen3 (RMSNorm, RoPE with Llama-3 scaling, GQA, SwiGLU).

Tokens of all sequences of a step are packed back to back (``[num_tokens, hidden]``); each
layer's attention is an engine attention backend (``pagedattn.engine.attention``), called with
the step's metadata. Projections are fused: one ``qkv`` matrix (q rows, then k, then v) and one
``gate_up`` matrix (gate rows, then up), as the weight loader fills them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedattn.engine.config import ModelConfig


def _param(*shape, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))``, normalized in fp32 and cast back before the weight.

    ``forward(x, residual)`` first forms ``x + residual`` (the residual stream) and returns
    (normed, the new residual); ``fused``: one Triton kernel that updates ``residual`` in place.
    """

    def __init__(self, size: int, eps: float, *, device, dtype):
        super().__init__()
        self.eps = eps
        self.weight = _param(size, device=device, dtype=dtype)
        self.fused = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused:
            from pagedattn.engine.kernels import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype), x


def rope_inv_freq(head_size: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """``[head_size // 2]`` fp32 inverse frequencies; ``scaling`` rope_type "llama3" stretches the
    low frequencies by ``factor`` and blends the band between low_freq_factor and high_freq_factor."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
    if not scaling:
        return inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class Rotary(nn.Module):
    """cos/sin tables ``[max_len, head_size // 2]`` fp32; rotates the two halves of each head."""

    def __init__(self, cfg: ModelConfig, *, device):
        super().__init__()
        self.inv_freq = rope_inv_freq(cfg.head_size, cfg.rope_theta, cfg.rope_scaling).to(device)
        self.cos = self.sin = None
        self.max_len = 0
        self.fused = False

    def build(self, max_len: int) -> None:
        if max_len <= self.max_len:
            return
        freqs = torch.arange(max_len, device=self.inv_freq.device, dtype=torch.float32)[:, None] * self.inv_freq[None]
        self.cos, self.sin, self.max_len = freqs.cos(), freqs.sin(), max_len

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
    def __init__(self, cfg: ModelConfig, layer: int, *, device, dtype):
        super().__init__()
        self.layer = layer
        self.num_q_heads, self.num_kv_heads, self.head_size = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size
        qkv_rows = (cfg.num_q_heads + 2 * cfg.num_kv_heads) * cfg.head_size
        self.qkv_weight = _param(qkv_rows, cfg.hidden_size, device=device, dtype=dtype)
        self.qkv_bias = _param(qkv_rows, device=device, dtype=dtype) if cfg.attention_bias else None
        self.o_weight = _param(cfg.hidden_size, cfg.num_q_heads * cfg.head_size, device=device, dtype=dtype)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_size, cfg.rms_norm_eps, device=device, dtype=dtype)
            self.k_norm = RMSNorm(cfg.head_size, cfg.rms_norm_eps, device=device, dtype=dtype)

    def forward(self, x, positions, rotary: Rotary, attn, meta) -> torch.Tensor:
        n = x.shape[0]
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_size
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        q, k = rotary(q, k, positions)
        out = attn(self.layer, q, k, v, meta)  # [num_tokens, hq, d]
        return F.linear(out.view(n, hq * d), self.o_weight)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig, *, device, dtype):
        super().__init__()
        self.gate_up_weight = _param(2 * cfg.intermediate_size, cfg.hidden_size, device=device, dtype=dtype)
        self.down_weight = _param(cfg.hidden_size, cfg.intermediate_size, device=device, dtype=dtype)
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, self.gate_up_weight)
        if self.fused:
            from pagedattn.engine.kernels import silu_and_mul

            return F.linear(silu_and_mul(gate_up), self.down_weight)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_weight)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, device, dtype):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.attn = Attention(cfg, layer, device=device, dtype=dtype)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.mlp = MLP(cfg, device=device, dtype=dtype)

    def forward(self, x, residual, positions, rotary, attn, meta):
        """(x, residual) -> (this layer's MLP output, the residual stream before it)."""
        h, residual = self.input_norm(x, residual)
        h = self.attn(h, positions, rotary, attn, meta)
        h, residual = self.post_norm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm and lm_head (the embedding when tied).

    Parameters are allocated uninitialized; :mod:`pagedattn.engine.weights` fills them.
    ``fused`` (default: on CUDA) runs the norms, RoPE and SiLU-and-multiply as Triton kernels
    (:mod:`pagedattn.engine.kernels`) instead of several torch operations each.
    """

    def __init__(self, cfg: ModelConfig, *, device="cpu", dtype=torch.float32, fused: bool | None = None):
        super().__init__()
        self.config = cfg
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, device=device, dtype=dtype) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size,
                                                                   device=device, dtype=dtype)
        self.rotary = Rotary(cfg, device=device)
        self.set_fused(torch.device(device).type == "cuda" if fused is None else fused)

    def set_fused(self, fused: bool) -> None:
        for m in [self.norm, self.rotary] + [x for layer in self.layers for x in (
                layer.input_norm, layer.post_norm, layer.mlp)]:
            m.fused = fused

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn, meta) -> torch.Tensor:
        """input_ids, positions ``[num_tokens]`` int64 -> final hidden states ``[num_tokens, hidden]``."""
        x, residual = F.embedding(input_ids, self.embed), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary, attn, meta)
        return self.norm(x, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab_size]`` in the model's dtype."""
        return F.linear(hidden, self.embed if self.lm_head is None else self.lm_head)

    def weight_bytes(self, *, read_per_decode_step: bool = False) -> int:
        """Bytes of the parameters; ``read_per_decode_step``: without the input embedding table
        (a decode step gathers a few of its rows) unless it is also the lm_head."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        if read_per_decode_step and self.lm_head is not None:
            total -= self.embed.numel() * self.embed.element_size()
        return total
