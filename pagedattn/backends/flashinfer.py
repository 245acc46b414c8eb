"""The ``flashinfer`` backend: FlashInfer's paged wrappers over pagedattn's cache tensors.

``plan`` cuts the batch into its single-token decodes and the rest. FlashInfer fixes the
scale, window and softcap when a wrapper is planned, so the first ``forward`` of each set of
those values turns the block table into FlashInfer's page lists (one host synchronization, the
first time) and plans the wrappers; the layers that share the values reuse them. A
batch whose decodes form one run of sequences and the rest another runs the decode wrapper on
the decodes and the prefill wrapper on the rest (vLLM's split); a batch where they interleave
runs the prefill wrapper on all of it. What FlashInfer's API takes is
:mod:`pagedattn.adapters.flashinfer`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedattn.adapters import flashinfer as fi
from pagedattn.adapters.common import module_status
from pagedattn.backends._common import default_scale
from pagedattn.backends.base import AttentionBackend, BackendConfig, BatchMetadata


@dataclass
class _State:
    split: fi.DecodeSplit
    csr: fi.PagedCSR | None = None  # built at the first forward, from the cache's block size
    block_size: int = 0
    wrappers: dict = field(default_factory=dict)  # (shape, features) -> [(wrapper, token start, token end)]


class FlashInferBackend(AttentionBackend):
    """Causal attention with a sliding window, a logit softcap and a scale; fp16 / bf16 caches
    of q's dtype on a CUDA device, head sizes 64, 128 and 256. Sequences need at least one key."""

    name = "flashinfer"
    dtypes = (torch.float16, torch.bfloat16)
    feature_names = frozenset({"causal", "window", "softcap"})
    head_sizes = fi.FA3_HEAD_SIZES

    def unavailable_reason(self):
        for ok, why in (module_status("flashinfer"), fi.jit_toolchain_status()):
            if not ok:
                return why
        return None

    def device_reason(self, device, dtype):
        return None if torch.device(device).type == "cuda" else "FlashInfer's kernels need a CUDA device"

    def supports_head_size(self, head_size: int) -> bool:
        return head_size in self.head_sizes

    def _plan_state(self, md: BatchMetadata, config: BackendConfig, **options):
        if options:
            raise TypeError(f"backend {self.name!r} takes no plan options, got {sorted(options)}")
        return _State(split=fi.split_decodes(md.query_start_loc_host))

    def _wrappers(self, state: _State, md: BatchMetadata, q, k_cache, options: dict):
        block_size = k_cache.shape[1]
        shape = dict(num_q_heads=q.shape[1], num_kv_heads=k_cache.shape[2], head_size=q.shape[2],
                     block_size=block_size, dtype=q.dtype)
        key = (tuple(shape.items()), tuple(sorted(options.items())), q.device)
        runs = state.wrappers.get(key)
        if runs is not None:
            return runs
        if state.csr is None or state.block_size != block_size:
            state.csr = fi.paged_csr(md.block_table, md.seq_lens_host, block_size)
            state.block_size = block_size
        ws, split, qsl = fi.workspace(q.device), state.split, md.query_start_loc_host
        runs = []
        if split.decode and not split.reorder:
            d0, d1 = split.decode[0], split.decode[-1] + 1
            wrapper = fi.decode_wrapper(ws, tensor_cores=fi.use_tensor_cores(q.shape[1], k_cache.shape[2]))
            runs.append((fi.plan_decode(wrapper, state.csr.rows(d0, d1), **shape, **options), qsl[d0], qsl[d1]))
        seqs = split.rest if split.decode and not split.reorder else split.order
        if seqs:
            s0, s1 = min(seqs), max(seqs) + 1
            wrapper = fi.prefill_wrapper(ws, fi.prefill_backend(q.device, q.shape[2]))
            qo = [n - qsl[s0] for n in qsl[s0:s1 + 1]]
            runs.append((fi.plan_prefill(wrapper, qo, state.csr.rows(s0, s1), causal=True, **shape, **options),
                         qsl[s0], qsl[s1]))
        state.wrappers[key] = runs
        return runs

    def forward(self, q, k_cache, v_cache, metadata, *, scale=None, causal=True, sliding_window=None,
                softcap=None, alibi_slopes=None, alibi_sqrt=False, sinks=None, prefix_ranges=None,
                k_scale=None, v_scale=None, out=None, return_lse=False):
        self._check_metadata(metadata)
        unsupported = [n for n, on in (("causal=False", not causal), ("alibi_slopes", alibi_slopes is not None),
                                       ("sinks", sinks is not None), ("prefix_ranges", prefix_ranges is not None),
                                       ("return_lse", return_lse)) if on]
        if unsupported:
            raise ValueError(f"the flashinfer backend does not support {', '.join(unsupported)}")
        fi.check_dtypes(q.dtype, k_cache.dtype)
        if out is None:
            out = torch.empty_like(q)  # the wrappers write every token's row
        elif out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must have q's shape {list(q.shape)} and dtype {q.dtype}")
        runs = self._wrappers(metadata.state, metadata, q, k_cache,
                              dict(scale=default_scale(scale, q.shape[-1]), sliding_window=sliding_window, softcap=softcap))
        for wrapper, a, b in runs:
            if b > a:
                wrapper.run(q[a:b], (k_cache, v_cache), out=out[a:b])
        return out
