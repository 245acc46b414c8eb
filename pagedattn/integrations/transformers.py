"""``attn_implementation="pagedattn"`` for Hugging Face transformers models.

>>> import pagedattn.integrations.transformers as pa_hf
>>> pa_hf.register()
>>> model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="pagedattn")

:func:`register` adds :func:`paged_attention_forward` to transformers' ``AttentionInterface``
and, under the same name, transformers' SDPA mask builder to ``AttentionMaskInterface`` (so the
model hands each layer the boolean ``[batch, 1, q_len, kv_len]`` mask SDPA would get, or None
when SDPA would use no mask). Tested with transformers 5.24 (decoders such as Llama, Mistral,
Gemma 2, GPT-OSS; encoders such as BERT).

How a call becomes a ``paged_attention`` call
---------------------------------------------
Each batch row is one sequence. Its K/V (``[batch, kv_heads, kv_len, head_dim]``) are copied
into a temporary paged cache of 16-token pages, starting at the row's first unmasked key, so
left and right padding cost nothing; the queries stay in place (``q_len`` per row). The causal
rule comes from ``module.is_causal`` (or an ``is_causal`` keyword), the window from a
``sliding_window`` keyword or ``module.sliding_window``, the logit softcap from a ``softcap``
keyword or ``config.attn_logit_softcapping``, sinks from ``s_aux`` or ``module.sinks``; GQA
head counts pass through.

The mask is read, not trusted: the position of every query is inferred from it, the mask
that ``paged_attention`` would apply is rebuilt and compared (once per mask tensor, one host
synchronization, cached for the other layers). A mask that a paged call cannot express (keys
hidden in the middle of a row, packed sequences, bidirectional image blocks, chunked
attention, additive float biases) raises ValueError; use ``"sdpa"`` or ``"eager"`` for such
models. Query rows of padding tokens (in causal models, a query whose own key is masked
for every query) get output 0; no real token reads them.

Not supported: attention dropout in training (``dropout > 0`` raises), ``output_attentions``
(weights are None), T5-style ``position_bias``, a K head size different from V's.

Continuous batching (``model.generate_batch`` / ``ContinuousBatchingManager``)
------------------------------------------------------------------------------
transformers' continuous batching keeps its own paged cache (``PagedAttentionCache``): per layer
it writes the new K/V through ``write_index``, gathers every scheduled sequence's keys back with
``read_index`` (its index path; the block-table path exists only for flash-attention kernels on
CUDA) and calls the attention function once for the whole packed batch: query
``[1, num_q_heads, num_tokens, head_dim]``, key / value ``[1, num_kv_heads, num_kv_tokens,
head_dim]`` with ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k``; each
sequence's new tokens are its last keys. Such a call (cumulative lengths, no mask) is computed by
:func:`pagedattn.varlen_attention` (the large-tile kernel; decode, extend and prefill sequences
of one step in one launch), with the layer's window, softcap and sinks.

The manager accepts only ``"paged|eager"``, ``"sdpa"`` and names containing ``"flash"``
(``ContinuousBatchingManager.switch_to_cb_friendly_attn`` raises for any other), so
:func:`register` wraps that method: a model whose implementation is a name registered here keeps
it (and is not switched to flash attention); every other model goes through transformers' own
check unchanged. transformers 5.24 strips a ``"paged|"`` prefix (except ``"paged|eager"``), so
the one name serves ``generate`` and ``generate_batch``. With a name that transformers does not
know, the manager builds no attention mask and no CUDA graphs by default, and reserves memory as
for SDPA (its estimate counts masks it will not build).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["NAME", "register", "paged_attention_forward", "varlen_attention_forward"]

NAME = "pagedattn"
PAGE_SIZE = 16
_CACHE_SIZE = 8


_REGISTERED: set = set()


def register(name: str = NAME, *, continuous_batching: bool = True) -> str:
    """Make ``attn_implementation=name`` (default ``"pagedattn"``) available in transformers.

    With ``continuous_batching`` (default), ``model.generate_batch`` and
    ``ContinuousBatchingManager`` also accept the name (module docstring) where the installed
    transformers has continuous batching. Idempotent. Returns the name. Raises ImportError when
    transformers is not installed.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, paged_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    _REGISTERED.add(name)
    if continuous_batching:
        _allow_in_continuous_batching()
    return name


def _allow_in_continuous_batching() -> bool:
    """Wrap ``ContinuousBatchingManager.switch_to_cb_friendly_attn`` once so that models using a
    name from :func:`register` keep it; False when this transformers has no continuous batching."""
    try:
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
    except ImportError:
        return False
    original = getattr(ContinuousBatchingManager, "switch_to_cb_friendly_attn", None)
    if original is None:
        return False
    if getattr(original, "_pagedattn_wrapped", False):
        return True

    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
        if getattr(model.config, "_attn_implementation", None) in _REGISTERED:
            return None  # pagedattn serves the packed calls itself (varlen_attention_forward)
        return original(self, model, *args, **kwargs)

    switch_to_cb_friendly_attn._pagedattn_wrapped = True
    switch_to_cb_friendly_attn.__wrapped__ = original
    switch_to_cb_friendly_attn.__doc__ = original.__doc__
    ContinuousBatchingManager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn
    return True


@dataclass
class _Layout:
    """Where each batch row's keys and queries go in the paged call."""

    causal: bool
    window: int | None
    key_index: torch.Tensor | None  # [batch, padded_len] key of each paged slot (None: keys as they are)
    padded_len: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_seq_len: int
    real_rows: torch.Tensor | None  # [batch, q_len] bool: rows to keep (others -> 0); None: all


_layouts: "OrderedDict[tuple, tuple]" = OrderedDict()


def _remember(key, value, mask=None):
    _layouts[key] = (weakref.ref(mask) if mask is not None else None, value)
    _layouts.move_to_end(key)
    while len(_layouts) > _CACHE_SIZE:
        _layouts.popitem(last=False)


def _recall(key, mask=None):
    hit = _layouts.get(key)
    if hit is None:
        return None
    ref, value = hit
    if mask is not None and (ref is None or ref() is not mask):
        return None
    return value


def _pages_meta(batch: int, q_len: int, max_seq_len: int, device):
    padded = max(PAGE_SIZE, -(-max_seq_len // PAGE_SIZE) * PAGE_SIZE)
    pages = padded // PAGE_SIZE
    block_table = (torch.arange(batch, device=device)[:, None] * pages
                   + torch.arange(pages, device=device)[None, :]).to(torch.int32)
    qsl = (torch.arange(batch + 1, device=device) * q_len).to(torch.int32)
    return padded, block_table, qsl


def _layout_without_mask(batch, q_len, kv_len, causal, window, device) -> _Layout:
    key = ("none", batch, q_len, kv_len, causal, window, str(device))
    hit = _recall(key)
    if hit is not None:
        return hit
    # SDPA semantics of a missing mask: causal with q_len > 1 is aligned top-left (query i sees
    # keys 0..i; with a static cache the keys past q_len are empty slots), else every key.
    seq_len = q_len if causal and q_len > 1 else kv_len
    padded, block_table, qsl = _pages_meta(batch, q_len, seq_len, device)
    index = None
    if padded != kv_len:
        index = torch.arange(padded, device=device).clamp(max=max(kv_len - 1, 0))[None].expand(batch, -1)
    layout = _Layout(
        causal=causal, window=window, key_index=index, padded_len=padded, block_table=block_table,
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=device), query_start_loc=qsl,
        max_seq_len=seq_len, real_rows=None,
    )
    _remember(key, layout)
    return layout


def _bool_mask(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise TypeError(f"attention_mask: expected a bool or float mask, got {mask.dtype}")
    hidden = mask <= torch.finfo(mask.dtype).min / 2
    if not bool(((mask == 0) | hidden).all()):
        raise ValueError(
            "attention_mask: an additive mask with biases other than 0 / -inf cannot be expressed by "
            "pagedattn; use attn_implementation='sdpa' or 'eager'"
        )
    return ~hidden


def _layout_from_mask(mask, batch, q_len, kv_len, causal, window, device) -> _Layout:
    key = ("mask", id(mask), mask._version, batch, q_len, kv_len, causal, window)
    hit = _recall(key, mask)
    if hit is not None:
        return hit
    if mask.dim() != 4 or mask.shape[-2:] != (q_len, kv_len) or mask.shape[0] not in (1, batch):
        raise ValueError(
            f"attention_mask: expected shape [batch, 1, {q_len}, {kv_len}], got {list(mask.shape)}"
        )
    m = _bool_mask(mask)
    if m.shape[1] != 1:
        if not bool((m == m[:, :1]).all()):
            raise ValueError("attention_mask: masks that differ between heads cannot be expressed by pagedattn")
        m = m[:, :1]
    m = m[:, 0].expand(batch, q_len, kv_len)
    ar = torch.arange(kv_len, device=device)
    qi = torch.arange(q_len, device=device)
    key_valid = m.any(1)  # [batch, kv_len]: keys some query sees
    lo = torch.where(key_valid, ar, kv_len).amin(1)
    hi = torch.where(key_valid, ar + 1, 0).amax(1)
    contiguous = key_valid.sum(1) == (hi - lo).clamp(min=0)
    row_seen = m.any(2)  # [batch, q_len]
    if causal:
        # query i sits at mask column d + i; its last visible key is min(d + i, hi - 1)
        last = torch.where(m, ar, -1).amax(2)
        big = kv_len + q_len + 1
        d = torch.where(row_seen, last - qi, -big).amax()
        d = torch.where(d == -big, torch.tensor(kv_len - q_len, device=device), d)
        col = d + qi  # [q_len]
        real = (col[None] >= lo[:, None]) & (col[None] < hi[:, None])
        expect = key_valid[:, None, :] & (ar[None, None, :] <= col[None, :, None])
        if window:
            expect = expect & (ar[None, None, :] > col[None, :, None] - window)
        seq_lens = (d + q_len - lo).clamp(min=0)
    else:
        real = row_seen
        expect = key_valid[:, None, :].expand(batch, q_len, kv_len)
        seq_lens = (hi - lo).clamp(min=0)
        if window:
            # paged_attention places query i at hi - q_len + i (bottom-right in the row's keys)
            pos = (hi[:, None] - q_len + qi[None])[..., None]
            expect = expect & (ar > pos - window) & (ar < pos + window)
        d = torch.zeros((), dtype=torch.long, device=device)
    ok = contiguous.all() & ((m == expect) | ~real[..., None]).all()
    ok, max_seq_len = torch.stack([ok.long(), seq_lens.amax() if batch else d * 0]).tolist()  # one host sync
    if not ok:
        raise ValueError(
            "attention_mask: this mask is not expressible as one paged_attention call per batch row "
            f"(causal={causal}, sliding_window={window}): pagedattn handles padding on either side, causal "
            "or bidirectional attention and a sliding window, not masks that hide keys inside a row, "
            "packed sequences, block or chunked patterns; use attn_implementation='sdpa' or 'eager'"
        )
    padded, block_table, qsl = _pages_meta(batch, q_len, max_seq_len, device)
    index = (lo[:, None] + torch.arange(padded, device=device)[None]).clamp(0, max(kv_len - 1, 0))
    layout = _Layout(
        causal=causal, window=window, key_index=index, padded_len=padded, block_table=block_table,
        seq_lens=seq_lens.to(torch.int32), query_start_loc=qsl, max_seq_len=max_seq_len,
        real_rows=None if bool(real.all()) else real,
    )
    _remember(key, layout, mask)
    return layout


def _paged(x: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """``[batch, kv_heads, kv_len, head]`` -> ``[batch * pages, PAGE_SIZE, kv_heads, head]``."""
    batch, heads, _, head = x.shape
    x = x.transpose(1, 2)
    if layout.key_index is not None:
        x = x[torch.arange(batch, device=x.device)[:, None], layout.key_index]
    return x.reshape(batch * layout.padded_len // PAGE_SIZE, PAGE_SIZE, heads, head)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """transformers attention function computed by :func:`pagedattn.paged_attention`.

    A packed call (batch 1, ``cu_seq_lens_q`` / ``cu_seq_lens_k`` and no mask: continuous
    batching, padding-free batches) goes to :func:`varlen_attention_forward` instead.

    Parameters
    ----------
    module : the attention layer (``is_causal``, ``sliding_window``, ``sinks``, ``config`` are read).
    query : ``[batch, num_q_heads, q_len, head_dim]``
    key, value : ``[batch, num_kv_heads, kv_len, head_dim]``, query's dtype
    attention_mask : ``[batch or 1, 1, q_len, kv_len]`` bool (True: visible) or additive float
        (0 / -inf), or None (SDPA's meaning: causal top-left aligned for q_len > 1, else all keys).
    scaling : score scale (default ``1 / sqrt(head_dim)``).
    dropout : must be 0 (no attention dropout).

    Returns
    -------
    (out ``[batch, q_len, num_q_heads, head_dim]``, None)
    """
    from pagedattn.api import paged_attention

    if dropout:
        raise ValueError(f"pagedattn has no attention dropout (got dropout={dropout}); call model.eval()")
    if kwargs.get("position_bias") is not None:
        raise ValueError("pagedattn cannot add a position_bias (T5-style); use attn_implementation='sdpa'")
    if not isinstance(attention_mask, (torch.Tensor, type(None))):
        raise TypeError(f"attention_mask: pagedattn takes a tensor mask or None, got {type(attention_mask).__name__}")
    batch, num_q_heads, q_len, head_dim = query.shape
    _, num_kv_heads, kv_len, _ = key.shape
    if value.shape[-1] != head_dim:
        raise ValueError(f"value head_dim {value.shape[-1]} differs from query head_dim {head_dim}")

    causal, window, softcap, sinks = _layer_features(module, kwargs, num_q_heads, query.device)
    if attention_mask is None and kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None:
        return varlen_attention_forward(query, key, value, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"],
                                        max_length_q=kwargs.get("max_length_q"), scaling=scaling, causal=causal,
                                        window=window, softcap=softcap, sinks=sinks)

    if attention_mask is None:
        layout = _layout_without_mask(batch, q_len, kv_len, causal, window, query.device)
    else:
        layout = _layout_from_mask(attention_mask, batch, q_len, kv_len, causal, window, query.device)
    q = query.transpose(1, 2).reshape(batch * q_len, num_q_heads, head_dim)
    out = paged_attention(
        q, _paged(key, layout), _paged(value, layout), layout.block_table, layout.seq_lens,
        layout.query_start_loc, max_query_len=q_len, max_seq_len=layout.max_seq_len, scale=scaling,
        causal=layout.causal, sliding_window=layout.window, softcap=softcap or None, sinks=sinks,
    ).view(batch, q_len, num_q_heads, head_dim)
    if layout.real_rows is not None:
        out = out * layout.real_rows[..., None, None].to(out.dtype)
    return out, None


def _layer_features(module, kwargs: dict, num_q_heads: int, device):
    """(causal, window, softcap, sinks) of one layer's call, from its keywords or the module."""
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    causal = bool(causal)
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None)) or None
    if window is not None and not causal:
        window = int(window) + 1  # transformers' bidirectional window keeps |q - k| <= W
    softcap = kwargs.get("softcap")
    if softcap is None:
        softcap = getattr(getattr(module, "config", None), "attn_logit_softcapping", None)
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    if sinks is not None:
        sinks = sinks.detach().to(device=device, dtype=torch.float32).reshape(num_q_heads).contiguous()
    return causal, window, softcap or None, sinks


def varlen_attention_forward(query, key, value, cu_seq_lens_q, cu_seq_lens_k, *, max_length_q=None, scaling=None,
                             causal=True, window=None, softcap=None, sinks=None):
    """A packed batch (continuous batching's call) through :func:`pagedattn.varlen_attention`.

    Parameters
    ----------
    query : ``[1, num_q_heads, num_tokens, head_dim]``; sequence s owns tokens
        ``cu_seq_lens_q[s]:cu_seq_lens_q[s+1]``, the last of its keys.
    key, value : ``[1, num_kv_heads, num_kv_tokens, head_dim]``; sequence s owns keys
        ``cu_seq_lens_k[s]:cu_seq_lens_k[s+1]``.
    cu_seq_lens_q, cu_seq_lens_k : ``[num_seqs + 1]`` int32 or int64, on query's device.
    max_length_q : host int (without it, one host sync).

    Returns
    -------
    (out ``[1, num_tokens, num_q_heads, head_dim]``, None). Tokens past ``cu_seq_lens_q[-1]``
    (padding) get output 0.
    """
    from pagedattn.api import varlen_attention

    if query.shape[0] != 1:
        raise ValueError(f"a packed call (cu_seq_lens_q given, no mask) needs batch 1, got query {list(query.shape)}")
    _, num_q_heads, num_tokens, head_dim = query.shape
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=query.dtype, device=query.device)
    if isinstance(max_length_q, torch.Tensor):
        max_length_q = int(max_length_q)
    varlen_attention(
        q, k, v, cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32), max_query_len=max_length_q,
        scale=scaling, causal=causal, sliding_window=window, softcap=softcap, sinks=sinks, out=out,
    )
    return out.unsqueeze(0), None
