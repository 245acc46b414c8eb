"""The ``flex`` backend: ``torch.nn.attention.flex_attention``, uncompiled, per sequence."""

from __future__ import annotations

import warnings

import torch

from pagedattn.backends._common import (
    default_scale,
    loop_sequences,
    prepare_out,
)
from pagedattn.backends.base import AttentionBackend


def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return flex_attention, create_block_mask


class FlexBackend(AttentionBackend):
    """Every feature: the visibility rules as a ``mask_mod`` (an index into a mask built per
    sequence), softcap and ALiBi as a ``score_mod``, sinks added to the returned log-sum-exp
    (``out *= sigmoid(lse - sink)``, ``lse = logaddexp(lse, sink)``).

    Runs flex_attention eagerly (no ``torch.compile``): correct everywhere, slow. An fp8 cache
    is dequantized while gathering.
    """

    name = "flex"

    def unavailable_reason(self):
        try:
            _flex()
        except Exception as e:  # ImportError, or an older torch without flex attention
            return f"torch.nn.attention.flex_attention is unavailable ({type(e).__name__}: {e})"
        return None

    def forward(self, q, k_cache, v_cache, metadata, *, scale=None, causal=True, sliding_window=None,
                softcap=None, alibi_slopes=None, alibi_sqrt=False, sinks=None, prefix_ranges=None,
                k_scale=None, v_scale=None, out=None, return_lse=False):
        self._check_metadata(metadata)
        flex_attention, create_block_mask = _flex()
        scale = default_scale(scale, q.shape[-1])
        out, lse = prepare_out(q, out, return_lse)
        for q0, q1, seq_len, q_pos, k, v, vis in loop_sequences(
            q, k_cache, v_cache, metadata, causal=causal, sliding_window=sliding_window,
            prefix_ranges=prefix_ranges, k_scale=k_scale, v_scale=v_scale,
        ):
            score_mod = _score_mod(q_pos, softcap, alibi_slopes, alibi_sqrt)

            def mask_mod(b, h, qi, ki, vis=vis):
                return vis[qi, ki]

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
                block_mask = create_block_mask(mask_mod, 1, 1, q1 - q0, seq_len, device=q.device)
                o, l = flex_attention(
                    q[q0:q1].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                    score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True, return_lse=True,
                )
            o, l = o[0].transpose(0, 1).float(), l[0].transpose(0, 1).float()  # [q_len, heads, D], [q_len, heads]
            seen = vis.any(1)[:, None]
            l = torch.where(seen, l, float("-inf"))
            o = torch.where(seen[..., None], o, 0.0)
            if sinks is not None:
                sink = sinks.float()[None, :]
                o = o * torch.where(seen, torch.sigmoid(l - sink), 0.0)[..., None]
                l = torch.logaddexp(l, sink.expand_as(l))
            out[q0:q1] = o.to(q.dtype)
            if lse is not None:
                lse[q0:q1] = l
        return (out, lse) if return_lse else out


def _score_mod(q_pos, softcap, alibi_slopes, alibi_sqrt):
    if not softcap and alibi_slopes is None:
        return None
    slopes = None if alibi_slopes is None else alibi_slopes.float()

    def score_mod(score, b, h, qi, ki):
        if softcap:
            score = softcap * torch.tanh(score / softcap)
        if slopes is not None:
            rel = (ki - q_pos[qi]).to(score.dtype)  # k - p
            if alibi_sqrt:
                score = score - slopes[h] * torch.sqrt(torch.clamp(-rel, min=0.0))
            else:
                score = score + slopes[h] * rel
        return score

    return score_mod
