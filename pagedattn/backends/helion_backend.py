"""The ``helion`` backend: :func:`pagedattn.helion.paged_attention` with a step plan (by name only).

Helion is imported when a plan or a call needs it, never by ``import pagedattn.backends``.
"""

from __future__ import annotations

import importlib.util

import torch

from pagedattn._checks import head_size_supported
from pagedattn.backends.base import AttentionBackend, BackendConfig, BatchMetadata


class HelionBackend(AttentionBackend):
    """Causal and non-causal attention, sliding window, softcap, GQA and lse, in Helion kernels
    (docs/helion.md); ALiBi, sinks, prefix ranges and fp8 caches are left to ``triton``.

    Runs compiled on CUDA and in Helion's reference mode (eager PyTorch) on the CPU. Never
    chosen automatically. ``plan`` options: ``sliding_window`` (the window this step's calls
    pass: fewer decode segments) and ``segment_size`` (keys per decode segment).
    """

    name = "helion"
    feature_names = frozenset({"causal", "noncausal", "window", "softcap", "lse"})
    min_head_size = 8
    max_head_size = 256

    def unavailable_reason(self):
        if importlib.util.find_spec("helion") is None:
            return "helion is not installed (from the pagedattn checkout: pip install -e '.[helion]')"
        return None

    def supports_head_size(self, head_size: int) -> bool:
        return head_size_supported(head_size)

    def device_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type not in ("cuda", "cpu"):
            return f"the Helion kernels run on CUDA (compiled) or the CPU (reference mode), not {device.type!r}"
        return None

    def _plan_state(self, md: BatchMetadata, config: BackendConfig, **options):
        from pagedattn.helion import plan_attention

        unknown = sorted(set(options) - {"sliding_window", "segment_size"})
        if unknown:
            raise TypeError(f"backend 'helion' plan options are sliding_window and segment_size, got {unknown}")
        return plan_attention(
            md.query_start_loc_host, md.seq_lens_host, num_q_heads=config.num_q_heads,
            num_kv_heads=config.num_kv_heads, head_size=config.head_size, device=config.device,
            causal="noncausal" not in config.features, **options,
        )

    def forward(self, q, k_cache, v_cache, metadata, **features):
        from pagedattn.helion import paged_attention

        self._check_metadata(metadata)
        return paged_attention(
            q, k_cache, v_cache, metadata.block_table, metadata.seq_lens, metadata.query_start_loc,
            max_query_len=metadata.max_query_len, max_seq_len=metadata.max_seq_len, plan=metadata.state, **features,
        )
