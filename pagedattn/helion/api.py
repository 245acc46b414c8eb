"""``paged_attention`` through the Helion kernels: the checks, then the launches of a plan."""

from __future__ import annotations

import torch

from pagedattn._checks import FP8_DTYPES, check_optional_int
from pagedattn.call import Features, check_out, check_paged_inputs, lse_buffer
from pagedattn.helion import configs
from pagedattn.validate import validate_metadata, validation_requested
from pagedattn.helion.kernels import NO_LIMIT, kernel
from pagedattn.helion.plan import HelionPlan, plan_attention

__all__ = ["paged_attention", "UNSUPPORTED", "use_reference_mode"]

# The keyword features left to the Triton path (pagedattn.paged_attention), with why.
UNSUPPORTED = {
    "alibi_slopes": "ALiBi biases are not implemented in the Helion kernels",
    "sinks": "attention sinks are not implemented in the Helion kernels",
    "prefix_ranges": "bidirectional prefix ranges are not implemented in the Helion kernels",
}


def use_reference_mode(device: torch.device) -> bool:
    """Whether the kernels run in Helion's reference mode (eager PyTorch): on the CPU, where
    Triton has no compiled target."""
    return device.type == "cpu"


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    alibi_sqrt: bool = False,
    sinks: torch.Tensor | None = None,
    prefix_ranges: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    lse_out: torch.Tensor | None = None,
    plan: HelionPlan | None = None,
    validate: bool = False,
    allow_shared_blocks: bool = False,
):
    """:func:`pagedattn.paged_attention` in Helion: the same arguments and results (docs/contract.md).

    Decode and short queries (under 16 a sequence) run a split-KV kernel over KV segments plus
    a merge of the partial states; longer queries a prefill kernel over 128-query chunks. Both
    read pagedattn's cache layout through the block table.

    Parameters
    ----------
    q : ``[num_tokens, num_q_heads, head_size]`` float16, bfloat16 or float32
    k_cache, v_cache : ``[num_blocks, block_size, num_kv_heads, head_size]``, q's dtype
    block_table : ``[num_seqs, max_blocks_per_seq]`` int32
    seq_lens : ``[num_seqs]`` int32, keys of each sequence including its new tokens
    query_start_loc : ``[num_seqs + 1]`` int32
    scale, causal, sliding_window, softcap, out, return_lse, lse_out, validate, allow_shared_blocks :
        as in :func:`pagedattn.paged_attention`.
    plan : HelionPlan, optional
        From :func:`pagedattn.helion.plan_attention` for this step. A plan made for
        ``causal=True`` serves causal calls only; one made with ``sliding_window=W`` serves
        calls with a window of at most W (those see the keys its segments cover). Without it
        the call plans from host copies of the metadata: one synchronization.
    max_query_len, max_seq_len : accepted for the same signature; the plan carries what they say.

    Raises
    ------
    ValueError
        For ``alibi_slopes``, ``sinks``, ``prefix_ranges`` and an fp8 cache (``k_cache`` dtype),
        which only the Triton path implements, and for every check ``pagedattn.paged_attention`` makes.

    Examples
    --------
    >>> plan = pagedattn.helion.plan_attention(qsl_host, lens_host, num_q_heads=32, num_kv_heads=8, head_size=128)
    >>> out, lse = pagedattn.helion.paged_attention(q, k_cache, v_cache, block_table, seq_lens, qsl,
    ...                                              plan=plan, return_lse=True)
    """
    if isinstance(k_cache, torch.Tensor) and k_cache.dtype in FP8_DTYPES:
        raise ValueError("k_cache: an fp8 cache (k_scale / v_scale) is not implemented in the Helion kernels; "
                         "use pagedattn.paged_attention")
    # Helion runs its kernels in its own reference mode on the CPU, so CPU tensors always run
    shapes = check_paged_inputs("pagedattn.helion.paged_attention", q, k_cache, v_cache, block_table, seq_lens,
                                query_start_loc, fp8_cache=False, interpreted=True)
    device = q.device
    num_tokens, num_q_heads, head_size = shapes.num_tokens, shapes.num_q_heads, shapes.head_size
    num_blocks, block_size, num_kv_heads, num_seqs = (shapes.num_blocks, shapes.block_size, shapes.num_kv_heads,
                                                      shapes.num_seqs)
    if block_size & (block_size - 1):
        raise ValueError(f"k_cache block_size (dim 1) must be a power of two for the Helion kernels, got {block_size}")
    check_optional_int("max_query_len", max_query_len, minimum=0)
    check_optional_int("max_seq_len", max_seq_len, minimum=0)
    features = Features(scale, causal, sliding_window, softcap, alibi_sqrt, alibi_slopes, sinks, prefix_ranges)
    features.check(num_q_heads=num_q_heads, num_seqs=num_seqs, device=device)
    for name, value in (("alibi_slopes", alibi_slopes), ("sinks", sinks), ("prefix_ranges", prefix_ranges)):
        if value is not None:
            raise ValueError(f"{name}: {UNSUPPORTED[name]}; use pagedattn.paged_attention")
    check_out(out, q.dtype, device, tuple(q.shape))
    lse = lse_buffer(lse_out, True, num_tokens, num_q_heads, device)  # the kernels always write an lse
    if validation_requested(validate):
        validate_metadata(block_table, seq_lens, query_start_loc, num_tokens=num_tokens, num_blocks=num_blocks,
                          block_size=block_size, causal=causal, allow_shared_blocks=allow_shared_blocks)
    if plan is None:
        plan = plan_attention(query_start_loc.tolist(), seq_lens.tolist(), num_q_heads=num_q_heads,
                              num_kv_heads=num_kv_heads, head_size=head_size, device=device, causal=causal,
                              sliding_window=sliding_window)
    else:
        _check_plan(plan, num_tokens, num_seqs, num_q_heads, num_kv_heads, head_size, device, causal, sliding_window)

    if out is None:
        out = torch.empty_like(q)
    if num_tokens:
        fields = features.kernel_fields(head_size)
        _launch(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, lse, plan, scale=fields["scale"],
                causal=fields["causal"], sliding_window=fields["sliding_window"], softcap=fields["softcap"])
    return (out, lse) if (return_lse or lse_out is not None) else out


def _check_plan(plan, num_tokens, num_seqs, num_q_heads, num_kv_heads, head_size, device, causal, sliding_window):
    if not isinstance(plan, HelionPlan):
        raise TypeError(f"plan must be a HelionPlan from pagedattn.helion.plan_attention, got {type(plan).__name__}")
    got = (plan.num_tokens, plan.num_seqs, plan.num_q_heads, plan.num_kv_heads, plan.head_size)
    want = (num_tokens, num_seqs, num_q_heads, num_kv_heads, head_size)
    if got != want:
        raise ValueError(f"plan was made for (num_tokens, num_seqs, num_q_heads, num_kv_heads, head_size) = {got}, "
                         f"the call has {want}")
    if plan.device != device:
        raise ValueError(f"plan's workspaces are on {plan.device}, q is on {device}")
    if not _covers(plan.causal, plan.sliding_window, bool(causal), sliding_window):
        raise ValueError(f"plan was made for causal={plan.causal}, sliding_window={plan.sliding_window}; a call with "
                         f"causal={causal}, sliding_window={sliding_window} sees more keys than its decode segments "
                         f"cover (plan with the call's causal and sliding_window, or with none)")


def _covers(plan_causal: bool, plan_window, causal: bool, window) -> bool:
    """Whether a plan's decode segments reach every key a call sees: a query sees the most keys
    without a window and when non-causal, so a plan made without them serves any call."""
    return (causal or not plan_causal) and (not plan_window or (bool(window) and window <= plan_window))


def _launch(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, lse, plan: HelionPlan, *,
            scale: float, causal: bool, sliding_window: int, softcap: float) -> None:
    eager = use_reference_mode(q.device)
    head_size, block_size = q.shape[2], k_cache.shape[1]

    def get(name):
        return kernel(name, eager, None if eager else configs.config_for(name, head_size, block_size))

    left = sliding_window or NO_LIMIT
    right = 1 if causal else (sliding_window or NO_LIMIT)
    use_softcap = softcap > 0
    large = k_cache.numel() >= 2**31
    if plan.prefill_items.shape[0]:
        get("prefill")(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, plan.prefill_items, out, lse,
                       scale, softcap, left, right, use_softcap, large, eager)
    if plan.decode_items.shape[0]:
        group = q.shape[1] // k_cache.shape[2]
        group_pad = max(16, 1 << (group - 1).bit_length())  # tl.dot's smallest M
        get("decode")(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, plan.decode_items,
                      plan.part_out, plan.part_lse, scale, softcap, left, right, plan.segment, group_pad,
                      use_softcap, large, eager)
        get("merge")(plan.part_out, plan.part_lse, plan.decode_tokens, plan.item_start, out, lse)
