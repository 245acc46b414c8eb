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

:class:`MLAStepper` runs greedy generation on it with a paged latent cache, chunked prefill
and mixed batches (prefill, extend and decode sequences in one step); it is not wired into
:class:`pagedattn.engine.LLM` or ``bench e2e``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedattn.engine.model import MLP, Rotary, RMSNorm

__all__ = ["MLAModelConfig", "MLA_PRESETS", "MLAAttention", "MLADecoder", "random_mla_model", "SdpaMLA",
           "MLAStepper"]


@dataclass(frozen=True)
class MLAModelConfig:
    """The shape of an MLA decoder (names as in DeepSeek-V2's config.json)."""

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

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.qk_head_dim ** -0.5


MLA_PRESETS = {
    # DeepSeek-V2-Lite: 27 layers, hidden 2048, 16 heads, latent 512 + rope 64, MoE active 8 x 1408
    # (2.66 B parameters with the dense MLP, embeddings included)
    "deepseek-v2-lite": MLAModelConfig(vocab_size=102400, hidden_size=2048, num_layers=27, num_heads=16,
                                       kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                       v_head_dim=128, intermediate_size=11264),
    # the same structure at interpreter size (dims multiples of 16, as mla_decode requires)
    "tiny-mla": MLAModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, kv_lora_rank=32,
                               qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, intermediate_size=96),
}


def _param(*shape, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class MLAAttention(nn.Module):
    def __init__(self, cfg: MLAModelConfig, layer: int, *, device, dtype):
        super().__init__()
        self.cfg, self.layer = cfg, layer
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

    def forward(self, x, positions, rotary, kv_cache, step) -> torch.Tensor:
        from pagedattn.mla import write_mla_kv

        q_nope, q_pe, c_kv, k_pe = self.project(x, positions, rotary)
        write_mla_kv(c_kv, k_pe, kv_cache, step.slot_mapping)
        out = step.backend.forward(q_nope, q_pe, kv_cache, step.metadata, weights=self.weights(),
                                   scale=self.cfg.scale)  # [n, H, v_head_dim]
        return F.linear(out.reshape(x.shape[0], -1), self.o_proj)


class MLADecoderLayer(nn.Module):
    def __init__(self, cfg: MLAModelConfig, layer: int, *, device, dtype):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.attn = MLAAttention(cfg, layer, device=device, dtype=dtype)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.mlp = MLP(cfg, device=device, dtype=dtype)  # reads hidden_size, intermediate_size, hidden_act

    def forward(self, x, residual, positions, rotary, kv_cache, step):
        h, residual = self.input_norm(x, residual)
        h = self.attn(h, positions, rotary, kv_cache, step)
        h, residual = self.post_norm(h, residual)
        return self.mlp(h), residual


class MLADecoder(nn.Module):
    """Embedding, MLA decoder layers, final norm, lm_head; parameters filled by :func:`random_mla_model`."""

    def __init__(self, cfg: MLAModelConfig, *, device="cpu", dtype=torch.float32):
        super().__init__()
        self.config = cfg
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(MLADecoderLayer(cfg, i, device=device, dtype=dtype)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.lm_head = _param(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        rope = cfg.qk_rope_head_dim
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, rope, 2, dtype=torch.float32) / rope)
        self.rotary = Rotary(None, device=device, inv_freq=inv_freq)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def forward(self, input_ids, positions, kv_caches, step) -> torch.Tensor:
        """input_ids, positions ``[n]`` int64; ``kv_caches`` ``[num_layers, num_blocks, block_size,
        latent + rope]`` -> final hidden states ``[n, hidden]``."""
        x, residual = F.embedding(input_ids, self.embed), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, self.rotary, kv_caches[i], step)
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


class SdpaMLA:
    """The baseline MLA attention: per sequence, its latent rows decompressed with ``kv_b_proj``
    into K ``[seq_len, H, qk_nope + qk_rope]`` and V ``[seq_len, H, v_head_dim]``, then torch
    SDPA with an explicit causal mask (the new tokens are the last queries). Same ``plan`` /
    ``forward`` calls as the ``mla`` backend; every step decompresses every context."""

    name = "sdpa"

    def plan(self, block_table, seq_lens, query_start_loc, config, **_options):
        from pagedattn.backends.base import BatchMetadata

        return BatchMetadata.from_tensors(block_table, seq_lens, query_start_loc, backend=self.name)

    def forward(self, q_nope, q_pe, kv_cache, metadata, *, weights, scale, kv_scale=None, out=None):
        from pagedattn.backends._common import query_positions, scale_value, visible

        n, heads, nope = q_nope.shape
        latent, v_dim = weights.kv_lora_rank, weights.v_head_dim
        block_size = kv_cache.shape[1]
        if out is None:
            out = torch.empty(n, heads, v_dim, dtype=q_nope.dtype, device=q_nope.device)
        qsl, lens = metadata.query_start_loc_host, metadata.seq_lens_host
        for s, seq_len in enumerate(lens):
            q0, q1 = qsl[s], qsl[s + 1]
            if q1 == q0:
                continue
            pages = metadata.block_table[s, : -(-seq_len // block_size)].long()
            rows = kv_cache.index_select(0, pages).flatten(0, 1)[:seq_len]
            if kv_cache.dtype == torch.float8_e4m3fn:
                rows = rows.float() * scale_value(kv_scale)
            rows = rows.to(q_nope.dtype)
            kv = (rows[:, :latent] @ weights.kv_b_proj.t()).view(seq_len, heads, nope + v_dim)
            k = torch.cat([kv[..., :nope], rows[:, None, latent:].expand(-1, heads, -1)], dim=-1)
            q = torch.cat([q_nope[q0:q1], q_pe[q0:q1]], dim=-1)
            mask = visible(query_positions(q1 - q0, seq_len, q.device), seq_len, causal=True, sliding_window=None,
                           prefix_rows=None)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), kv[..., nope:].transpose(0, 1),
                                               attn_mask=mask, scale=scale)
            out[q0:q1] = o.transpose(0, 1)
        return out


@dataclass
class _Step:
    backend: object
    metadata: object
    slot_mapping: torch.Tensor


class MLAStepper:
    """Greedy generation with a paged latent cache, chunked prefill and mixed batches.

    Every step schedules each unfinished sequence at once: up to ``chunk_tokens`` of its
    remaining prompt, or its one decode token. Sequence s owns pages ``block_ids[s]`` (a fixed
    share of the cache, shuffled so that pages are not in order). ``step_log`` keeps per step the
    scheduled sequences, their ``(query_len, seq_len)``, the sequences that sampled and their
    logits ``[sampled, vocab_size]``; :meth:`latency` gives TTFT / TPOT of the last generation.
    """

    def __init__(self, model: MLADecoder, *, num_seqs: int, max_len: int, block_size: int = 16,
                 chunk_tokens: int = 16, seed: int = 0, attention: str = "mla"):
        from pagedattn.backends import BackendConfig, get_backend

        cfg = model.config
        self.model, self.block_size, self.chunk_tokens = model, block_size, chunk_tokens
        pages = -(-max_len // block_size)
        perm = torch.randperm(num_seqs * pages, generator=torch.Generator().manual_seed(seed))
        self.block_table = perm.view(num_seqs, pages).to(torch.int32)
        self.kv_caches = torch.zeros(cfg.num_layers, num_seqs * pages, block_size,
                                     cfg.kv_lora_rank + cfg.qk_rope_head_dim, device=model.device, dtype=model.dtype)
        self.config = BackendConfig(model.device, model.dtype, head_size=cfg.qk_head_dim,
                                    num_q_heads=cfg.num_heads, num_kv_heads=1)
        if attention not in ("mla", "sdpa"):
            raise ValueError(f"attention must be 'mla' (the mla backend) or 'sdpa' (decompressed K/V), "
                             f"got {attention!r}")
        self.backend = get_backend("mla") if attention == "mla" else SdpaMLA()
        model.rotary.build(max_len)
        self.max_len = max_len
        self.step_log = []
        self.token_times = []  # per sequence of the last generate: seconds from its start to each token

    @torch.no_grad()
    def generate(self, prompts: list, max_tokens: int) -> list:
        """Token ids generated for each prompt (greedy), ``max_tokens`` each."""
        if len(prompts) > self.block_table.shape[0]:
            raise ValueError(f"prompts: {len(prompts)} sequences, the cache was made for {self.block_table.shape[0]}")
        for p in prompts:
            if not p or len(p) + max_tokens > self.max_len:
                raise ValueError(f"prompts: a prompt of {len(p)} tokens plus max_tokens {max_tokens} must be "
                                 f"1..{self.max_len} tokens")
        tokens = [list(p) for p in prompts]
        done = [0] * len(prompts)  # tokens in the cache
        out = [[] for _ in prompts]
        dev = self.model.device
        self.step_log, self.token_times = [], [[] for _ in prompts]
        start = time.perf_counter()
        while any(len(o) < max_tokens for o in out):
            seqs = [s for s in range(len(prompts)) if len(out[s]) < max_tokens]
            ids, pos, slots, qsl, lens, cases = [], [], [], [0], [], []
            for s in seqs:
                n = min(self.chunk_tokens, len(tokens[s]) - done[s])
                for p in range(done[s], done[s] + n):
                    ids.append(tokens[s][p])
                    pos.append(p)
                    slots.append(int(self.block_table[s, p // self.block_size]) * self.block_size
                                 + p % self.block_size)
                qsl.append(qsl[-1] + n)
                lens.append(done[s] + n)
                cases.append((n, done[s] + n))
            t = lambda x, dt: torch.tensor(x, dtype=dt, device=dev)  # noqa: E731
            table = self.block_table[seqs].to(dev)
            md = self.backend.plan(table, t(lens, torch.int32), t(qsl, torch.int32), self.config,
                                   block_size=self.block_size)
            step = _Step(self.backend, md, t(slots, torch.int64))
            hidden = self.model(t(ids, torch.int64), t(pos, torch.int64), self.kv_caches, step)
            sampling = [i for i, s in enumerate(seqs) if lens[i] == len(tokens[s])]  # the prompt is in the cache
            logits = self.model.logits(hidden[[qsl[i + 1] - 1 for i in sampling]])
            self.step_log.append((seqs, cases, [seqs[i] for i in sampling], logits))
            for i, s in enumerate(seqs):
                done[s] = lens[i]
            picked = logits.argmax(-1).tolist()  # the host read waits for the step's kernels
            now = time.perf_counter() - start
            for row, i in enumerate(sampling):
                s = seqs[i]
                tok = picked[row]
                self.token_times[s].append(now)
                tokens[s].append(tok)
                out[s].append(tok)
        return out

    def latency(self) -> dict:
        """Of the last :meth:`generate`, in ms: ``ttft`` (mean over sequences of the time to the
        first token) and ``tpot`` (mean over sequences of the time per later token)."""
        times = [t for t in self.token_times if t]
        if not times:
            raise ValueError("latency: generate has not produced a token yet")
        ttft = sum(t[0] for t in times) / len(times)
        later = [(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1]
        return {"ttft": 1e3 * ttft, "tpot": 1e3 * sum(later) / len(later) if later else None}
