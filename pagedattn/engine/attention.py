"""Attention backends of the engine: pagedattn over the paged cache, or torch SDPA over a
contiguous static cache (the baseline); FlashInfer over the same paged cache lives in
:mod:`pagedattn.engine.flashinfer_backend`.

A backend owns its KV cache and is called per layer as ``backend(layer, q, k, v, meta)`` with
q ``[num_tokens, num_q_heads, head_size]`` and k, v ``[num_tokens, num_kv_heads, head_size]``
(RoPE applied); it writes k, v to its cache and returns the attention output like q.

* ``pagedattn``: ``write_kv`` then ``paged_attention(..., plan=plan)`` with the layer's scale,
  sliding window, softcap and sinks; the plan comes from
  ``plan_attention`` once per step (path "auto"), and CUDA-graph decode runs the persistent
  path, re-planned in place with ``plan.update()`` before each replay.
* ``pagedattn-2d``: the same with ``path="unified"`` everywhere (prefill included).
* ``sdpa``: a cache ``[max_num_seqs + 1, num_kv_heads, max_model_len, head_size]`` per layer,
  one row per running sequence (its ``slot``; the last row takes padding writes). Decode
  batches are laid out by row (token r belongs to the sequence in row r) so that one SDPA call
  reads rows ``[:batch]`` of the cache directly: the query heads of one KV head form the query
  length (GQA without copying K/V) and a key mask hides positions past each sequence's
  length (and, on sliding-window layers, before the window). On CUDA it runs cuDNN attention when
  cuDNN accepts the shape (probed once; the reason is kept in ``note`` otherwise). Prefill and
  extend run one SDPA call per sequence. SDPA has no logit softcap: a model with one (Gemma2)
  is refused with ValueError. Attention sinks (GPT-OSS) are an extra key whose K and V are zero
  and whose additive mask is the head's sink logit: its score is exactly the sink and it adds
  nothing to the output, so the softmax's denominator is the one with sinks (the cache keeps
  that zero key at position ``max_model_len``; an additive mask, so cuDNN only if it takes one).

An MLA model (:class:`pagedattn.engine.config.MLAModelConfig`) caches one latent row per token
instead of K and V: its attention is :class:`pagedattn.engine.mla_model.LatentCacheAttention`,
the ``mla`` backend for ``pagedattn`` and SDPA over decompressed K/V for ``sdpa``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedattn.adapters import sdpa
from pagedattn.adapters.sdpa import query_positions, visible
from pagedattn.backends.base import BackendConfig
from pagedattn.engine.config import EngineConfig, MLAModelConfig, ModelConfig


@dataclass
class StepMetadata:
    """What the attention of every layer needs for one step (built once per step by the runner).

    ``positions`` ``[num_tokens]`` int64; ``query_start_loc`` ``[num_seqs + 1]`` int32;
    ``seq_lens`` ``[num_seqs]`` int32; ``block_table`` ``[num_seqs, max_pages]`` int32;
    ``slot_mapping`` ``[num_tokens]`` int64 (-1: padding). ``plan``: the step's attention plan
    (an MLA model's is made by its attention's ``prepare``). SDPA: ``cache_rows`` ``[num_tokens]``
    int64 (each token's row of the static cache), ``host_*`` the same metadata as lists, and
    ``decode_rows`` > 0 for a decode batch laid out by row.
    """

    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    cache_rows: torch.Tensor
    plan: object = None
    host_query_start_loc: list | None = None
    host_seq_lens: list | None = None
    host_rows: list | None = None
    decode_rows: int = 0
    key_mask: torch.Tensor | None = None
    window_mask: torch.Tensor | None = None


class PagedBackend:
    """pagedattn over a paged cache ``[num_layers, num_blocks, block_size, num_kv_heads, head_size]``."""

    def __init__(self, mcfg: ModelConfig, ecfg: EngineConfig, *, device, dtype, path: str = "auto"):
        self.name = "pagedattn" if path == "auto" else "pagedattn-2d"
        self.mcfg, self.ecfg, self.device, self.dtype, self.path = mcfg, ecfg, device, dtype, path
        self.config = BackendConfig(device, dtype, head_size=mcfg.head_size, num_q_heads=mcfg.num_q_heads,
                                    num_kv_heads=mcfg.num_kv_heads)
        shape = (mcfg.num_layers, ecfg.num_blocks, ecfg.block_size, mcfg.num_kv_heads, mcfg.head_size)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.note = f"paged_attention path={path!r}"
        self.window_everywhere = all(mcfg.window(i) for i in range(mcfg.num_layers))

    def _plan(self, qsl, lens, path: str, **kwargs):
        from pagedattn.backends.triton_backend import plan_for_config  # imports triton: not at engine import

        if self.window_everywhere:  # the keys a query reads are bounded: the split rule counts only those
            kwargs.setdefault("sliding_window", self.mcfg.sliding_window)
        return plan_for_config(qsl, lens, self.config, path=path, **kwargs)

    def decode_layout(self, seqs):
        return list(seqs)

    def step_plan(self, qsl, lens, table=None):
        return self._plan(qsl, lens, self.path)

    def graph_plan(self, max_rows: int, **_):
        """One plan for every captured decode graph: persistent with room for ``max_rows``
        sequences (path "auto"), or unified (its kernel reads only device metadata)."""
        qsl, lens = list(range(max_rows + 1)), [1] * max_rows
        if self.path == "unified":
            return self._plan(qsl, lens, "unified")
        return self._plan(qsl, lens, "persistent", max_num_seqs=max_rows, max_num_tokens=max_rows,
                          max_context_len=self.ecfg.max_model_len)

    def update_graph_plan(self, plan, qsl, lens, bucket=None) -> None:
        if plan.path == "persistent":
            plan.update(qsl, lens)

    def prepare(self, meta: StepMetadata) -> None:
        pass

    def __call__(self, layer: int, q, k, v, meta: StepMetadata, mod=None) -> torch.Tensor:
        """``mod``: the layer's attention module (its scale, sliding_window, softcap, sinks), or None."""
        from pagedattn.api import paged_attention, write_kv

        # validate=False: the runner builds the metadata, and a captured decode batch has padding
        # rows past query_start_loc[-1] on purpose
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, validate=False)
        if mod is None:
            return paged_attention(q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.query_start_loc,
                                   plan=meta.plan, validate=False)
        return paged_attention(q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.query_start_loc,
                               scale=mod.scale, sliding_window=mod.sliding_window, softcap=mod.softcap,
                               sinks=mod.sinks, plan=meta.plan, validate=False)


class SdpaBackend:
    """torch SDPA over a contiguous static cache (see the module docstring)."""

    name = "sdpa"

    def __init__(self, mcfg: ModelConfig, ecfg: EngineConfig, *, device, dtype):
        if mcfg.attn_softcap:
            raise ValueError(f"attention sdpa cannot compute the attention logit softcap ({mcfg.attn_softcap}) of "
                             f"{mcfg.model_type}; use pagedattn")
        self.mcfg, self.ecfg, self.device, self.dtype = mcfg, ecfg, torch.device(device), dtype
        self.max_len = ecfg.max_model_len
        self.padding_row = ecfg.max_num_seqs
        self.sink_keys = 1 if mcfg.sinks else 0  # the zero key at position max_len (module docstring)
        shape = (mcfg.num_layers, ecfg.max_num_seqs + 1, mcfg.num_kv_heads, self.max_len + self.sink_keys,
                 mcfg.head_size)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.key_positions = torch.arange(self.max_len + self.sink_keys, device=device)
        self.decode_kernels = self.prefill_kernels = None
        self.float_mask = bool(mcfg.sinks)  # the sink's logit rides in the additive mask
        self.note = "torch SDPA (default dispatch)"
        if self.device.type == "cuda":
            self._probe_cudnn()

    def _probe_cudnn(self) -> None:
        """Use cuDNN attention for decode if it takes this shape with a key mask (bool, else additive)."""
        order = ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
        self.prefill_kernels = order
        hkv, d = self.mcfg.num_kv_heads, self.mcfg.head_size
        group = self.mcfg.num_q_heads // hkv
        q = torch.randn(2, hkv, group, d, device=self.device, dtype=self.dtype)
        # the decode call's shape: every cache position (the sink key included) under a key mask
        k = torch.randn(2, hkv, self.key_positions.shape[0], d, device=self.device, dtype=self.dtype)
        mask = (self.key_positions < torch.tensor([[3], [self.max_len]], device=self.device))[:, None, None]
        errors = []
        for float_mask in (True,) if self.mcfg.sinks else (False, True):
            m = torch.where(mask, 0.0, float("-inf")).to(self.dtype) if float_mask else mask
            why = sdpa.probe("CUDNN_ATTENTION", q, k, k, m, reference_mask=mask)
            if why is None:
                self.decode_kernels, self.float_mask = ["CUDNN_ATTENTION"], float_mask
                self.note = f"cuDNN attention ({'additive' if float_mask else 'boolean'} key mask)"
                return
            errors.append(f"{'additive' if float_mask else 'boolean'} mask: {why}")
        self.decode_kernels = order
        self.note = "torch SDPA without cuDNN for decode (" + "; ".join(errors) + ")"

    def decode_layout(self, seqs):
        """Rows ``0 .. max slot``: row r holds the sequence whose slot is r, or None."""
        rows = [None] * (max(s.slot for s in seqs) + 1)
        for s in seqs:
            rows[s.slot] = s
        return rows

    def step_plan(self, qsl, lens, table=None):
        return None

    def graph_plan(self, max_rows: int, **_):
        return None

    def update_graph_plan(self, plan, qsl, lens, bucket=None) -> None:
        pass

    def prepare(self, meta: StepMetadata) -> None:
        if meta.decode_rows:
            keys, lens = self.key_positions[None, :], meta.seq_lens[:, None]
            mask = (keys < lens)[:, None, None]  # [B, 1, 1, max_len]
            meta.key_mask = self._mask(mask)
            if self.mcfg.sliding_window:  # the query sits at len - 1: keys len - W .. len - 1
                meta.window_mask = self._mask(mask & (keys >= lens - self.mcfg.sliding_window)[:, None, None])

    def _mask(self, mask):
        return torch.where(mask, 0.0, float("-inf")).to(self.dtype) if self.float_mask else mask

    @staticmethod
    def _with_sinks(mask, sinks, shape):
        """An additive ``mask`` (its last key: the zero sink key) expanded to ``shape`` with each
        query head's sink logit in the last column; ``sinks`` shaped to broadcast over
        ``shape[:-1]`` (``[num_kv_heads, group]`` for decode, ``[num_q_heads, 1]`` for a prefill)."""
        m = mask.expand(shape).clone()
        m[..., -1] = sinks.to(m.dtype)
        return m

    def __call__(self, layer: int, q, k, v, meta: StepMetadata, mod=None) -> torch.Tensor:
        """``mod``: the layer's attention module (its scale and sliding_window), or None."""
        scale = None if mod is None else mod.scale
        window = None if mod is None else mod.sliding_window
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        k_cache[meta.cache_rows, :, meta.positions] = k
        v_cache[meta.cache_rows, :, meta.positions] = v
        num_tokens, hq, d = q.shape
        hkv = k.shape[1]
        sinks = None if mod is None else mod.sinks
        if meta.decode_rows:
            b = meta.decode_rows
            mask = meta.key_mask if window is None else meta.window_mask
            if sinks is not None:
                mask = self._with_sinks(mask, sinks.view(hkv, hq // hkv), (b, hkv, hq // hkv, mask.shape[-1]))
            out = sdpa.call(q.view(b, hkv, hq // hkv, d), k_cache[:b], v_cache[:b], kernels=self.decode_kernels,
                           attn_mask=mask, scale=scale)  # [b, hkv, group, d]
            return out.reshape(b, hq, d)
        out = torch.empty_like(q)
        qsl, lens, rows = meta.host_query_start_loc, meta.host_seq_lens, meta.host_rows
        for s, (a, b) in enumerate(zip(qsl[:-1], qsl[1:])):
            n, length = b - a, lens[s]
            if n == 0:
                continue
            qs = q[a:b].transpose(0, 1)[None]  # [1, hq, n, d]
            if length == n:  # no context: the fresh keys
                ks, vs = k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None]
            else:
                row = rows[s]
                ks, vs = k_cache[row:row + 1, :, :length], v_cache[row:row + 1, :, :length]
            if sinks is not None:  # the zero sink key after the sequence's keys, its logit in the mask
                zero = ks.new_zeros(1, hkv, 1, d)
                ks, vs = torch.cat((ks, zero), 2), torch.cat((vs, zero), 2)
                vis = visible(query_positions(n, length, q.device), length, causal=True, sliding_window=window,
                              prefix_rows=None)
                vis = torch.cat((vis, vis.new_ones(n, 1)), 1)
                mask = torch.where(vis, 0.0, float("-inf")).to(q.dtype)[None, None]
                kwargs = {"attn_mask": self._with_sinks(mask, sinks.view(hq, 1), (1, hq, n, length + 1))}
            elif window is None and length == n:
                kwargs = {"is_causal": n > 1}
            elif window is None and n == 1:
                kwargs = {}
            else:  # query j sits at length - n + j
                kwargs = {"attn_mask": visible(query_positions(n, length, q.device), length, causal=True,
                                               sliding_window=window, prefix_rows=None)}
            o = sdpa.call(qs, ks, vs, kernels=self.prefill_kernels, enable_gqa=hq != hkv, scale=scale, **kwargs)
            out[a:b] = o[0].transpose(0, 1)
        return out


def make_backend(mcfg: ModelConfig | MLAModelConfig, ecfg: EngineConfig, *, device, dtype):
    if isinstance(mcfg, MLAModelConfig):  # one latent cache row per token: its own attention (pagedattn or sdpa)
        from pagedattn.engine.mla_model import LatentCacheAttention

        return LatentCacheAttention(mcfg, ecfg, device=device, dtype=dtype)
    if ecfg.attention == "sdpa":
        return SdpaBackend(mcfg, ecfg, device=device, dtype=dtype)
    if ecfg.attention == "flashinfer":
        from pagedattn.engine.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(mcfg, ecfg, device=device, dtype=dtype)
    return PagedBackend(mcfg, ecfg, device=device, dtype=dtype,
                        path="unified" if ecfg.attention == "pagedattn-2d" else "auto")
