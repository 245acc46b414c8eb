"""``attn_implementation="pagedattn"`` for Hugging Face transformers models.

>>> import pagedattn.integrations.transformers as pa_hf
>>> pa_hf.register()
>>> model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="pagedattn")

:func:`register` adds :func:`paged_attention_forward` to transformers' ``AttentionInterface``
and, under the same name, transformers' SDPA mask builder to ``AttentionMaskInterface`` (so the
model hands each layer the boolean ``[batch, 1, q_len, kv_len]`` mask SDPA would get, or None
when SDPA would use no mask). Tested with transformers 5.24 on tiny random models of Llama,
Mistral, Qwen2, Qwen3, Phi3, Gemma 2, Gemma 3 (text, and with images), GPT-OSS, BERT,
ModernBERT, BART, Whisper and Llava (docs/transformers.md). The name must be registered before
a model asks for it: without :func:`register`, transformers raises its generic "not supported"
error (which names :func:`register` once this module is imported). A model whose attention does
not go through ``AttentionInterface`` (BLOOM, for one: its attention module computes ALiBi scores itself) cannot
take the name: ``set_attn_implementation`` and loading with it raise ValueError instead of
transformers keeping the model's own attention.

How a call becomes a ``paged_attention`` call
---------------------------------------------
Each batch row is one sequence. Its K/V (``[batch, kv_heads, kv_len, head_dim]``) are copied
into a temporary paged cache of 16-token pages, starting at the row's first unmasked key, so
left and right padding cost nothing; the queries stay in place (``q_len`` per row). The causal
rule comes from ``module.is_causal`` (or an ``is_causal`` keyword), the window from a
``sliding_window`` keyword or ``module.sliding_window`` (transformers' attention functions take
flash-attention's window, the W of ``paged_attention``: causal, the W latest keys; not causal,
``|q - k| < W``), the logit softcap from a ``softcap`` keyword or
``config.attn_logit_softcapping``, sinks from ``s_aux`` or ``module.sinks``; GQA head counts
pass through. In a bidirectional layer with a window and padding, each row's real queries form
one sequence of the call and its padding queries sequences without keys, so every query sits at
its own token.

The mask is read, not trusted: the position of every query is inferred from it, the mask
that ``paged_attention`` would apply is rebuilt and compared (once per mask tensor, one host
synchronization, cached for the other layers). Bidirectional blocks inside a causal mask
(Gemma 3's image tokens: a block's tokens see each other both ways) are read from the mask into
``prefix_ranges`` (:func:`prefix_ranges_from_token_type_ids` gives the same ranges from
``token_type_ids``). A mask that a paged call cannot express (keys hidden in the middle of a row,
packed sequences, chunked attention, a block longer than the sliding window reaches back,
additive float biases) raises ValueError; use ``"sdpa"`` or ``"eager"`` for such models. Query
rows of padding tokens (in causal models, a query whose own key is masked for every query) get
output 0; no real token reads them.

Refused, before any launch: autograd (the kernels have no backward pass: with grad mode on and a
query, key, value or sinks tensor that requires grad the call raises RuntimeError; run under
``torch.no_grad()`` / ``torch.inference_mode()``, or train with ``"sdpa"``), attention dropout
(``dropout > 0``), ``output_attentions=True`` (no weights are formed), T5-style
``position_bias``, a K head size different from V's (ValueError).

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

__all__ = ["NAME", "register", "paged_attention_forward", "varlen_attention_forward",
           "prefix_ranges_from_token_type_ids"]

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
    _refuse_models_without_the_interface()
    if continuous_batching:
        _allow_in_continuous_batching()
    return name


def _wrap_method(owner, name: str, make) -> bool:
    """Replace ``owner.name`` by ``make(original)``, once; False when ``owner`` has no such method."""
    original = getattr(owner, name, None)
    if original is None:
        return False
    if not getattr(original, "_pagedattn_wrapped", False):
        wrapper = make(original)
        wrapper._pagedattn_wrapped = True
        wrapper.__wrapped__ = original
        wrapper.__doc__ = original.__doc__
        setattr(owner, name, wrapper)
    return True


def _hint_when_unregistered() -> None:
    """Add to transformers' "not supported" error for ``attn_implementation="pagedattn"`` that
    :func:`register` was not called (only reachable once this module is imported)."""
    try:
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:
        return

    def make(original):
        def get_correct_attn_implementation(self, requested_attention, *args, **kwargs):
            try:
                return original(self, requested_attention, *args, **kwargs)
            except ValueError as err:
                if requested_attention == NAME and NAME not in _REGISTERED:
                    raise ValueError(
                        f'{err} attn_implementation="{NAME}" needs pagedattn.integrations.transformers.register() '
                        "called once before the model is built or loaded"
                    ) from err
                raise

        return get_correct_attn_implementation

    _wrap_method(PreTrainedModel, "get_correct_attn_implementation", make)


def _requested(attn_implementation):
    """The top-level name of an ``attn_implementation`` argument (a name, or a dict of them)."""
    if isinstance(attn_implementation, dict):
        return attn_implementation.get("")
    return attn_implementation


def _check_interface(model, attn_implementation) -> None:
    """ValueError when ``attn_implementation`` is a registered name and ``model`` computes its
    attention in its own modules: transformers would keep (``set_attn_implementation``: with a
    logged warning only) or fail to find (at load: KeyError) the model's own attention."""
    name = _requested(attn_implementation)
    if name not in _REGISTERED:
        return
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        raise ValueError(
            f'{type(model).__name__} computes attention in its own modules, not through transformers\' '
            f'AttentionInterface, so attn_implementation="{name}" cannot reach its layers (transformers would '
            'keep the model\'s own attention); use "sdpa" or "eager" for it. docs/transformers.md lists the '
            "tested models."
        )


def _refuse_models_without_the_interface() -> None:
    """Check the model before transformers applies a registered name: when it is set on a built
    model (``set_attn_implementation``) and when a model is built with it (``from_pretrained``,
    ``from_config``: transformers checks the name in ``_check_and_adjust_attn_implementation``)."""
    from transformers.modeling_utils import PreTrainedModel

    def make_set(original):
        def set_attn_implementation(self, attn_implementation, *args, **kwargs):
            _check_interface(self, attn_implementation)
            return original(self, attn_implementation, *args, **kwargs)

        return set_attn_implementation

    def make_check(original):
        def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
            _check_interface(self, attn_implementation)
            return original(self, attn_implementation, *args, **kwargs)

        return _check_and_adjust_attn_implementation

    _wrap_method(PreTrainedModel, "set_attn_implementation", make_set)
    _wrap_method(PreTrainedModel, "_check_and_adjust_attn_implementation", make_check)


def _allow_in_continuous_batching() -> bool:
    """Wrap ``ContinuousBatchingManager.switch_to_cb_friendly_attn`` once so that models using a
    name from :func:`register` keep it; False when this transformers has no continuous batching."""
    try:
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
    except ImportError:
        return False

    def make(original):
        def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
            if getattr(model.config, "_attn_implementation", None) in _REGISTERED:
                return None  # pagedattn serves the packed calls itself (varlen_attention_forward)
            return original(self, model, *args, **kwargs)

        return switch_to_cb_friendly_attn

    return _wrap_method(ContinuousBatchingManager, "switch_to_cb_friendly_attn", make)


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
    prefix_ranges: torch.Tensor | None = None  # [num_seqs, R, 2] int32 bidirectional ranges, positions


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
    zero = torch.zeros((), dtype=torch.long, device=device)
    num_ranges, segments, ranges = zero, zero, None
    if causal:
        col, real, expect, ranges, ranges_ok = _causal_expectation(m, row_seen, key_valid, lo, hi, window)
        seq_lens = (col[-1] + 1 - lo).clamp(min=0)  # the last query sits on the row's last key
        ok_rows = real
        if ranges is not None:
            num_ranges = ranges[1]
    else:
        expect = key_valid[:, None, :].expand(batch, q_len, kv_len)
        seq_lens = (hi - lo).clamp(min=0)
        ok_rows = row_seen
        ranges_ok = torch.ones((), dtype=torch.bool, device=device)
        if window:
            # A bidirectional window needs each query at its own column: the row's real queries
            # (its unpadded tokens) become one sequence of the call, placed bottom-right on the
            # row's keys, and the padding queries before and after become sequences without keys.
            off = kv_len - q_len
            q_lo = (lo - off).clamp(0, q_len)
            q_hi = (hi - off).clamp(0, q_len).maximum(q_lo)
            real = (qi[None] >= q_lo[:, None]) & (qi[None] < q_hi[:, None])
            pos = (hi - q_hi)[:, None] + qi[None]  # [batch, q_len] mask column of each placed query
            expect = expect & (ar > pos[..., None] - window) & (ar < pos[..., None] + window)
            ok_rows = real
            segments = ((q_lo > 0) | (q_hi < q_len)).any().long()
    ok = contiguous.all() & ranges_ok & ((m == expect) | ~ok_rows[..., None]).all()
    max_seq_len = seq_lens.amax() if batch else zero
    ok, max_seq_len, num_ranges, segments, all_rows = torch.stack(
        [ok.long(), max_seq_len.long(), num_ranges.long(), segments, ok_rows.all().long()]).tolist()  # one host sync
    if not ok:
        raise ValueError(
            "attention_mask: this mask is not expressible as one paged_attention call per batch row "
            f"(causal={causal}, sliding_window={window}): pagedattn handles padding on either side, causal "
            "or bidirectional attention, a sliding window and bidirectional blocks inside a causal mask (image "
            "tokens: visible = (causal and window) or same block), not masks that hide keys inside a row, "
            "packed sequences or chunked patterns; use attn_implementation='sdpa' or 'eager'"
        )
    padded, block_table, qsl = _pages_meta(batch, q_len, max_seq_len, device)
    index = (lo[:, None] + torch.arange(padded, device=device)[None]).clamp(0, max(kv_len - 1, 0))
    prefix = None
    if num_ranges:
        prefix = _compact_ranges(ranges[0], lo, num_ranges)
    seq_lens = seq_lens.to(torch.int32)
    if segments:
        base = torch.arange(batch, device=device) * q_len
        qsl = torch.cat([torch.stack([base, base + q_lo, base + q_hi], 1).flatten(),
                         base.new_full((1,), batch * q_len)]).to(torch.int32)
        seq_lens = torch.stack([torch.zeros_like(seq_lens), seq_lens, torch.zeros_like(seq_lens)], 1).flatten()
        block_table = block_table.repeat_interleave(3, dim=0)
    layout = _Layout(
        causal=causal, window=window, key_index=index, padded_len=padded, block_table=block_table,
        seq_lens=seq_lens, query_start_loc=qsl, max_seq_len=max_seq_len,
        real_rows=None if all_rows else ok_rows, prefix_ranges=prefix,
    )
    _remember(key, layout, mask)
    return layout


def _causal_expectation(m, row_seen, key_valid, lo, hi, window):
    """Query columns, real rows, the mask a paged call would apply, and bidirectional ranges for a
    causal mask ``m`` ``[batch, q_len, kv_len]``.

    Query i sits at column d + i. The last query of a row that sees a key sees its own column and
    nothing after it (a bidirectional block ends at the latest at the last token), so d is read
    there. A query that sees a key after its own column belongs to a bidirectional block that ends
    after that key; the queries that share the block's end give its start (the earliest of them,
    or, with a window, a visible key further back than the window reaches).

    Returns ``(col [q_len], real [batch, q_len], expect [batch, q_len, kv_len], ranges, ok)``;
    ranges is None or ``(starts [batch, kv_len + 2], count)``: ``starts[b, e]`` is the start column
    of the block of row b that ends before column e (``kv_len + 1`` where there is none).
    """
    batch, q_len, kv_len = m.shape
    device = m.device
    ar = torch.arange(kv_len, device=device)
    qi = torch.arange(q_len, device=device)
    last = torch.where(m, ar, -1).amax(2)  # [batch, q_len]
    big = kv_len + q_len + 1
    d_last = torch.where(row_seen[:, -1], last[:, -1] - (q_len - 1), -big).amax()
    d_any = torch.where(row_seen, last - qi, -big).amax()
    d = torch.where(d_last > -big, d_last, d_any)
    d = torch.where(d == -big, torch.tensor(kv_len - q_len, device=device), d)
    col = d + qi  # [q_len]
    real = (col[None] >= lo[:, None]) & (col[None] < hi[:, None])
    expect = key_valid[:, None, :] & (ar[None, None, :] <= col[None, :, None])
    if window:
        expect = expect & (ar[None, None, :] > col[None, :, None] - window)

    in_block = real & (last > col[None])
    none = kv_len + 1
    start = col[None].expand(batch, q_len)
    if window:
        first = torch.where(m, ar, kv_len).amin(2)
        start = torch.where(first <= col[None] - window, first, start)
    starts = torch.full((batch, kv_len + 2), none, dtype=torch.long, device=device)
    end = torch.where(in_block, last + 1, kv_len + 1)
    starts.scatter_reduce_(1, end, torch.where(in_block, start, none), reduce="amin")
    starts[:, kv_len + 1] = none
    has = starts[:, : kv_len + 1] < none  # [batch, kv_len + 1]: a block ends before column e
    count = has.sum(1).amax() if batch else torch.zeros((), dtype=torch.long, device=device)
    # the block of each column: the first block end after it, if that block starts at or before it
    ends = torch.where(has, torch.arange(kv_len + 1, device=device), none)[:, 1:]
    next_end = ends.flip(1).cummin(1).values.flip(1)  # [batch, kv_len]
    block_start = starts.gather(1, next_end)
    label = torch.where((next_end < none) & (block_start <= ar), next_end, -1)  # [batch, kv_len]
    cover = torch.zeros((batch, kv_len + 2), dtype=torch.long, device=device)
    cover.scatter_add_(1, starts[:, : kv_len + 1].clamp(max=kv_len + 1), has.long())
    cover[:, 1: kv_len + 1] -= has[:, 1:].long()
    ok = cover[:, :kv_len].cumsum(1).le(1).all()  # blocks do not overlap
    q_label = label.gather(1, col.clamp(0, max(kv_len - 1, 0))[None].expand(batch, q_len))
    same = (q_label[..., None] == label[:, None, :]) & (label[:, None, :] >= 0)
    expect = expect | (same & key_valid[:, None, :])
    return col, real, expect, (starts, count), ok


def _compact_ranges(starts: torch.Tensor, lo: torch.Tensor, count: int) -> torch.Tensor:
    """``[batch, count, 2]`` int32 ranges (positions from each row's first key; (0, 0) pads)."""
    batch, width = starts.shape
    none = width - 1
    ends = torch.where(starts[:, : width - 1] < none, torch.arange(width - 1, device=starts.device), none)
    ends = ends.sort(1).values[:, :count]
    valid = ends < none
    begin = starts.gather(1, ends)
    return torch.stack([torch.where(valid, begin - lo[:, None], 0), torch.where(valid, ends - lo[:, None], 0)],
                       -1).to(torch.int32)


def prefix_ranges_from_token_type_ids(token_type_ids: torch.Tensor,
                                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Image blocks of ``token_type_ids`` as ``prefix_ranges`` of a paged call.

    A block is a run of consecutive tokens of type 1 (Gemma 3's rule: its tokens see each other
    both ways, and earlier blocks causally). The attention function reads the same ranges from
    the mask transformers builds (it is handed no token types); this gives them directly, for a
    caller that builds its own paged call.

    Parameters
    ----------
    token_type_ids : ``[batch, seq_len]`` int; 1 marks an image token.
    attention_mask : ``[batch, seq_len]`` 0/1, optional
        Padding; positions count from each row's first real token (as the integration pages
        each row from its first real key). Padded tokens belong to no block.

    Returns
    -------
    ``[batch, R, 2]`` int32 half-open position ranges, R the most blocks of any row; rows with
    fewer blocks end in (0, 0).
    """
    if token_type_ids.dim() != 2:
        raise ValueError(f"token_type_ids: expected [batch, seq_len], got {list(token_type_ids.shape)}")
    image = token_type_ids == 1
    lo = torch.zeros(image.shape[0], dtype=torch.long, device=image.device)
    if attention_mask is not None:
        if attention_mask.shape != token_type_ids.shape:
            raise ValueError(f"attention_mask: expected shape {list(token_type_ids.shape)}, "
                             f"got {list(attention_mask.shape)}")
        real = attention_mask.bool()
        image = image & real
        seq = torch.arange(image.shape[1], device=image.device)
        lo = torch.where(real, seq, image.shape[1]).amin(1).clamp(max=image.shape[1])
    prev = torch.nn.functional.pad(image, (1, 0))[:, :-1]
    nxt = torch.nn.functional.pad(image, (0, 1))[:, 1:]
    starts, ends = image & ~prev, image & ~nxt
    count = int(starts.sum(1).amax()) if image.numel() else 0
    seq = torch.arange(image.shape[1], device=image.device)
    none = image.shape[1]
    start_col = torch.where(starts, seq, none).sort(1).values[:, :count]
    end_col = torch.where(ends, seq + 1, none).sort(1).values[:, :count]
    valid = start_col < none
    return torch.stack([torch.where(valid, start_col - lo[:, None], 0), torch.where(valid, end_col - lo[:, None], 0)],
                       -1).to(torch.int32)


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

    Raises
    ------
    RuntimeError
        Grad mode is on and query, key, value or the sinks require grad (no backward pass).
    ValueError
        ``dropout > 0``, ``output_attentions=True``, a ``position_bias``, or a mask that a paged
        call cannot express.
    """
    from pagedattn.api import paged_attention

    _refuse_training_and_weights(module, query, key, value, dropout, kwargs)
    if kwargs.get("position_bias") is not None:
        raise ValueError("pagedattn cannot add a position_bias (T5-style); use attn_implementation='sdpa'")
    if not isinstance(attention_mask, (torch.Tensor, type(None))):
        raise TypeError(f"attention_mask: pagedattn takes a tensor mask or None, got {type(attention_mask).__name__}")
    batch, num_q_heads, q_len, head_dim = query.shape
    _, num_kv_heads, kv_len, _ = key.shape
    if value.shape[-1] != head_dim:
        raise ValueError(f"value head_dim {value.shape[-1]} differs from query head_dim {head_dim}")

    causal, window, softcap, sinks = _layer_features(module, kwargs, num_q_heads, query.device)
    if q_len == 0 or batch == 0:
        return query.new_zeros(batch, q_len, num_q_heads, head_dim), None
    if attention_mask is None and kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None:
        return varlen_attention_forward(query, key, value, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"],
                                        max_length_q=kwargs.get("max_length_q"), scaling=scaling, causal=causal,
                                        window=window, softcap=softcap, sinks=sinks)

    if attention_mask is None:
        layout = _layout_without_mask(batch, q_len, kv_len, causal, window, query.device)
    else:
        layout = _layout_from_mask(attention_mask, batch, q_len, kv_len, causal, window, query.device)
    q = query.transpose(1, 2).reshape(batch * q_len, num_q_heads, head_dim)
    # validate=False: the layout is built here, and a padded row's queries outnumber its keys on
    # purpose (they see none; real_rows zeroes them)
    out = paged_attention(
        q, _paged(key, layout), _paged(value, layout), layout.block_table, layout.seq_lens,
        layout.query_start_loc, max_query_len=q_len, max_seq_len=layout.max_seq_len, scale=scaling,
        causal=layout.causal, sliding_window=layout.window, softcap=softcap or None, sinks=sinks,
        prefix_ranges=layout.prefix_ranges, validate=False,
    ).view(batch, q_len, num_q_heads, head_dim)
    if layout.real_rows is not None:
        out = out * layout.real_rows[..., None, None].to(out.dtype)
    return out, None


def _refuse_training_and_weights(module, query, key, value, dropout, kwargs) -> None:
    """Raise for what the kernels cannot give: gradients, attention dropout, attention weights."""
    sinks = kwargs.get("s_aux")
    _refuse_grad(query, key, value, getattr(module, "sinks", None) if sinks is None else sinks)
    if dropout:
        raise ValueError(f"pagedattn has no attention dropout (got dropout={dropout}); call model.eval()")
    if kwargs.get("output_attentions") or _weights_requested():
        raise ValueError(
            "output_attentions=True: attn_implementation='pagedattn' does not form the attention weights; "
            "use attn_implementation='eager' to get them"
        )


def _refuse_grad(query, key, value, sinks) -> None:
    """The kernels have no backward pass: with grad mode on, a query, key, value or sinks tensor
    that requires grad would get a gradient that skips attention, so the call raises instead."""
    if not torch.is_grad_enabled():
        return
    needs = [name for name, t in (("query", query), ("key", key), ("value", value), ("sinks", sinks))
             if isinstance(t, torch.Tensor) and t.requires_grad]
    if needs:
        raise RuntimeError(
            f"attn_implementation='pagedattn' is an inference kernel with no backward pass, but "
            f"{', '.join(needs)} require{'s' if len(needs) == 1 else ''} grad: run the model under "
            "torch.no_grad() or torch.inference_mode() (after model.eval()), or train with "
            "attn_implementation='sdpa' or 'eager' (model.set_attn_implementation('sdpa'))"
        )


def _weights_requested() -> bool:
    """Whether transformers' output capture is collecting attention weights for this forward
    (``output_attentions=True`` as an argument or in the config)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return False
    collected = _active_collector.get()
    return bool(collected) and any(k.endswith("attentions") for k in collected)


def _layer_features(module, kwargs: dict, num_q_heads: int, device):
    """(causal, window, softcap, sinks) of one layer's call, from its keywords or the module."""
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    causal = bool(causal)
    # transformers hands attention functions flash-attention's window: W keys back (the query's own
    # included) when causal, |q - k| < W when not (ModernBERT passes its half-width + 1, bidirectional
    # Gemma 3 its window): the same W as paged_attention's sliding_window, so it passes unchanged.
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None)) or None
    if window is not None:
        window = int(window)
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

    _refuse_grad(query, key, value, sinks)
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


_hint_when_unregistered()
