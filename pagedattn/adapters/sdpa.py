"""torch's ``scaled_dot_product_attention``: its kernels by name, the call, and the masks it takes.

SDPA reads contiguous ``[batch, heads, length, head_size]`` tensors. Its kernels are named as
``torch.nn.attention.SDPBackend`` members (``"CUDNN_ATTENTION"``, ``"FLASH_ATTENTION"``,
``"EFFICIENT_ATTENTION"``, ``"MATH"``); :func:`call` pins a call to the ones given (in that
order of priority), None leaves torch's default dispatch. SDPA has no logit softcap, no sink
term in its denominator and returns no log-sum-exp; its ``is_causal`` is top-left aligned, so
queries at the end of a longer sequence (extend) need an explicit mask: :func:`visible` builds
the contract's rule (docs/contract.md: causal, sliding window, prefix ranges) for one
sequence's queries, :func:`alibi_bias` the ALiBi bias.

Users: the ``sdpa`` backend (:mod:`pagedattn.backends.sdpa`; the ``flex`` backend takes the
same masks), the engine's SDPA attention (:mod:`pagedattn.engine.attention`) and its MLA
attention (:mod:`pagedattn.engine.mla_model`), and the benchmark's ``sdpa-*`` providers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kernel_status(name: str) -> tuple[bool, str]:
    """(this torch can run SDPA kernel ``name`` on CUDA, why not)."""
    try:
        from torch.nn.attention import SDPBackend
    except ImportError as e:
        return False, f"torch.nn.attention missing: {e}"
    if not hasattr(SDPBackend, name):
        return False, f"this torch has no SDPBackend.{name}"
    if name == "CUDNN_ATTENTION" and not torch.backends.cudnn.is_available():
        return False, "cuDNN is not available"
    if name == "FLASH_ATTENTION" and not torch.backends.cuda.is_flash_attention_available():
        return False, "this torch build has no flash attention"
    return True, ""


def call(q, k, v, *, kernels=None, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, **kwargs)`` on the kernels named in ``kernels``
    (first choice first), or torch's default dispatch when None."""
    if kernels is None:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    members = [getattr(SDPBackend, name) for name in kernels]
    with sdpa_kernel(members, set_priority=len(members) > 1):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def probe(kernel: str, q, k, v, mask, *, reference_mask=None, tolerance: float = 3e-2) -> str | None:
    """None if kernel ``kernel`` computes ``call(q, k, v, attn_mask=mask)`` within ``tolerance``
    of fp32 SDPA (under ``reference_mask``, default ``mask``); else the reason, one line."""
    try:
        out = call(q, k, v, kernels=[kernel], attn_mask=mask)
        ref_mask = mask if reference_mask is None else reference_mask
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=ref_mask)
        if q.device.type == "cuda":
            torch.cuda.synchronize(q.device)
        if not torch.allclose(out.float(), ref, atol=tolerance, rtol=tolerance):
            return f"{kernel} output differs from fp32 SDPA"
    except RuntimeError as e:
        return str(e).splitlines()[0][:160]
    return None


def attend(q, k, v, *, mask=None, scale=None, kernels=None, **kwargs) -> torch.Tensor:
    """One sequence, token-major: q ``[n, num_q_heads, d]``, k and v ``[seq_len, num_kv_heads,
    d | dv]`` -> ``[n, num_q_heads, dv]``. ``mask``: ``[n, seq_len]`` bool (True: visible) or an
    additive float bias ``[num_q_heads | 1, n, seq_len]``. Grouped query heads read their KV head
    without copying it."""
    if mask is not None:
        kwargs["attn_mask"] = mask if mask.dim() == 3 else mask[None]
    o = call(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], kernels=kernels,
             scale=scale, enable_gqa=q.shape[1] != k.shape[1], **kwargs)
    return o[0].transpose(0, 1)


# ---------------------------------------------------------------------------------------------
# masks (the contract's rules, one sequence at a time)


def query_positions(num_queries: int, seq_len: int, device) -> torch.Tensor:
    """``[num_queries]`` int64: the positions of a sequence's queries, its last ``num_queries``
    tokens (query j sits at ``seq_len - num_queries + j``)."""
    return torch.arange(num_queries, device=device) + (seq_len - num_queries)


def visible(q_pos: torch.Tensor, seq_len: int, *, causal: bool, sliding_window, prefix_rows) -> torch.Tensor:
    """``[len(q_pos), seq_len]`` bool: (causal and window rule) or (p and k in one prefix range)."""
    p = q_pos[:, None]
    k = torch.arange(seq_len, device=q_pos.device)[None, :]
    if causal:
        vis = k <= p
    else:
        vis = torch.ones(p.shape[0], seq_len, dtype=torch.bool, device=q_pos.device)
    if sliding_window:
        vis = vis & (k > p - sliding_window)
        if not causal:
            vis = vis & (k < p + sliding_window)
    if prefix_rows is not None:
        for start, end in prefix_rows:
            if start < end:
                vis = vis | ((p >= start) & (p < end) & (k >= start) & (k < end))
    return vis


def alibi_bias(q_pos: torch.Tensor, seq_len: int, slopes: torch.Tensor, sqrt: bool) -> torch.Tensor:
    """``[num_q_heads, len(q_pos), seq_len]`` float32: ``slope * (k - p)``, or ``-slope * sqrt(p - k)``."""
    rel = (torch.arange(seq_len, device=q_pos.device)[None, :] - q_pos[:, None]).float()
    slopes = slopes.float()[:, None, None]
    if sqrt:
        return -slopes * torch.sqrt(torch.clamp(-rel, min=0))[None]
    return slopes * rel[None]
