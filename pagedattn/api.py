"""The typed public functions: validate inputs (naming the argument), then launch."""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from pagedattn._checks import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    check_head_size,
    check_optional_int,
    check_runs_on,
    check_scale_arg,
    check_shape,
    check_tensor,
    interpreted,
    refuse_autograd,
)
from pagedattn._streams import side_stream
from pagedattn.call import Features, PagedShapes, check_cache_pair, check_out, check_paged_inputs, lse_buffer
from pagedattn.conversions import rounded_into, scale_tensor
from pagedattn.ops.common.device import interpreter_on
from pagedattn.ops.common.launching import Tapes, call_context, scalar_or_tensor, wait_stream
from pagedattn.ops.kv_write.kernel import write_kv_kernel
from pagedattn.ops.kv_write.launch import launch_write_kv
from pagedattn.ops.merge.launch import launch_merge_states
from pagedattn.ops.persistent.launch import launch_persistent
from pagedattn.ops.prefill.launch import check_prefill_grid, launch_prefill
from pagedattn.ops.prefill_gluon.launch import gluon_prefill_requested, launch_prefill_gluon, use_gluon_prefill
from pagedattn.ops.split_kv.launch import launch_split_kv
from pagedattn.ops.unified.launch import AttentionArgs, launch_unified
from pagedattn.ops.prefill.tuning import autotune_enabled
from pagedattn.ops.common.target import target_props
from pagedattn.plan import AttentionPlan, fitted, num_sms, pick_prefill_tiles, pick_tiles, plan_for_call, short_prefill
from pagedattn.validate import validate_metadata, validation_requested

__all__ = ["paged_attention", "varlen_attention", "write_kv", "merge_attention_states"]


_INTERPRETED = interpreted(write_kv_kernel)  # the kernels were made for Triton's interpreter


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
    plan: AttentionPlan | None = None,
    validate: bool | None = None,
    allow_shared_blocks: bool = False,
):
    """Attention of a mixed batch (prefill, extend, decode) over a paged KV cache.

    Query j of sequence s (0-based among its new tokens) sits at position
    ``seq_lens[s] - query_len_s + j``; keys run over positions ``0 .. seq_lens[s] - 1``. The new
    tokens' K/V must already be in the cache (see :func:`write_kv`).

    Parameters
    ----------
    q : ``[num_tokens, num_q_heads, head_size]`` float16, bfloat16 or float32
        New query tokens of all sequences, back to back.
    k_cache, v_cache : ``[num_blocks, block_size, num_kv_heads, head_size]``
        q's dtype, or float8_e4m3fn (then ``K = k_cache * k_scale``).
    block_table : ``[num_seqs, max_blocks_per_seq]`` int32
        Logical block i of sequence s lives in physical block ``block_table[s, i]``.
    seq_lens : ``[num_seqs]`` int32
        KV length of each sequence, new tokens included.
    query_start_loc : ``[num_seqs + 1]`` int32
        Cumulative query counts; sequence s owns ``q[query_start_loc[s]:query_start_loc[s+1]]``.
    max_query_len, max_seq_len : int, optional
        Host-side maxima. With ``max_query_len`` given the call never synchronizes with the host.
    scale : float, optional
        Score scale; default ``1 / sqrt(head_size)``.
    causal : bool
        ``True``: key k visible to query at p when k <= p. ``False``: every key (encoders, cross
        attention; query_len may then exceed seq_len).
    sliding_window : int, optional
        Additionally ``p - W < k`` (and ``k < p + W`` when not causal).
    softcap : float, optional
        ``s = softcap * tanh(s / softcap)`` before biases and masks; 0 or None disables it.
    alibi_slopes : ``[num_q_heads]`` float32, optional
        ``s += slope_h * (k - p)``; with ``alibi_sqrt=True`` instead ``s -= slope_h * sqrt(p - k)``
        for k <= p.
    sinks : ``[num_q_heads]`` float32, optional
        Per-head logit that joins the softmax denominator with no value vector.
    prefix_ranges : ``[num_seqs, R, 2]`` int32, optional
        Half-open position ranges; p and k in one range are visible to each other regardless of
        the causal and window rules. Rows with start >= end are padding.
    k_scale, v_scale : float or 1-element float32 tensor, optional
        Dequantization scales of an fp8 cache (default 1.0; ignored for other caches).
    out : ``[num_tokens, num_q_heads, head_size]`` q's dtype, optional
        Written in place and returned.
    return_lse : bool
        Also return lse ``[num_tokens, num_q_heads]`` float32 (natural log, sink included; -inf
        for a row that sees no key, whose output is 0).
    lse_out : Tensor, optional
        ``[num_tokens, num_q_heads]`` float32 to write the lse into (implies ``return_lse``); with
        ``out=`` and ``plan=`` the call then allocates nothing (for CUDA-graph capture).
    plan : AttentionPlan, optional
        From :func:`pagedattn.plan_attention` for this step: fixes the path (unified,
        split-KV or persistent), the tiles and owns the workspaces, so the call allocates nothing but ``out``
        / ``lse`` when they are not given, and never synchronizes. Without a plan the path is
        chosen by the same rule from ``max_query_len`` / ``max_seq_len`` and the split-KV
        workspace is allocated per call.
    validate : bool, optional
        Check the metadata first (:func:`pagedattn.validate_metadata`; one host sync) and raise
        ValueError naming the sequence and index of a bad entry. Default (None): on for CPU
        tensors (the interpreter), off on a GPU; also on for every call with
        ``PAGEDATTN_VALIDATE=1``. Without it, bad block ids or lengths are masked in the kernel
        (never read out of bounds) but not reported.
    allow_shared_blocks : bool
        With ``validate=True`` or ``PAGEDATTN_VALIDATE=1``: whether a block may appear in two
        sequences (prefix caching). The default check on CPU tensors allows it.

    Returns
    -------
    out, or ``(out, lse)`` when ``return_lse``.

    Notes
    -----
    Streams: a batch with sequences of at least PREFILL_MIN_QUERY_LEN queries and shorter ones
    runs the short ones on a second stream of the device beside the prefill kernel (CUDA only;
    ``PAGEDATTN_OVERLAP=0`` turns it off). The second stream first waits for the caller's
    current stream, and the caller's stream waits for it before the call returns: work queued
    after the call sees the output, and a CUDA-graph capture records two parallel branches.

    Examples
    --------
    >>> out = paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
    ...                       max_query_len=1, max_seq_len=4096)
    """
    plan_given = plan is not None
    key = None
    if (isinstance(q, torch.Tensor) and q.is_cuda and q.dim() == 3 and (isinstance(plan, AttentionPlan) or (
            plan is None and max_query_len is not None and max_seq_len is not None))
            and not validation_requested(validate)):
        # The thin path: a call whose scalars and tensor layouts match a call that passed every
        # check below replays that call's launches (pagedattn.ops.common.launching), skipping the
        # checks and the launchers.
        key = (return_lse, max_query_len, max_seq_len, scale, causal, sliding_window, softcap, alibi_sqrt,
               scalar_or_tensor(k_scale), scalar_or_tensor(v_scale), gluon_prefill_requested(), *call_context(q))
        tapes = plan._tapes if plan_given else _CALL_TAPES
        if key in tapes:
            if out is None:
                out = torch.empty_like(q)
            lse = lse_out
            if lse is None and return_lse:
                lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
            if tapes.replay(key, (q, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, lse, alibi_slopes,
                                  sinks, prefix_ranges, k_scale if isinstance(k_scale, torch.Tensor) else None,
                                  v_scale if isinstance(v_scale, torch.Tensor) else None)):
                return out if lse is None else (out, lse)

    features = Features(scale, causal, sliding_window, softcap, alibi_sqrt, alibi_slopes, sinks, prefix_ranges)
    shapes = check_paged_inputs("paged_attention", q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                                fp8_cache=True, interpreted=_INTERPRETED)
    device = q.device
    check_optional_int("max_query_len", max_query_len, minimum=0)
    check_optional_int("max_seq_len", max_seq_len, minimum=0)
    features.check(num_q_heads=shapes.num_q_heads, num_seqs=shapes.num_seqs, device=device)
    check_scale_arg("k_scale", k_scale, device)
    check_scale_arg("v_scale", v_scale, device)
    check_out(out, q.dtype, device, tuple(q.shape))
    if validation_requested(validate, device):
        # the CPU's default check (neither validate=True nor PAGEDATTN_VALIDATE=1) lets prefix caching share blocks
        cpu_default = validate is None and not validation_requested(False)
        validate_metadata(
            block_table, seq_lens, query_start_loc, num_tokens=shapes.num_tokens, num_blocks=shapes.num_blocks,
            block_size=shapes.block_size, causal=causal, allow_shared_blocks=allow_shared_blocks or cpu_default,
        )
    if q.dtype == torch.bfloat16 and interpreter_on():
        # The interpreter's bf16 tl.dot multiplies bit patterns: compute in fp32 and round once.
        fp32 = [x if x.dtype in FP8_DTYPES else x.float() for x in (q, k_cache, v_cache)]
        res = paged_attention(*fp32, block_table, seq_lens, query_start_loc, max_query_len=max_query_len,
                              max_seq_len=max_seq_len, k_scale=k_scale, v_scale=v_scale, lse_out=lse_out,
                              return_lse=return_lse, plan=plan, validate=False, **features.kwargs())
        return rounded_into(res, out, q)
    plan = _call_plan(plan, q, k_cache, block_table, seq_lens, query_start_loc, shapes, max_query_len, max_seq_len,
                      sliding_window)
    if out is None:
        out = torch.empty_like(q)
    lse = lse_buffer(lse_out, return_lse, shapes.num_tokens, shapes.num_q_heads, device)
    fp8 = k_cache.dtype in FP8_DTYPES
    args = AttentionArgs(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens,
                         query_start_loc=query_start_loc, k_scale=scale_tensor(k_scale, device) if fp8 else None,
                         v_scale=scale_tensor(v_scale, device) if fp8 else None,
                         **features.kernel_fields(shapes.head_size))
    if key is None or (plan.path == "prefill" and autotune_enabled(device)):
        _RUN_PATH[plan.path](out, lse, args, plan)
    else:  # recorded, so that the next call with this layout replays it (the thin path above)
        binds = (q, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, lse, alibi_slopes, sinks,
                 prefix_ranges, k_scale if isinstance(k_scale, torch.Tensor) else None,
                 v_scale if isinstance(v_scale, torch.Tensor) else None)
        (plan._tapes if plan_given else _CALL_TAPES).record(key, binds, lambda: _RUN_PATH[plan.path](out, lse, args, plan))
    return out if lse is None else (out, lse)


def _call_plan(plan, q, k_cache, block_table, seq_lens, query_start_loc, shapes: PagedShapes, max_query_len,
               max_seq_len, sliding_window) -> AttentionPlan:
    """The plan a checked call runs: its own (checked against the call), else the plan-less rule's
    from the host maxima (one host sync for each maximum not given)."""
    if plan is not None:
        _check_plan(plan, q, k_cache, seq_lens)
        return plan
    if max_query_len is None:
        lens = query_start_loc[1:] - query_start_loc[:-1]
        max_query_len = int(lens.max().item()) if shapes.num_seqs > 0 else 0
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if shapes.num_seqs > 0 else 0
    return plan_for_call(shapes.num_seqs, shapes.num_tokens, max_query_len, max_seq_len,
                         num_q_heads=shapes.num_q_heads, num_kv_heads=shapes.num_kv_heads,
                         head_size=shapes.head_size, dtype=q.dtype, device=q.device, sliding_window=sliding_window)


_CALL_TAPES = Tapes()  # for calls without a plan (a plan holds its own)


def _run_unified(out, lse, args: AttentionArgs, plan: AttentionPlan) -> None:
    launch_unified(out, lse, args, plan.tiles)


def _run_split_kv(out, lse, args: AttentionArgs, plan: AttentionPlan) -> None:
    launch_split_kv(out, lse, args, plan.tiles, num_splits=plan.num_splits, segment_size=plan.segment_size,
                    partial_out=plan.partial_out, partial_lse=plan.partial_lse)


def _run_persistent(out, lse, args: AttentionArgs, plan: AttentionPlan) -> None:
    launch_persistent(out, lse, args, plan)


def _run_prefill(out, lse, args: AttentionArgs, plan: AttentionPlan) -> None:
    _launch_prefill_and_rest(out, lse, args, plan.prefill_tiles, plan.max_query_len, plan.prefill_min_q_len,
                             plan.rest_max_query_len, plan.prefill_seqs)


_RUN_PATH = {"unified": _run_unified, "split_kv": _run_split_kv, "persistent": _run_persistent,
             "prefill": _run_prefill}


def _launch_prefill_and_rest(out, lse, args: AttentionArgs, prefill_tiles, max_query_len: int, min_q_len: int,
                             rest_max_q_len: int | None = None, prefill_seqs: tuple[int, int] | None = None):
    """Sequences with >= min_q_len queries: the large-tile kernel; the others (at most
    rest_max_q_len queries, < min_q_len; 0: none; None: min_q_len - 1) the unified kernel, with
    tiles for that length.

    ``prefill_seqs`` (a plan's): the sequences [first, end) that hold every long one. The
    large-tile kernel's grid then covers those sequences only (from an offset into the
    metadata), with no programs for the sequences around them: each such program would hold a whole SM's shared memory only to
    exit, and a 2048-token prefill among 63 decodes launched 32256 of them.

    On a CUDA device the unified launch runs on a second stream beside the prefill kernel (the
    caller's stream waits for both before anything after the call): its programs fill the SMs
    that the causal triangle's last wave leaves idle. A 2048-token prefill among 63 decodes measured
    286 -> 249 us on the H200. ``PAGEDATTN_OVERLAP=0`` launches both on the caller's
    stream. A CUDA-graph capture records the two streams as parallel branches."""
    num_seqs = args.seq_lens.shape[0]
    first, end = (0, num_seqs) if prefill_seqs is None else prefill_seqs
    if args.k_cache.dtype in FP8_DTYPES:  # a plan's tiles know q's dtype, not the cache's
        prefill_tiles = fitted(prefill_tiles, target_props(args.q.device), args.q.shape[2], args.q.dtype,
                               args.k_cache.dtype)
    check_prefill_grid(max_query_len, end - first, prefill_tiles)
    prefill = functools.partial(launch_prefill, out, lse, args, prefill_tiles, max_query_len=max_query_len,
                                min_q_len=min_q_len, seqs=(first, end))
    # the sm90 kernel, where it serves and pays
    gluon = use_gluon_prefill(args, max_query_len)
    if gluon is not None:
        prefill = functools.partial(launch_prefill_gluon, out, lse, args, config=gluon, max_query_len=max_query_len,
                                    min_q_len=min_q_len, seqs=(first, end))
    rest_max_q_len = min_q_len - 1 if rest_max_q_len is None else min(rest_max_q_len, min_q_len - 1)
    if rest_max_q_len <= 0:
        prefill()
        return
    group = args.q.shape[1] // args.k_cache.shape[2]
    rest_args = dataclasses.replace(args, max_q_len_served=rest_max_q_len)
    rest_tiles = fitted(pick_tiles(rest_max_q_len, group, args.q.shape[2]), target_props(args.q.device),
                        args.q.shape[2], args.q.dtype)
    side = side_stream(args.q.device) if end > first else None
    if side is None:
        prefill()
        launch_unified(out, lse, rest_args, rest_tiles)
        return
    caller = torch.cuda.current_stream(args.q.device)
    wait_stream(side, caller)
    try:  # joined even if a launch raises: no kernel left writing into buffers the caller frees
        with torch.cuda.stream(side):
            launch_unified(out, lse, rest_args, rest_tiles)
        prefill()
    finally:
        wait_stream(caller, side)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    max_query_len: int | None = None,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    alibi_sqrt: bool = False,
    sinks: torch.Tensor | None = None,
    prefix_ranges: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    lse_out: torch.Tensor | None = None,
):
    """Attention over contiguous K/V of several sequences (prefill; also what an encoder calls).

    Sequence s owns queries ``q[cu_seqlens_q[s]:cu_seqlens_q[s+1]]`` and keys/values
    ``k[cu_seqlens_k[s]:cu_seqlens_k[s+1]]``; its queries are its last tokens (query j sits at
    position ``kv_len_s - q_len_s + j``), so the features mean what they mean in
    :func:`paged_attention`. Runs the large-tile kernel.

    Parameters
    ----------
    q : ``[num_tokens, num_q_heads, head_size]`` float16, bfloat16 or float32
    k : ``[total_kv_tokens, num_kv_heads, head_size]`` q's dtype
    v : ``[total_kv_tokens, num_kv_heads, head_size_v]`` q's dtype; ``head_size_v`` may differ
        from ``head_size`` (MLA prefill after decompression: 192 and 128). ``out`` is then
        ``[num_tokens, num_q_heads, head_size_v]``.
    cu_seqlens_q, cu_seqlens_k : ``[num_seqs + 1]`` int32
    max_query_len : int, optional
        Host maximum of the query lengths (else computed with one host sync).
    scale, causal, sliding_window, softcap, alibi_slopes, alibi_sqrt, sinks, prefix_ranges, out,
    return_lse, lse_out : as in :func:`paged_attention`.

    Returns
    -------
    out, or ``(out, lse)`` when ``return_lse``.

    Examples
    --------
    >>> out = varlen_attention(q, k, v, cu_q, cu_k, max_query_len=2048, causal=True)
    """
    key = None
    if isinstance(q, torch.Tensor) and q.is_cuda and q.dim() == 3 and max_query_len is not None:
        # The thin path, as in paged_attention: a layout that passed the checks below replays its launch.
        key = (return_lse, max_query_len, scale, causal, sliding_window, softcap, alibi_sqrt,
               os.environ.get("PAGEDATTN_TMA", ""), *call_context(q))
        if key in _VARLEN_TAPES and isinstance(v, torch.Tensor) and v.dim() == 3:
            if out is None:
                out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
            lse = lse_out
            if lse is None and return_lse:
                lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
            if _VARLEN_TAPES.replay(key, (q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, alibi_slopes, sinks,
                                          prefix_ranges)):
                return (out, lse) if return_lse or lse_out is not None else out
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_runs_on("q", q, _INTERPRETED)
    device = q.device
    num_tokens, num_q_heads, head_size = q.shape
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=device)
    check_tensor("v", v, ndim=3, dtypes=(q.dtype,), device=device)
    refuse_autograd("varlen_attention", q=q, k=k, v=v)
    check_head_size("q", head_size)
    if k.shape[2] != head_size:
        raise ValueError(f"k head_size {k.shape[2]} differs from q head_size {head_size}")
    head_size_v = v.shape[2]  # may differ from head_size (MLA prefill: q/k 192, v 128)
    check_shape("v", v, (k.shape[0], k.shape[1], head_size_v))
    check_head_size("v", head_size_v)
    num_kv_heads = k.shape[1]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"q has {num_q_heads} heads, which is not a multiple of k's {num_kv_heads} KV heads")
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,), device=device)
    check_tensor("cu_seqlens_k", cu_seqlens_k, ndim=1, dtypes=(torch.int32,), device=device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    check_shape("cu_seqlens_k", cu_seqlens_k, (num_seqs + 1,))
    check_optional_int("max_query_len", max_query_len, minimum=0)
    features = Features(scale, causal, sliding_window, softcap, alibi_sqrt, alibi_slopes, sinks, prefix_ranges)
    features.check(num_q_heads=num_q_heads, num_seqs=num_seqs, device=device)
    check_out(out, q.dtype, device, (num_tokens, num_q_heads, head_size_v))
    if max_query_len is None:
        lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        max_query_len = int(lens.max().item()) if num_seqs > 0 else 0
    if q.dtype == torch.bfloat16 and interpreter_on():
        # The interpreter's bf16 tl.dot multiplies bit patterns: compute in fp32 and round once.
        res = varlen_attention(q.float(), k.float(), v.float(), cu_seqlens_q, cu_seqlens_k, max_query_len=max_query_len,
                               lse_out=lse_out, return_lse=return_lse, **features.kwargs())
        return rounded_into(res, out, q)
    if out is None:
        out = q.new_empty(num_tokens, num_q_heads, head_size_v)
    lse = lse_buffer(lse_out, return_lse, num_tokens, num_q_heads, device)
    args = AttentionArgs(q=q, k_cache=k, v_cache=v, block_table=None, seq_lens=None, query_start_loc=cu_seqlens_q,
                         k_scale=None, v_scale=None, **features.kernel_fields(head_size))
    # at most twice as many keys as queries in all: the causal diagonal dominates (no host sync)
    short = short_prefill(max_query_len, num_seqs, num_q_heads, num_sms(device), diagonal=k.shape[0] <= 2 * num_tokens)
    tiles = fitted(pick_prefill_tiles(max(head_size, head_size_v), q.dtype, short=short), target_props(device),
                   max(head_size, head_size_v), q.dtype)
    check_prefill_grid(max_query_len, num_seqs, tiles)
    if key is None or autotune_enabled(device):
        launch_prefill(out, lse, args, tiles, max_query_len=max_query_len, cu_seqlens_k=cu_seqlens_k)
    else:
        _VARLEN_TAPES.record(key, (q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, alibi_slopes, sinks, prefix_ranges),
                             lambda: launch_prefill(out, lse, args, tiles, max_query_len=max_query_len,
                                                    cu_seqlens_k=cu_seqlens_k))
    return out if lse is None else (out, lse)


_VARLEN_TAPES = Tapes()
_WRITE_TAPES = Tapes()


def _check_plan(plan, q: torch.Tensor, k_cache: torch.Tensor, seq_lens: torch.Tensor) -> None:
    if not isinstance(plan, AttentionPlan):
        raise TypeError(f"plan must be an AttentionPlan from plan_attention, got {type(plan).__name__}")
    num_tokens, num_q_heads, head_size = q.shape
    if (plan.num_q_heads, plan.num_kv_heads, plan.head_size) != (num_q_heads, k_cache.shape[2], head_size):
        raise ValueError(
            f"plan was made for (num_q_heads, num_kv_heads, head_size) = "
            f"{(plan.num_q_heads, plan.num_kv_heads, plan.head_size)}, but q and k_cache give "
            f"{(num_q_heads, k_cache.shape[2], head_size)}"
        )
    if num_tokens > plan.max_num_tokens:
        raise ValueError(f"plan holds workspaces for {plan.max_num_tokens} tokens; q has {num_tokens}")
    # A persistent plan's work list and a prefill plan's sequence range address the tokens and
    # sequences the plan was made (or last updated) for: a call with fewer would have the
    # kernels write rows it does not have. (The unified and split-KV grids come from the call's
    # own shapes: their plans fix only tiles, splits and workspaces.)
    if plan.path in ("persistent", "prefill"):
        if num_tokens < plan.num_tokens:
            raise ValueError(f"q has {num_tokens} tokens, but the plan was made (or last updated) for a batch of "
                             f"{plan.num_tokens}: plan this call's batch, or plan.update() it")
        num_seqs = seq_lens.shape[0]
        if num_seqs < plan.num_seqs or (plan.path == "prefill" and num_seqs != plan.num_seqs):
            raise ValueError(f"seq_lens has {num_seqs} sequences, but the plan was made (or last updated) for "
                             f"{plan.num_seqs}: plan this call's batch, or plan.update() it")
    if plan.partial_out is not None and plan.partial_out.device != q.device:
        raise ValueError(f"plan workspaces are on {plan.partial_out.device} but q is on {q.device}")


def merge_attention_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets into attention over their union.

    ``out = (e^{lse_a} out_a + e^{lse_b} out_b) / (e^{lse_a} + e^{lse_b})`` and
    ``lse = log(e^{lse_a} + e^{lse_b})`` (natural log). A side with lse -inf contributes
    nothing (it is not read); both -inf gives out 0 and lse -inf. A NaN or +inf lse on either
    side gives out NaN and lse NaN, so a chain of merges never hides a corrupted state.

    Parameters
    ----------
    out_a, out_b : ``[num_tokens, num_heads, head_size]`` float16, bfloat16 or float32
    lse_a, lse_b : ``[num_tokens, num_heads]`` float32
    out : ``[num_tokens, num_heads, head_size]`` out_a's dtype, optional (may be out_a itself)
    lse_out : ``[num_tokens, num_heads]`` float32, optional (may be lse_a itself); with ``out``
        the merge allocates nothing.

    Returns
    -------
    (out, lse): lse ``[num_tokens, num_heads]`` float32.

    Examples
    --------
    >>> o1, l1 = paged_attention(q, kc, vc, bt, lens_cached, qsl, causal=False, return_lse=True)
    >>> o, l = merge_attention_states(o1, l1, o2, l2)
    """
    check_tensor("out_a", out_a, ndim=3, dtypes=FLOAT_DTYPES)
    check_runs_on("out_a", out_a, _INTERPRETED)
    device = out_a.device
    check_tensor("out_b", out_b, ndim=3, dtypes=(out_a.dtype,), device=device)
    check_shape("out_b", out_b, tuple(out_a.shape))
    refuse_autograd("merge_attention_states", out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_tensor(name, x, ndim=2, dtypes=(torch.float32,), device=device, last_dim_contiguous=False)
        check_shape(name, x, tuple(out_a.shape[:2]))
    check_out(out, out_a.dtype, device, tuple(out_a.shape))
    num_tokens, num_heads, head_size = out_a.shape
    if out_a.dtype == torch.bfloat16 and interpreter_on():
        # The interpreter's bf16 arithmetic is not IEEE bf16: merge in fp32 and round once.
        res = merge_attention_states(out_a.float(), lse_a, out_b.float(), lse_b, lse_out=lse_out)
        return rounded_into(res, out, out_a)
    if out is None:
        out = torch.empty_like(out_a)
    lse = lse_buffer(lse_out, True, num_tokens, num_heads, device)
    launch_merge_states(out, lse, out_a, lse_a, out_b, lse_b)
    return out, lse


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    validate: bool | None = None,
) -> None:
    """Scatter new tokens' K/V into the paged cache, in place.

    Parameters
    ----------
    key, value : ``[num_tokens, num_kv_heads, head_size]`` float16, bfloat16 or float32
    k_cache, v_cache : ``[num_blocks, block_size, num_kv_heads, head_size]``
        key's dtype, or float8_e4m3fn (then the stored value is ``key / k_scale``, rounded to
        nearest even and saturated at +-448).
    slot_mapping : ``[num_tokens]`` int32 or int64
        ``slot = block * block_size + offset``; a slot of -1 skips the token (padding).
    k_scale, v_scale : float or 1-element float32 tensor, optional
        Quantization scales of an fp8 cache (default 1.0; ignored for other caches).
    validate : bool, optional
        Raise ValueError for a slot outside [-1, num_blocks * block_size) (one host sync).
        Default (None): on for CPU tensors, off on a GPU; also on with ``PAGEDATTN_VALIDATE=1``.
        Without it such slots are skipped.

    Examples
    --------
    >>> write_kv(k_new, v_new, k_cache, v_cache, slot_mapping)
    """
    tape_key = None
    # written out, not a generator over the two scales: 0.25 against 0.7 us a call on a 2-core CPU
    binds = (key, value, k_cache, v_cache, slot_mapping, k_scale if isinstance(k_scale, torch.Tensor) else None,
             v_scale if isinstance(v_scale, torch.Tensor) else None)
    if isinstance(key, torch.Tensor) and key.is_cuda and not validation_requested(validate):
        # The thin path, as in paged_attention: a layout that passed the checks below replays its launch.
        tape_key = (scalar_or_tensor(k_scale), scalar_or_tensor(v_scale), *call_context(key))
        if _WRITE_TAPES.replay(tape_key, binds):
            return
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    check_runs_on("key", key, _INTERPRETED)
    device = key.device
    check_tensor("value", value, ndim=3, dtypes=(key.dtype,), device=device)
    check_shape("value", value, tuple(key.shape))
    check_cache_pair(k_cache, v_cache, key.dtype, device)
    num_tokens, num_kv_heads, head_size = key.shape
    check_head_size("key", head_size)
    check_shape("k_cache", k_cache, (None, None, num_kv_heads, head_size))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int32, torch.int64), device=device)
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_scale_arg("k_scale", k_scale, device)
    check_scale_arg("v_scale", v_scale, device)
    if validation_requested(validate, device):
        validate_metadata(None, None, None, num_tokens=num_tokens, num_blocks=k_cache.shape[0],
                          block_size=k_cache.shape[1], slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    fp8 = k_cache.dtype in FP8_DTYPES
    run = functools.partial(launch_write_kv, key, value, k_cache, v_cache, slot_mapping,
                            scale_tensor(k_scale, device) if fp8 else None,
                            scale_tensor(v_scale, device) if fp8 else None)
    if tape_key is None:
        run()
    else:
        _WRITE_TAPES.record(tape_key, binds, run)
