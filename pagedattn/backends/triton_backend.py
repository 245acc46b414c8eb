"""The ``triton`` backend (the default): :func:`pagedattn.paged_attention` with a plan."""

from __future__ import annotations


import torch

from pagedattn._checks import head_size_supported
from pagedattn.backends.base import AttentionBackend, BackendConfig, BatchMetadata
from pagedattn.ops.common.device import interpreter_on


def triton_device_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the Triton kernels cannot run on ``device`` with ``dtype`` here, or None."""
    if device.type == "cpu":
        if not interpreter_on():
            return "the Triton kernels need a GPU, or TRITON_INTERPRET=1 on the CPU"
        # bfloat16 runs too: the public functions compute it in fp32 on the interpreter
    elif device.type not in ("cuda", "xpu"):
        return f"Triton does not target device type {device.type!r}"
    return None


def plan_for_config(query_start_loc, seq_lens, config: BackendConfig, **options):
    """:func:`pagedattn.plan_attention` for ``config``'s attention shape, on its device, for its
    dtype unless ``options`` name another (``options``: ``path`` and the rest of plan_attention's).

    The one planning call of the ``triton`` backend and of the engine's pagedattn attention
    (``pagedattn.engine.attention``).
    """
    from pagedattn.plan import plan_attention

    options.setdefault("dtype", config.dtype)  # the prefill path's tiles depend on it
    return plan_attention(query_start_loc, seq_lens, num_q_heads=config.num_q_heads,
                          num_kv_heads=config.num_kv_heads, head_size=config.head_size, device=config.device,
                          **options)


class TritonBackend(AttentionBackend):
    """Every feature, through the unified / split-KV kernels; the planner picks the path.

    ``plan`` options (passed to :func:`pagedattn.plan_attention`): ``path``, ``num_splits``,
    ``batch_invariant``, ``segment_size``, ``max_num_tokens``, ``sliding_window``.
    """

    name = "triton"
    min_head_size = 8
    max_head_size = 256

    def supports_head_size(self, head_size: int) -> bool:
        return head_size_supported(head_size)

    def device_reason(self, device, dtype):
        return triton_device_reason(device, dtype)

    def _plan_state(self, md: BatchMetadata, config: BackendConfig, **options):
        return plan_for_config(md.query_start_loc_host, md.seq_lens_host, config, **options)

    def forward(self, q, k_cache, v_cache, metadata, **features):
        from pagedattn.api import paged_attention

        self._check_metadata(metadata)
        return paged_attention(
            q, k_cache, v_cache, metadata.block_table, metadata.seq_lens, metadata.query_start_loc,
            max_query_len=metadata.max_query_len, max_seq_len=metadata.max_seq_len,
            plan=metadata.state, **features,
        )
