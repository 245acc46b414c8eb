"""The ``sdpa`` backend: ``torch.nn.functional.scaled_dot_product_attention`` per sequence."""

from __future__ import annotations

import torch

from pagedattn.adapters import sdpa
from pagedattn.adapters.sdpa import alibi_bias
from pagedattn.backends._common import default_scale, loop_sequences, prepare_out
from pagedattn.backends.base import FEATURES, AttentionBackend


class SdpaBackend(AttentionBackend):
    """K/V gathered per sequence from the paged cache, an explicit mask built from the contract's rules (docs/contract.md).

    The mask is boolean, or a float bias (``-inf`` where not visible) when ALiBi is on. SDPA
    has no logit softcap, no sink term in its denominator and returns no log-sum-exp, so
    ``softcap``, ``sinks`` and ``lse`` are not supported. An fp8 cache is dequantized while
    gathering. A query that sees no key gets output 0.
    """

    name = "sdpa"
    feature_names = FEATURES - {"softcap", "sinks", "lse"}

    def forward(self, q, k_cache, v_cache, metadata, *, scale=None, causal=True, sliding_window=None,
                softcap=None, alibi_slopes=None, alibi_sqrt=False, sinks=None, prefix_ranges=None,
                k_scale=None, v_scale=None, out=None, return_lse=False):
        self._check_metadata(metadata)
        unsupported = [n for n, on in (("softcap", bool(softcap)), ("sinks", sinks is not None),
                                       ("return_lse", return_lse)) if on]
        if unsupported:
            raise ValueError(f"the sdpa backend does not support {', '.join(unsupported)}")
        scale = default_scale(scale, q.shape[-1])
        out, _ = prepare_out(q, out, False)
        for q0, q1, seq_len, q_pos, k, v, vis in loop_sequences(
            q, k_cache, v_cache, metadata, causal=causal, sliding_window=sliding_window,
            prefix_ranges=prefix_ranges, k_scale=k_scale, v_scale=v_scale,
        ):
            if alibi_slopes is not None:
                bias = alibi_bias(q_pos, seq_len, alibi_slopes, alibi_sqrt)
                mask = bias.masked_fill(~vis[None], float("-inf")).to(q.dtype)
            else:
                mask = vis
            o = sdpa.attend(q[q0:q1], k, v, mask=mask, scale=scale)
            out[q0:q1] = torch.where(vis.any(1)[:, None, None], o, torch.zeros((), dtype=o.dtype, device=o.device))
        return out
