"""FlashInfer as the engine's attention (``attention="flashinfer"``): the peer that serving
engines use, run on the same paged cache as pagedattn and called the way vLLM's FlashInfer
backend calls it.

The cache is pagedattn's ``[num_blocks, block_size, num_kv_heads, head_size]`` per layer,
which is FlashInfer's "NHD" paged layout; the new tokens' K/V are written with pagedattn's
``write_kv``. Per step, the block table and lengths become FlashInfer's ``indptr`` / ``indices``
/ ``last_page_len`` and the wrappers are planned once (one per window size of the model's
layers: FlashInfer fixes the window at plan time):

* the decodes at the front of the batch (the scheduler orders it [decode | extend | prefill])
  go to ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores when a KV head serves 4 or more
  query heads), the rest to ``BatchPrefillWithPagedKVCacheWrapper`` (causal, queries at the end
  of their sequence), as vLLM splits a mixed batch;
* CUDA-graph decode: one decode wrapper per captured batch size with FlashInfer's fixed
  buffers (``use_cuda_graph=True``), re-planned before each replay from the bucket's host
  block table and lengths (padding rows: one key on page 0, their outputs unread).

Windows (``window_left = W - 1``: the W most recent keys, the query's own included), the
logit softcap and the query scale are FlashInfer plan arguments. Sinks are not: a model with
sinks (GPT-OSS) is refused with ValueError. Nothing here runs without a CUDA device and the
``flashinfer`` package; the CPU tests exercise the metadata and the call sequence with a
stand-in module that computes each call with pagedattn's reference. What FlashInfer's API
takes (page lists, wrappers, plan arguments) is :mod:`pagedattn.adapters.flashinfer`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedattn.adapters import flashinfer as fi
from pagedattn.engine.config import EngineConfig, ModelConfig


@dataclass
class StepPlan:
    """Where the decodes end in the step's batch (sequences and tokens)."""

    num_decode: int
    num_decode_tokens: int


@dataclass
class GraphPlan:
    """The decode wrappers of the captured batch sizes: ``decode[size][window]``."""

    decode: dict = field(default_factory=dict)


class FlashInferBackend:
    """FlashInfer over the paged cache (see the module docstring)."""

    name = "flashinfer"
    requires_cuda = True  # FlashInfer's kernels are CUDA only (the CPU tests' stand-in is not)

    def __init__(self, mcfg: ModelConfig, ecfg: EngineConfig, *, device, dtype):
        device = torch.device(device)
        if mcfg.sinks:
            raise ValueError(f"attention flashinfer: the engine does not pass attention sinks ({mcfg.model_type}) "
                             "to FlashInfer; use pagedattn")
        fi.load()
        if self.requires_cuda and device.type != "cuda":
            raise ValueError("attention flashinfer needs a CUDA device")
        self.mcfg, self.ecfg, self.device, self.dtype = mcfg, ecfg, device, dtype
        shape = (mcfg.num_layers, ecfg.num_blocks, ecfg.block_size, mcfg.num_kv_heads, mcfg.head_size)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.workspace = torch.zeros(fi.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.windows = sorted({mcfg.window(i) or 0 for i in range(mcfg.num_layers)})  # 0: no window
        self.tensor_cores = fi.use_tensor_cores(mcfg.num_q_heads, mcfg.num_kv_heads)
        self.decode = {w: fi.decode_wrapper(self.workspace, tensor_cores=self.tensor_cores) for w in self.windows}
        self.prefill = {w: fi.prefill_wrapper(self.workspace) for w in self.windows}
        self.note = (f"FlashInfer {fi.version()}: decode wrapper (tensor cores {self.tensor_cores}) on the decodes, "
                     "prefill wrapper on the rest")

    def _options(self, window: int) -> dict:
        m = self.mcfg
        return dict(num_q_heads=m.num_q_heads, num_kv_heads=m.num_kv_heads, head_size=m.head_size,
                    block_size=self.ecfg.block_size, dtype=self.dtype, scale=m.attn_scale, sliding_window=window,
                    softcap=m.attn_softcap)

    def decode_layout(self, seqs):
        return list(seqs)

    def step_plan(self, qsl, lens, table=None):
        qlens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
        nd = next((i for i, n in enumerate(qlens) if n != 1), len(qlens))
        csr = fi.paged_csr(table, lens, self.ecfg.block_size)
        if nd:
            for w, wrapper in self.decode.items():
                fi.plan_decode(wrapper, csr.rows(0, nd), **self._options(w))
        if nd < len(qlens):
            qo = [n - qsl[nd] for n in qsl[nd:]]
            for w, wrapper in self.prefill.items():
                fi.plan_prefill(wrapper, qo, csr.rows(nd, len(qlens)), causal=True, **self._options(w))
        return StepPlan(num_decode=nd, num_decode_tokens=qsl[nd])

    def graph_plan(self, max_rows: int, *, sizes=(), pages: int = 0, **_):
        return GraphPlan({b: {w: fi.decode_wrapper(self.workspace, tensor_cores=self.tensor_cores, graph_size=b,
                                                   graph_pages=pages) for w in self.windows}
                          for b in sizes or [max_rows]})

    def update_graph_plan(self, plan: GraphPlan, qsl, lens, bucket=None) -> None:
        """Plan the bucket's wrappers from its host inputs (all its rows, padding included)."""
        blens, table = bucket[5], bucket[6]
        csr = fi.paged_csr(table, blens, self.ecfg.block_size)
        for w, wrapper in plan.decode[len(blens)].items():
            fi.plan_decode(wrapper, csr, **self._options(w))

    def prepare(self, meta) -> None:
        pass

    def __call__(self, layer: int, q, k, v, meta, mod=None) -> torch.Tensor:
        from pagedattn.api import write_kv

        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, validate=False)  # the runner's own metadata
        window = (mod.sliding_window if mod is not None else None) or 0
        plan = meta.plan
        if isinstance(plan, GraphPlan):
            return plan.decode[meta.decode_rows][window].run(q, (k_cache, v_cache))
        out = torch.empty_like(q)
        t = plan.num_decode_tokens
        if plan.num_decode:
            out[:t] = self.decode[window].run(q[:t], (k_cache, v_cache))
        if t < q.shape[0]:
            out[t:] = self.prefill[window].run(q[t:], (k_cache, v_cache))
        return out
