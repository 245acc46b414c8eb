"""A DeepSeek-V2-shaped decoder with multi-head latent attention over a paged latent cache.

Each layer's attention is DeepSeek-V2's MLA without q compression (V2-Lite): ``q_proj`` gives
per head ``[q_nope | q_pe]``; ``kv_a_proj_with_mqa`` gives per token the latent ``c_kv``
(normed by ``kv_a_layernorm``) and the shared rotary key ``k_pe``; both are written to the
layer's latent cache with :func:`pagedattn.write_mla_kv` and attended by the ``mla`` backend
(:mod:`pagedattn.backends.mla`: absorbed ``mla_decode`` for sequences of at most 8 new tokens,
``kv_b_proj`` decompression and ``varlen_attention`` for longer ones); ``o_proj`` closes it.

What is simplified against DeepSeek-V2-Lite:

* the mixture of experts (2 shared + 6 of 64 routed experts of 1408) is a **dense SwiGLU MLP of
  the active size** (8 x 1408 = 11264) on every layer, so a decode step reads the weights of
  the active experts only and has no host-side routing;
* RoPE is the plain (theta 10000) rotation of the two halves of ``q_pe`` / ``k_pe``, without
  YaRN and without DeepSeek's interleaved-pair layout (a permutation of the rope dimensions,
  which random weights do not see); the score scale is ``1 / sqrt(qk_nope + qk_rope)``.

The engine runs it like the Llama-family decoders (``LLM("deepseek-v2-lite")``, ``"tiny-mla"``
on the CPU): :func:`pagedattn.engine.attention.make_backend` gives an MLA model a
:class:`LatentCacheAttention`, which owns the latent cache of every layer and attends through
the ``mla`` backend (``attention="pagedattn"``) or :class:`SdpaMLA` (``attention="sdpa"``, SDPA
over K/V decompressed every step, the baseline). The scheduler, block manager, sampler,
chunked prefill, mixed batches and CUDA-graph decode are the engine's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedattn.engine.config import FULL, MLA_PRESETS, EngineConfig, MLAModelConfig
from pagedattn.engine.model import MLP, CausalLM, Rotary, RMSNorm, _param

__all__ = ["MLAModelConfig", "MLA_PRESETS", "MLAAttention", "MLADecoder", "random_mla_model", "SdpaMLA",
           "LatentCacheAttention"]


class MLAAttention(nn.Module):
    """Projections, RoPE of the rotary parts, the engine attention's MLA call, ``o_proj``."""

    def __init__(self, cfg: MLAModelConfig, layer: int, *, device, dtype):
        super().__init__()
        self.cfg, self.layer, self.scale = cfg, layer, cfg.scale
        h = cfg.num_heads
        self.q_proj = _param(h * cfg.qk_head_dim, cfg.hidden_size, device=device, dtype=dtype)
        self.kv_a_proj = _param(cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.hidden_size, device=device, dtype=dtype)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.kv_b_proj = _param(h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank,
                                device=device, dtype=dtype)
        self.o_proj = _param(cfg.hidden_size, h * cfg.v_head_dim, device=device, dtype=dtype)
        self._weights = None

    def weights(self):
        """The backend's view of ``kv_b_proj`` (made once, after the weights are filled)."""
        from pagedattn.backends.mla import MLAWeights

        if self._weights is None:
            self._weights = MLAWeights.from_kv_b_proj(self.kv_b_proj, num_heads=self.cfg.num_heads,
                                                      qk_nope_head_dim=self.cfg.qk_nope_head_dim,
                                                      v_head_dim=self.cfg.v_head_dim)
        return self._weights

    def project(self, x, positions, rotary: Rotary):
        """x ``[n, hidden]`` -> q_nope ``[n, H, nope]``, q_pe ``[n, H, rope]`` (rotated), c_kv
        ``[n, latent]`` (normed), k_pe ``[n, rope]`` (rotated)."""
        cfg, n = self.cfg, x.shape[0]
        q = F.linear(x, self.q_proj).view(n, cfg.num_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        ckv = F.linear(x, self.kv_a_proj)
        c_kv, k_pe = ckv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_norm(c_kv.contiguous())[0]
        q_pe, k_pe = rotary(q_pe.contiguous(), k_pe.contiguous().view(n, 1, -1), positions)
        return q_nope.contiguous(), q_pe, c_kv, k_pe.view(n, -1)

    def forward(self, x, positions, rotary, attn, meta) -> torch.Tensor:
        q_nope, q_pe, c_kv, k_pe = self.project(x, positions, rotary)
        out = attn(self.layer, q_nope, q_pe, c_kv, k_pe, meta, self)  # [n, H, v_head_dim]
        return F.linear(out.reshape(x.shape[0], -1), self.o_proj)


class MLADecoderLayer(nn.Module):
    def __init__(self, cfg: MLAModelConfig, layer: int, *, device, dtype):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.attn = MLAAttention(cfg, layer, device=device, dtype=dtype)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.mlp = MLP(cfg, device=device, dtype=dtype)  # reads hidden_size, intermediate_size, hidden_act

    def forward(self, x, residual, positions, rotary, attn, meta):
        h, residual = self.input_norm(x, residual)
        h = self.attn(h, positions, rotary, attn, meta)
        h, residual = self.post_norm(h, residual)
        return self.mlp(h), residual


class MLADecoder(CausalLM):
    """Embedding, MLA decoder layers, final norm, lm_head; parameters filled by :func:`random_mla_model`.

    Called by the engine's runner as :class:`pagedattn.engine.model.DecoderModel` is; ``fused``
    (default: on CUDA) runs the norms, RoPE and SiLU-and-multiply as Triton kernels.
    """

    def __init__(self, cfg: MLAModelConfig, *, device="cpu", dtype=torch.float32, fused: bool | None = None):
        super().__init__()
        self.config = cfg
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(MLADecoderLayer(cfg, i, device=device, dtype=dtype)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.lm_head = _param(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        rope = cfg.qk_rope_head_dim
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, rope, 2, dtype=torch.float32) / rope)
        self.rotaries = nn.ModuleDict({FULL: Rotary(None, device=device, inv_freq=inv_freq)})
        self.set_fused(torch.device(device).type == "cuda" if fused is None else fused)

    def forward(self, input_ids, positions, attn, meta) -> torch.Tensor:
        """input_ids, positions ``[n]`` int64; ``attn`` a :class:`LatentCacheAttention` and ``meta``
        the step's metadata -> final hidden states ``[n, hidden]``."""
        x, residual = F.embedding(input_ids, self.embed), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotaries[FULL], attn, meta)
        return self.norm(x, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)


def random_mla_model(cfg: MLAModelConfig, *, device="cpu", dtype=torch.float32, seed: int = 0) -> MLADecoder:
    """N(0, 1 / sqrt(fan_in)) matrices and unit norms, generated on ``device`` in ``dtype``."""
    model = MLADecoder(cfg, device=device, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "embed":
                p.normal_(0.0, 1.0, generator=g)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
    return model


# The state of a decode batch's metadata that SdpaMLA reads as one padded batch (see SdpaMLA).
PADDED_DECODE = "padded_decode"


class SdpaMLA:
    """The baseline MLA attention: K ``[.., H, qk_nope + qk_rope]`` and V ``[.., H, v_head_dim]``
    decompressed with ``kv_b_proj`` from the latent rows of every context at every step, then
    torch SDPA. Same ``plan`` / ``forward`` calls as the ``mla`` backend.

    Per sequence (what ``plan`` makes): its ``seq_len`` rows, an explicit causal mask (the new
    tokens are the last queries). A decode batch whose metadata state is :data:`PADDED_DECODE`
    (the engine's CUDA-graph decode): one token per row of the block table, every row's pages
    decompressed to the table's width and the keys past its ``seq_lens`` masked, so that the
    shapes, and the graph, do not depend on the lengths (as the Llama baseline reads its static
    cache to ``max_model_len`` with a key mask).
    """

    name = "sdpa"

    def plan(self, block_table, seq_lens, query_start_loc, config, **_options):
        from pagedattn.backends.base import BatchMetadata

        return BatchMetadata.from_tensors(block_table, seq_lens, query_start_loc, backend=self.name)

    @staticmethod
    def _decompress(rows, weights, dtype, kv_scale):
        """Latent rows ``[.., latent + rope]`` -> K ``[.., H, nope + rope]``, V ``[.., H, v]`` in ``dtype``."""
        from pagedattn.backends._common import scale_value

        if rows.dtype == torch.float8_e4m3fn:
            rows = rows.float() * scale_value(kv_scale)
        rows = rows.to(dtype)
        latent, heads, nope = weights.kv_lora_rank, weights.num_heads, weights.qk_nope_head_dim
        kv = (rows[..., :latent] @ weights.kv_b_proj.t()).unflatten(-1, (heads, nope + weights.v_head_dim))
        k_pe = rows[..., None, latent:].expand(*kv.shape[:-1], rows.shape[-1] - latent)
        return torch.cat([kv[..., :nope], k_pe], dim=-1), kv[..., nope:]

    def forward(self, q_nope, q_pe, kv_cache, metadata, *, weights, scale, kv_scale=None, out=None):
        from pagedattn.adapters import sdpa

        n, heads, _ = q_nope.shape
        if out is None:
            out = torch.empty(n, heads, weights.v_head_dim, dtype=q_nope.dtype, device=q_nope.device)
        q = torch.cat([q_nope, q_pe], dim=-1)  # [n, H, nope + rope]
        block_size = kv_cache.shape[1]
        if metadata.state == PADDED_DECODE:
            table = metadata.block_table  # [n, pages]: row r holds token r's sequence
            if table.shape[0] != n:
                raise ValueError(f"metadata: a padded decode batch has one token per block-table row, got {n} "
                                 f"tokens for {table.shape[0]} rows")
            keys = table.shape[1] * block_size
            rows = kv_cache.index_select(0, table.reshape(-1).long()).view(n, keys, -1)
            k, v = self._decompress(rows, weights, q.dtype, kv_scale)  # [n, keys, H, ..]
            mask = torch.arange(keys, device=q.device)[None, :] < metadata.seq_lens[:, None]  # [n, keys]
            o = sdpa.call(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None],
                          scale=scale)  # [n, H, 1, v]
            out.copy_(o[:, :, 0])
            return out
        qsl, lens = metadata.query_start_loc_host, metadata.seq_lens_host
        for s, seq_len in enumerate(lens):
            q0, q1 = qsl[s], qsl[s + 1]
            if q1 == q0:
                continue
            pages = metadata.block_table[s, : -(-seq_len // block_size)].long()
            rows = kv_cache.index_select(0, pages).flatten(0, 1)[:seq_len]
            k, v = self._decompress(rows, weights, q.dtype, kv_scale)  # [seq_len, H, ..]
            mask = sdpa.visible(sdpa.query_positions(q1 - q0, seq_len, q.device), seq_len, causal=True,
                                sliding_window=None, prefix_rows=None)
            out[q0:q1] = sdpa.attend(q[q0:q1], k, v, mask=mask, scale=scale)
        return out


@dataclass(frozen=True)
class _GraphDecode:
    """The plan of every captured decode graph: nothing to re-plan per replay (see
    :meth:`LatentCacheAttention.graph_plan`)."""

    max_seq_len: int


class LatentCacheAttention:
    """The engine attention of an MLA model: the latent cache ``[num_layers, num_blocks,
    block_size, kv_lora_rank + qk_rope_head_dim]`` (pages from the engine's block manager), written
    per layer with :func:`pagedattn.write_mla_kv`, attended by the ``mla`` backend
    (``attention="pagedattn"``) or :class:`SdpaMLA` (``"sdpa"``). Called per layer as
    ``attn(layer, q_nope, q_pe, c_kv, k_pe, meta, mod)`` (``mod``: the layer's
    :class:`MLAAttention`, its ``kv_b_proj`` weights and scale).

    Eager steps are planned by the backend's own ``plan`` in :meth:`prepare`, from the step's
    device metadata (one host read of ``query_start_loc`` and ``seq_lens``). CUDA-graph decode:
    the ``mla`` backend's absorbed path alone over the static buffers, ``mla_decode`` given
    ``max_seq_len = max_model_len`` so that its split count, and the graph, are the same at
    every length; SdpaMLA's padded decode batch.
    """

    def __init__(self, mcfg: MLAModelConfig, ecfg: EngineConfig, *, device, dtype):
        from pagedattn.backends import BackendConfig, get_backend

        if ecfg.attention not in ("pagedattn", "sdpa"):
            raise ValueError(f"attention {ecfg.attention!r} cannot serve the MLA model {mcfg.model_type}: use "
                             "'pagedattn' (the mla backend) or 'sdpa' (SDPA over decompressed K/V)")
        self.name = ecfg.attention
        self.config = BackendConfig(device, dtype, head_size=mcfg.qk_head_dim, num_q_heads=mcfg.num_heads,
                                    num_kv_heads=1)
        if ecfg.attention == "pagedattn":
            self.impl = get_backend("mla")
            reasons = self.impl.validate(self.config)
            if reasons:
                raise ValueError(f"the mla backend cannot serve {mcfg.model_type}: " + "; ".join(reasons))
            self.plan_options = {"block_size": ecfg.block_size}  # the decompressed path's rows, made in plan
            self.note = ("mla backend (absorbed mla_decode for <= 8 new tokens, decompressed varlen_attention "
                         "beyond)")
        else:
            self.impl, self.plan_options = SdpaMLA(), {}
            self.note = "torch SDPA over K/V decompressed from the latent cache every step"
        self.max_len = ecfg.max_model_len
        self.kv_cache = torch.zeros(mcfg.num_layers, ecfg.num_blocks, ecfg.block_size,
                                    mcfg.kv_lora_rank + mcfg.qk_rope_head_dim, device=device, dtype=dtype)

    def decode_layout(self, seqs):
        return list(seqs)

    def step_plan(self, qsl, lens, table=None):
        return None  # planned in prepare, from the device tensors the backends read

    def graph_plan(self, max_rows: int, **_):
        return _GraphDecode(self.max_len)

    def update_graph_plan(self, plan, qsl, lens, bucket=None) -> None:
        pass  # the graphs read seq_lens and the block table from the static buffers

    def prepare(self, meta) -> None:
        """Set ``meta.plan`` to the backend's metadata of the step (module docstring)."""
        if isinstance(meta.plan, _GraphDecode):
            meta.plan = self._graph_decode_metadata(meta, meta.plan.max_seq_len)
        else:
            meta.plan = self.impl.plan(meta.block_table, meta.seq_lens, meta.query_start_loc, self.config,
                                       **self.plan_options)

    def _graph_decode_metadata(self, meta, max_seq_len: int):
        """A decode bucket's metadata without reading its device tensors (what a capture allows):
        the host lists describe every row as one query of at most ``max_seq_len`` keys; padding rows
        have no query in ``query_start_loc``, so the kernels skip them."""
        from pagedattn.backends.base import BatchMetadata
        from pagedattn.backends.mla import DEFAULT_DECODE_THRESHOLD, MLAPlan, _MLAPart

        size = meta.decode_rows
        md = BatchMetadata(block_table=meta.block_table, seq_lens=meta.seq_lens, query_start_loc=meta.query_start_loc,
                           query_start_loc_host=list(range(size + 1)), seq_lens_host=[max_seq_len] * size,
                           max_query_len=1, max_seq_len=max_seq_len, backend=self.impl.name)
        if isinstance(self.impl, SdpaMLA):
            md.state = PADDED_DECODE
        else:
            part = _MLAPart(seqs=list(range(size)), tokens=slice(0, size), metadata=md)
            md.state = MLAPlan(parts={"absorbed": part}, config=self.config, decode_threshold=DEFAULT_DECODE_THRESHOLD)
        return md

    def __call__(self, layer: int, q_nope, q_pe, c_kv, k_pe, meta, mod) -> torch.Tensor:
        """q_nope ``[n, H, qk_nope]``, q_pe ``[n, H, qk_rope]`` (rotated), c_kv ``[n, kv_lora_rank]``,
        k_pe ``[n, qk_rope]`` (rotated) -> ``[n, H, v_head_dim]``."""
        from pagedattn.mla import write_mla_kv

        cache = self.kv_cache[layer]
        write_mla_kv(c_kv, k_pe, cache, meta.slot_mapping)
        return self.impl.forward(q_nope, q_pe, cache, meta.plan, weights=mod.weights(), scale=mod.scale)
