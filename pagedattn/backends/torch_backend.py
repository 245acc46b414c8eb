"""The ``torch`` backend: the reference semantics, computed in float32, on any device."""

from __future__ import annotations

import torch

from pagedattn.backends.base import AttentionBackend


class TorchBackend(AttentionBackend):
    """:func:`pagedattn.reference.paged_attention_ref` in float32, cast to q's dtype.

    Every feature, any head size, any device PyTorch runs on; slow (a Python loop over the
    sequences, a host synchronization per call). The fallback of last resort.
    """

    name = "torch"

    def forward(self, q, k_cache, v_cache, metadata, *, out=None, return_lse=False, **features):
        from pagedattn.reference import paged_attention_ref

        self._check_metadata(metadata)
        ref_out, ref_lse = paged_attention_ref(
            q, k_cache, v_cache, metadata.block_table, metadata.seq_lens, metadata.query_start_loc,
            compute_dtype=torch.float32, **features,
        )
        if out is None:
            out = ref_out.to(q.dtype)
        else:
            out.copy_(ref_out)
        return (out, ref_lse.float()) if return_lse else out
