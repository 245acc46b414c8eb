"""The ``mla`` backend: multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

One MLA layer's attention, from its queries to the per-head values (before ``o_proj``), over
the cache that :func:`pagedattn.write_mla_kv` fills: one row ``[c_kv | k_pe]`` per token
(``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``, 512 + 64 = 576 for DeepSeek),
shared by every head. Each sequence of a step takes one of two paths:

* **absorbed** (``query_len <= decode_threshold``, default 8: decode and speculative steps):
  ``q_nope`` is absorbed into the latent space with ``W_UK``, :func:`pagedattn.mla_decode`
  attends over the latent rows, its latent output is projected to the values with ``W_UV``.
  Per key each head reads the shared 576-value row once: no decompression.
* **decompressed** (longer queries: prefill, extend, chunked prefill): the sequence's latent
  rows are gathered from the cache and decompressed with ``kv_b_proj`` into K ``[tokens,
  heads, qk_nope + qk_rope]`` (192; the rope part is the shared ``k_pe``) and V ``[tokens,
  heads, v_head_dim]`` (128), then :func:`pagedattn.varlen_attention` attends causally, the
  sequence's new tokens being its last queries.

The split is by query length only: decompressing a context costs ``seq_len x kv_lora_rank x
heads x (qk_nope + v)`` multiply-adds however few the queries are, while the absorbed path
costs ``query_len x seq_len x heads x (576 + 512)``; for a handful of queries the absorbed
path is the cheaper one even without cached context (a short prompt), for many queries the
decompressed path's 192/128-wide heads are.

>>> from pagedattn.backends import BackendConfig, get_backend
>>> from pagedattn.backends.mla import MLAWeights
>>> cfg = BackendConfig("cuda", torch.bfloat16, head_size=192, num_q_heads=16, num_kv_heads=1)
>>> weights = MLAWeights.from_kv_b_proj(kv_b_proj.weight, num_heads=16, qk_nope_head_dim=128, v_head_dim=128)
>>> mla = get_backend("mla")                     # by name only, never chosen automatically
>>> md = mla.plan(block_table, seq_lens, query_start_loc, cfg)           # once per step
>>> write_mla_kv(c_kv, k_pe, kv_cache, slot_mapping)                     # per layer, then:
>>> out = mla.forward(q_nope, q_pe, kv_cache, md, weights=weights)      # [tokens, 16, 128]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedattn._checks import FLOAT_DTYPES, check_scale_arg, check_shape, check_tensor, head_size_supported
from pagedattn.backends.base import AttentionBackend, BackendConfig, BatchMetadata
from pagedattn.backends.triton_backend import triton_device_reason

__all__ = ["MLABackend", "MLAWeights", "MLAPlan", "DEFAULT_DECODE_THRESHOLD"]

DEFAULT_DECODE_THRESHOLD = 8  # mla_decode serves at most 8 query tokens a sequence


@dataclass(frozen=True)
class MLAWeights:
    """One layer's up-projection of the latent, in the two forms the paths use (made once per layer).

    ``kv_b_proj`` ``[num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`` is DeepSeek's
    ``kv_b_proj.weight`` (``nn.Linear`` layout: per head ``qk_nope_head_dim`` rows of ``W_UK``
    then ``v_head_dim`` rows of ``W_UV``). ``w_uk`` ``[num_heads, qk_nope_head_dim,
    kv_lora_rank]`` absorbs a query, ``w_uv`` ``[num_heads, kv_lora_rank, v_head_dim]`` projects a
    latent output to the values; both are contiguous copies.
    """

    kv_b_proj: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    num_heads: int
    qk_nope_head_dim: int
    v_head_dim: int

    @property
    def kv_lora_rank(self) -> int:
        return self.kv_b_proj.shape[1]

    @classmethod
    def from_kv_b_proj(cls, kv_b_proj: torch.Tensor, *, num_heads: int, qk_nope_head_dim: int,
                       v_head_dim: int) -> "MLAWeights":
        check_tensor("kv_b_proj", kv_b_proj, ndim=2, dtypes=FLOAT_DTYPES)
        for name, v in (("num_heads", num_heads), ("qk_nope_head_dim", qk_nope_head_dim), ("v_head_dim", v_head_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        check_shape("kv_b_proj", kv_b_proj, (num_heads * (qk_nope_head_dim + v_head_dim), None))
        w = kv_b_proj.detach().view(num_heads, qk_nope_head_dim + v_head_dim, kv_b_proj.shape[1])
        return cls(
            kv_b_proj=kv_b_proj.detach(), w_uk=w[:, :qk_nope_head_dim].contiguous(),
            w_uv=w[:, qk_nope_head_dim:].transpose(1, 2).contiguous(), num_heads=num_heads,
            qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim,
        )


@dataclass
class _MLAPart:
    """The sequences of one path: their tokens in the batch and their own metadata."""

    seqs: list  # batch indices of the sequences, in batch order
    tokens: object  # a slice when the tokens are one contiguous range, else [n] int64 indices
    metadata: BatchMetadata
    slots: torch.Tensor | None = None  # decompressed path: [sum seq_len] int64 cache rows, per sequence in order
    cu_seqlens_k: torch.Tensor | None = None  # decompressed path: [num_seqs + 1] int32
    slots_block_size: int = 0  # the page size the slots were made for


@dataclass
class MLAPlan:
    """What :meth:`MLABackend.plan` makes: the ``"absorbed"`` and ``"decompressed"`` parts (if any)."""

    parts: dict
    config: BackendConfig
    decode_threshold: int


def _sub_part(md: BatchMetadata, seqs: list, device) -> _MLAPart:
    qsl = md.query_start_loc_host
    q_lens = [qsl[s + 1] - qsl[s] for s in seqs]
    lens = [md.seq_lens_host[s] for s in seqs]
    sub_qsl = [0]
    for n in q_lens:
        sub_qsl.append(sub_qsl[-1] + n)
    token_ids = [t for s in seqs for t in range(qsl[s], qsl[s + 1])]
    if token_ids == list(range(token_ids[0], token_ids[0] + len(token_ids))):
        tokens = slice(token_ids[0], token_ids[0] + len(token_ids))
    else:
        tokens = torch.tensor(token_ids, dtype=torch.int64, device=device)
    idx = torch.tensor(seqs, dtype=torch.int64, device=md.block_table.device)
    sub = BatchMetadata(
        block_table=md.block_table.index_select(0, idx), seq_lens=md.seq_lens.index_select(0, idx),
        query_start_loc=torch.tensor(sub_qsl, dtype=torch.int32, device=device),
        query_start_loc_host=sub_qsl, seq_lens_host=lens, max_query_len=max(q_lens), max_seq_len=max(lens),
        backend="mla",
    )
    return _MLAPart(seqs=seqs, tokens=tokens, metadata=sub)


class MLABackend(AttentionBackend):
    """MLA attention of a mixed batch: absorbed decode, decompressed prefill (module docstring).

    ``BackendConfig``: ``head_size`` = ``qk_nope_head_dim + qk_rope_head_dim`` (the
    decompressed q/k head, 192 for DeepSeek), ``num_q_heads`` the attention heads,
    ``num_kv_heads`` 1 (the latent row is shared by every head), ``dtype`` q's and the cache's;
    features: ``causal``, and ``fp8`` for a float8_e4m3fn latent cache (no window, softcap,
    ALiBi, sinks, prefix or lse).

    ``plan`` options: ``decode_threshold`` (default 8, at most 8): sequences with at most this
    many query tokens take the absorbed path; ``block_size`` (the cache's page size): given, the
    decompressed path's cache row indices are made in ``plan``, else by the first layer's call
    (host-to-device copies: call it once before capturing a CUDA graph).
    """

    name = "mla"
    feature_names = frozenset({"causal", "fp8"})

    def supports_head_size(self, head_size: int) -> bool:
        return head_size_supported(head_size)  # the decompressed path's q/k head in varlen_attention

    def device_reason(self, device, dtype):
        return triton_device_reason(device, dtype)

    def validate(self, config: BackendConfig) -> list[str]:
        reasons = super().validate(config)
        if config.num_kv_heads != 1:
            reasons.append(f"num_kv_heads {config.num_kv_heads}: an MLA latent cache has one row per token "
                           "shared by every head (num_kv_heads=1)")
        return reasons

    def _plan_state(self, md: BatchMetadata, config: BackendConfig, *,
                    decode_threshold: int = DEFAULT_DECODE_THRESHOLD, block_size: int | None = None):
        if (isinstance(decode_threshold, bool) or not isinstance(decode_threshold, int)
                or not 0 <= decode_threshold <= DEFAULT_DECODE_THRESHOLD):
            raise ValueError(f"decode_threshold must be an int from 0 to {DEFAULT_DECODE_THRESHOLD} "
                             f"(mla_decode's query limit), got {decode_threshold!r}")
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                       or block_size < 1):
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        reasons = self.validate(config)
        if reasons:
            raise ValueError(f"backend 'mla' cannot serve {config}: " + "; ".join(reasons))
        device = md.query_start_loc.device
        q_lens = md.query_lens_host
        for s, (ql, n) in enumerate(zip(q_lens, md.seq_lens_host)):
            if ql < 0 or ql > n:
                raise ValueError(f"sequence {s}: query_len {ql} must be in 0..seq_len ({n})")
        absorbed = [s for s, ql in enumerate(q_lens) if 0 < ql <= decode_threshold]
        decompressed = [s for s, ql in enumerate(q_lens) if ql > decode_threshold]
        parts = {}
        if absorbed:
            parts["absorbed"] = _sub_part(md, absorbed, device)
        if decompressed:
            part = _sub_part(md, decompressed, device)
            cu_k = [0]
            for n in part.metadata.seq_lens_host:
                cu_k.append(cu_k[-1] + n)
            part.cu_seqlens_k = torch.tensor(cu_k, dtype=torch.int32, device=device)
            if block_size is not None:
                self._slots(part, block_size, device)
            parts["decompressed"] = part
        return MLAPlan(parts=parts, config=config, decode_threshold=decode_threshold)

    @staticmethod
    def _slots(part: _MLAPart, block_size: int, device) -> torch.Tensor:
        """The cache rows ``block * block_size + offset`` of every key of the part's sequences (once a step)."""
        if part.slots is None or part.slots.device != device or part.slots_block_size != block_size:
            md = part.metadata
            bt = md.block_table.long()
            rows, pos = [], []
            for i, n in enumerate(md.seq_lens_host):
                rows += [i] * n
                pos += list(range(n))
            rows = torch.tensor(rows, dtype=torch.int64, device=bt.device)
            pos = torch.tensor(pos, dtype=torch.int64, device=bt.device)
            part.slots = (bt[rows, pos // block_size] * block_size + pos % block_size).to(device)
            part.slots_block_size = block_size
        return part.slots

    def forward(self, q_nope, q_pe, kv_cache, metadata, *, weights: MLAWeights, scale: float | None = None,
                kv_scale: float | torch.Tensor | None = None, out: torch.Tensor | None = None):
        """MLA attention of the planned batch; returns ``out`` ``[num_tokens, num_heads, v_head_dim]``.

        Parameters
        ----------
        q_nope : ``[num_tokens, num_heads, qk_nope_head_dim]`` float16 or float32 (bfloat16 on a GPU)
            The non-rotary part of each query, per head (not absorbed: the backend absorbs the
            queries of the absorbed path itself).
        q_pe : ``[num_tokens, num_heads, qk_rope_head_dim]`` q_nope's dtype
            The rotary part, rotary embedding applied.
        kv_cache : ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` q_nope's dtype, or
            float8_e4m3fn when the config has ``fp8``
            Per token ``[c_kv | k_pe]`` (``k_pe`` rotated), as :func:`pagedattn.write_mla_kv` writes
            it; the step's new tokens must be in it. An fp8 row's value is ``kv_cache * kv_scale``.
        metadata : BatchMetadata from :meth:`plan`.
        weights : :class:`MLAWeights` of the layer (``kv_b_proj``), in q_nope's dtype.
        scale : float, optional
            Score scale (default ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``).
        kv_scale : float or 1-element float32 tensor, optional
            Dequantization scale of an fp8 cache (default 1.0; ignored for other caches).
        out : ``[num_tokens, num_heads, v_head_dim]`` q_nope's dtype, optional
            Written in place and returned. Rows of sequences with no query are not written.
        """
        from pagedattn.api import varlen_attention
        from pagedattn.mla import mla_decode

        self._check_metadata(metadata)
        plan: MLAPlan = metadata.state
        cfg = plan.config
        if not isinstance(weights, MLAWeights):
            raise TypeError(f"weights must be an MLAWeights (MLAWeights.from_kv_b_proj), got {type(weights).__name__}")
        check_tensor("q_nope", q_nope, ndim=3, dtypes=(cfg.dtype,))
        device = q_nope.device
        num_tokens, num_heads, nope = q_nope.shape
        check_shape("q_nope", q_nope, (metadata.num_tokens, cfg.num_q_heads, weights.qk_nope_head_dim))
        check_tensor("q_pe", q_pe, ndim=3, dtypes=(cfg.dtype,), device=device)
        check_shape("q_pe", q_pe, (num_tokens, num_heads, cfg.head_size - nope))
        latent, rope = weights.kv_lora_rank, q_pe.shape[2]
        check_tensor("kv_cache", kv_cache, ndim=3, dtypes=(cfg.cache_dtype,), device=device)
        check_shape("kv_cache", kv_cache, (None, None, latent + rope))
        check_scale_arg("kv_scale", kv_scale, device)
        fp8 = kv_cache.dtype == torch.float8_e4m3fn
        if weights.num_heads != num_heads:
            raise ValueError(f"weights has {weights.num_heads} heads, q_nope {num_heads}")
        for name, w in (("weights.kv_b_proj", weights.kv_b_proj), ("weights.w_uk", weights.w_uk),
                        ("weights.w_uv", weights.w_uv)):
            check_tensor(name, w, dtypes=(cfg.dtype,), device=device)
        v_dim = weights.v_head_dim
        if out is None:
            out = torch.empty(num_tokens, num_heads, v_dim, dtype=q_nope.dtype, device=device)
        else:
            check_tensor("out", out, dtypes=(cfg.dtype,), device=device)
            check_shape("out", out, (num_tokens, num_heads, v_dim))
        if scale is None:
            scale = 1.0 / math.sqrt(nope + rope)

        for kind, part in plan.parts.items():
            md = part.metadata
            qn, qp = q_nope[part.tokens], q_pe[part.tokens]  # a view for a slice, a gather otherwise
            if kind == "absorbed":
                q_lat = torch.bmm(qn.transpose(0, 1), weights.w_uk).transpose(0, 1).contiguous()  # [t, H, latent]
                o_lat = mla_decode(q_lat, qp.contiguous(), kv_cache, md.block_table, md.seq_lens, md.query_start_loc,
                                   scale=float(scale), max_query_len=md.max_query_len, max_seq_len=md.max_seq_len,
                                   kv_scale=kv_scale)
                o = torch.bmm(o_lat.transpose(0, 1), weights.w_uv).transpose(0, 1)  # [t, H, v]
            else:
                rows = kv_cache.view(-1, latent + rope).index_select(0, self._slots(part, kv_cache.shape[1], device))
                if fp8:  # dequantized in fp32, then q's dtype (a tensor scale stays on the device)
                    rows = (rows.float() * (1.0 if kv_scale is None else kv_scale)).to(q_nope.dtype)
                kv = (rows[:, :latent] @ weights.kv_b_proj.t()).view(-1, num_heads, nope + v_dim)
                k_pe = rows[:, None, latent:].expand(-1, num_heads, rope)
                k = torch.cat([kv[..., :nope], k_pe], dim=-1)  # [keys, H, nope + rope]
                v = kv[..., nope:].contiguous()  # [keys, H, v]
                q = torch.cat([qn, qp], dim=-1)
                o = varlen_attention(q, k, v, md.query_start_loc, part.cu_seqlens_k, max_query_len=md.max_query_len,
                                     scale=float(scale), causal=True)
            if isinstance(part.tokens, slice):
                out[part.tokens] = o
            else:
                out.index_copy_(0, part.tokens, o.contiguous())
        return out
