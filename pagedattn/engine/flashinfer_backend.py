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
stand-in module that computes each call with pagedattn's reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedattn.engine.config import EngineConfig, ModelConfig

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace (split-KV partials)


def import_flashinfer():
    """The ``flashinfer`` module; ValueError when it is not installed."""
    try:
        import flashinfer
    except ImportError as e:
        raise ValueError(f"attention flashinfer needs the flashinfer package ({e})") from None
    return flashinfer


def paged_metadata(lens, table: torch.Tensor, block_size: int):
    """FlashInfer's paged-KV metadata of sequences with KV lengths ``lens`` and host block
    table ``table`` ``[num_seqs, width]`` int32: (indptr ``[num_seqs + 1]``, indices
    ``[indptr[-1]]``, last_page_len ``[num_seqs]``), int32 host tensors."""
    lens_t = torch.as_tensor(lens, dtype=torch.int32)
    pages = (lens_t + block_size - 1) // block_size
    indptr = torch.zeros(len(lens_t) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0)
    used = torch.arange(table.shape[1])[None, :] < pages[:, None]
    indices = table.to(torch.int32)[used]
    last = lens_t - (pages - 1) * block_size
    return indptr, indices, last


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
        module = import_flashinfer()
        if self.requires_cuda and device.type != "cuda":
            raise ValueError("attention flashinfer needs a CUDA device")
        self.fi, self.mcfg, self.ecfg, self.device, self.dtype = module, mcfg, ecfg, device, dtype
        shape = (mcfg.num_layers, ecfg.num_blocks, ecfg.block_size, mcfg.num_kv_heads, mcfg.head_size)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.windows = sorted({mcfg.window(i) or 0 for i in range(mcfg.num_layers)})  # 0: no window
        self.tensor_cores = mcfg.num_q_heads // mcfg.num_kv_heads >= 4
        self.decode = {w: self._decode_wrapper() for w in self.windows}
        self.prefill = {w: module.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD") for w in self.windows}
        version = getattr(module, "__version__", "?")
        self.note = (f"FlashInfer {version}: decode wrapper (tensor cores {self.tensor_cores}) on the decodes, "
                     "prefill wrapper on the rest")

    def _decode_wrapper(self, size: int | None = None, pages: int = 0):
        if size is None:
            return self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                              use_tensor_cores=self.tensor_cores)
        buffers = dict(
            paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=torch.zeros(size * pages, dtype=torch.int32, device=self.device),
            paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32, device=self.device),
        )
        return self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_cuda_graph=True,
                                                          use_tensor_cores=self.tensor_cores, **buffers)

    def _features(self, window: int) -> dict:
        return dict(window_left=window - 1 if window else -1, logits_soft_cap=self.mcfg.attn_softcap or None,
                    sm_scale=self.mcfg.attn_scale, q_data_type=self.dtype, kv_data_type=self.dtype)

    def _shape(self) -> tuple:
        m = self.mcfg
        return m.num_q_heads, m.num_kv_heads, m.head_size, self.ecfg.block_size

    def decode_layout(self, seqs):
        return list(seqs)

    def step_plan(self, qsl, lens, table=None):
        qlens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
        nd = next((i for i, n in enumerate(qlens) if n != 1), len(qlens))
        indptr, indices, last = paged_metadata(lens, table, self.ecfg.block_size)
        if nd:
            for w, wrapper in self.decode.items():
                wrapper.plan(indptr[:nd + 1], indices[:int(indptr[nd])], last[:nd], *self._shape(),
                             **self._features(w))
        if nd < len(qlens):
            qo = torch.tensor(qsl[nd:], dtype=torch.int32) - qsl[nd]
            kv = indptr[nd:] - indptr[nd]
            for w, wrapper in self.prefill.items():
                wrapper.plan(qo, kv, indices[int(indptr[nd]):], last[nd:], *self._shape(), causal=True,
                             **self._features(w))
        return StepPlan(num_decode=nd, num_decode_tokens=qsl[nd])

    def graph_plan(self, max_rows: int, *, sizes=(), pages: int = 0, **_):
        return GraphPlan({b: {w: self._decode_wrapper(b, pages) for w in self.windows} for b in sizes or [max_rows]})

    def update_graph_plan(self, plan: GraphPlan, qsl, lens, bucket=None) -> None:
        """Plan the bucket's wrappers from its host inputs (all its rows, padding included)."""
        blens, table = bucket[5], bucket[6]
        indptr, indices, last = paged_metadata(blens, table, self.ecfg.block_size)
        for w, wrapper in plan.decode[len(blens)].items():
            wrapper.plan(indptr, indices, last, *self._shape(), **self._features(w))

    def prepare(self, meta) -> None:
        pass

    def __call__(self, layer: int, q, k, v, meta, mod=None) -> torch.Tensor:
        from pagedattn.api import write_kv

        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
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
