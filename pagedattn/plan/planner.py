"""Plans: :func:`plan_attention` for an engine step, :func:`plan_for_graphs` for CUDA graphs,
:func:`plan_for_call` for a call without one.

Each is the path rule (``rule.py``) applied to a batch, with the tiles it needs (``tiles.py``,
``prefill.py``), the persistent work list (``worklist.py``) and the workspaces (``workspace.py``).
"""

from __future__ import annotations

import torch

from pagedattn._streams import side_stream
from pagedattn.ops.common.device import current_stream_handle
from pagedattn.ops.common.target import target_props
from pagedattn.plan.attention_plan import AttentionPlan, PlanSizes, host_list
from pagedattn.plan.prefill import long_sequences, prefill_tiles
from pagedattn.plan.rule import (
    INVARIANT_SEGMENT_TOKENS,
    MIN_SEGMENT_TOKENS,
    PATHS,
    PERSISTENT_UNCAPPED_PROGRAMS_PER_SM,
    PREFILL_MIN_QUERY_LEN,
    RESIDENT_PROGRAMS_PER_SM,
    choose_path,
    invariant_choice,
)
from pagedattn.plan.tiles import batch_tiles, num_sms, persistent_tiles
from pagedattn.plan.worklist import (
    PERSISTENT_MAX_REGISTERS,
    PERSISTENT_MAX_SPLITS,
    PERSISTENT_PROGRAMS_PER_SM,
    SCHEDULES,
    UNEQUAL_MAX_REGISTERS,
    persistent_work_list,
)
from pagedattn.plan.workspace import work_buffers


def plan_attention(
    query_start_loc,
    seq_lens,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    device=None,
    path: str = "auto",
    num_splits: int | None = None,
    batch_invariant: bool = False,
    segment_size: int = INVARIANT_SEGMENT_TOKENS,
    max_num_tokens: int | None = None,
    sliding_window: int | None = None,
    max_num_seqs: int | None = None,
    max_context_len: int | None = None,
    num_programs: int | None = None,
    schedule: str = "auto",
    dtype: torch.dtype = torch.bfloat16,
) -> AttentionPlan:
    """Plan one engine step.

    Parameters
    ----------
    query_start_loc : ``[num_seqs + 1]`` ints (list or host tensor; a device tensor costs a sync)
    seq_lens : ``[num_seqs]`` ints
    num_q_heads, num_kv_heads, head_size : the attention shape of every layer of the step.
    device : where the workspaces live (the kernels' device); default ``"cuda"`` when CUDA is
        available, else ``"cpu"`` (Triton's interpreter).
    path : ``"auto"`` (the rule of :mod:`pagedattn.plan.rule`), ``"unified"``, ``"split_kv"``,
        ``"persistent"`` or ``"prefill"`` (every sequence through the large-tile kernel; under
        ``"auto"`` sequences with >= PREFILL_MIN_QUERY_LEN queries take it and the rest the
        unified kernel, in the same call).
    num_splits : force the split count of the split-KV path.
    batch_invariant : every sequence's output bitwise independent of the rest of the batch:
        the split-KV path with ``segment_size`` keys per split at fixed positions and tiles
        that depend on the head shape only. Workspace: ``num_tokens * num_q_heads *
        ceil(max_seq_len / segment_size) * head_size * 4`` bytes (large for long prefills).
    max_num_tokens : workspace capacity in tokens (default: this batch's token count).
    sliding_window : the layers' window, if any: it bounds the keys a query reads, which the
        split rule uses (correctness never depends on it).
    max_num_seqs, max_context_len : persistent path: the capacity to plan for (defaults: this
        batch), so that :meth:`AttentionPlan.update` can re-plan any batch up to it in place.
    num_programs : persistent path: the fixed grid (default ``PERSISTENT_PROGRAMS_PER_SM * num_sms``,
        three waves of resident programs; the work list is cut for one wave,
        ``min(num_programs, RESIDENT_PROGRAMS_PER_SM * num_sms)`` programs).
    schedule : persistent path: ``"static"`` striding, ``"atomic"`` work counter, or ``"auto"``
        (default): chosen at every ``update()`` from the work list's size, without recapture (the
        kernel reads the choice from the plan's device buffer).
    dtype : q's dtype (the prefill path's tiles depend on it).

    Examples
    --------
    >>> plan = plan_attention([0, 1, 2], [4096, 900], num_q_heads=32, num_kv_heads=8, head_size=128)
    >>> out = paged_attention(q, k_cache, v_cache, block_table, seq_lens, qsl, plan=plan)
    """
    device = _checked_device(path, device, num_q_heads, num_kv_heads)
    qsl, lens, q_lens, sizes = _host_batch(query_start_loc, seq_lens, max_num_tokens)
    heads = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=head_size)
    tiles = batch_tiles(sizes.max_query_len, num_q_heads, num_kv_heads, head_size, dtype, target_props(device),
                        fixed=batch_invariant)
    if batch_invariant:
        choice = invariant_choice(path, segment_size, tiles, sizes.max_seq_len)
    else:
        choice = choose_path(path, num_splits, max_query_len=sizes.max_query_len, max_seq_len=sizes.max_seq_len,
                             num_kv_heads=num_kv_heads, tiles=tiles, sms=num_sms(device),
                             sliding_window=sliding_window, q_lens=q_lens, seq_lens=lens, head_size=head_size)
    if choice.path == "persistent":
        return _plan_persistent(
            qsl, lens, sizes, tiles=tiles, **heads, device=device,
            max_num_seqs=max(len(lens), max_num_seqs or 0),
            max_context_len=max(sizes.max_seq_len, max_context_len or 0), num_programs=num_programs,
            schedule=schedule, sliding_window=sliding_window, fit_splits=path == "auto",
            cap_registers=choice.cap_registers,
        )
    if choice.path == "prefill":
        return _plan_prefill(q_lens, lens, sizes, tiles, auto=path == "auto", **heads, dtype=dtype, device=device)
    return AttentionPlan.create(choice.path, tiles, sizes, **heads, device=device, num_splits=choice.num_splits,
                                segment_size=choice.segment_size, batch_invariant=batch_invariant)


def _checked_device(path: str, device, num_q_heads: int, num_kv_heads: int) -> torch.device:
    """plan_attention's device (default: CUDA when available, else the CPU), after checking
    ``path``, the device and the head counts (ValueError naming the argument)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device} was asked for, but CUDA is not available (use device='cpu' for the interpreter)")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return device


def _host_batch(query_start_loc, seq_lens, max_num_tokens: int | None):
    """(query_start_loc, seq_lens, query lengths) as host lists, and the batch's sizes."""
    qsl = host_list(query_start_loc)
    lens = host_list(seq_lens)
    if len(qsl) != len(lens) + 1:
        raise ValueError(f"query_start_loc has {len(qsl)} entries; expected len(seq_lens) + 1 = {len(lens) + 1}")
    q_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
    num_tokens = qsl[-1] if qsl else 0
    sizes = PlanSizes(num_seqs=len(lens), num_tokens=num_tokens, max_query_len=max(q_lens + [0]),
                      max_seq_len=max(lens + [0]), max_num_tokens=max(num_tokens, max_num_tokens or 0))
    return qsl, lens, q_lens, sizes


def _plan_prefill(q_lens, lens, sizes: PlanSizes, tiles, *, auto: bool, num_q_heads, num_kv_heads, head_size, dtype,
                  device) -> AttentionPlan:
    """The prefill path: under ``"auto"`` the sequences with at least PREFILL_MIN_QUERY_LEN
    queries run the large-tile kernel and the others the unified kernel with ``tiles``; asked for
    by name, every sequence runs the large-tile kernel."""
    min_q_len = PREFILL_MIN_QUERY_LEN if auto else 0
    first, end = long_sequences(q_lens, max(min_q_len, 1))
    rest_max = max([n for n in q_lens if n < min_q_len] + [0])
    if rest_max and (first, end) != (0, 0):
        side_stream(torch.device(device))  # created now, outside any CUDA-graph capture of the call
    large = prefill_tiles(max(q_lens[first:end] + [0]), max(lens[first:end] + [0]), end - first,
                          num_q_heads=num_q_heads, head_size=head_size, dtype=dtype, device=device)
    return AttentionPlan.create(
        "prefill", tiles, sizes, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        device=device, prefill_tiles=large, prefill_min_q_len=min_q_len, rest_max_query_len=rest_max,
        prefill_seqs=(first, end),
    )


def _plan_persistent(qsl, lens, sizes: PlanSizes, *, tiles, num_q_heads, num_kv_heads, head_size, device,
                     max_num_seqs, max_context_len, num_programs, schedule, sliding_window,
                     fit_splits: bool = False, cap_registers: bool = True) -> AttentionPlan:
    """The persistent path: its tiles, grid and register cap, the work list of this batch and
    the buffers for any batch up to ``max_num_seqs`` sequences, ``sizes.max_num_tokens`` tokens
    and ``max_context_len`` keys. ``fit_splits`` (``"auto"``): a plan for this batch only, with
    partials for the splits its list uses."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    # the target's compiler spills the persistent kernel's wider or deeper tiles
    tiles = persistent_tiles(tiles, target_props(device), head_size)
    wave = RESIDENT_PROGRAMS_PER_SM * num_sms(device)
    num_programs = num_programs or PERSISTENT_PROGRAMS_PER_SM * num_sms(device)
    split_programs = min(num_programs, wave)
    # measured on 4-warp decode tiles up to head 128 only (the cap would spill wider tiles)
    capped = fit_splits and cap_registers and tiles.num_warps == 4 and head_size <= 128
    # uncapped, the kernel holds 2 programs per SM (194 registers): a uniform batch cut for 3 per
    # SM ran 1.45 waves (H200, graph plans: 16 x 4096 86.4 -> 74.8 us cut for 2 per SM, 8 x 4096
    # 50.4 -> 42.1, 4 x 8192 50.4 -> 41.8; 32 x 1024, unsplit, 39.0 either way)
    resident = split_programs if capped else min(split_programs, PERSISTENT_UNCAPPED_PROGRAMS_PER_SM * num_sms(device))
    max_splits = max(1, min(PERSISTENT_MAX_SPLITS, -(-max_context_len // MIN_SEGMENT_TOKENS)))
    if fit_splits:  # a plan for this batch only: partials for the splits its list uses
        listed = persistent_work_list(qsl, lens, tiles=tiles, num_kv_heads=num_kv_heads,
                                      num_programs=split_programs, max_splits=max_splits,
                                      sliding_window=sliding_window, resident=resident)
        max_splits = max(1, int(listed[0][:, 4].max())) if listed[0].shape[0] else 1
        if max_splits == 1 and schedule == "auto":
            # one item per (sequence, Q block, KV head): static striding (the atomic counter pays
            # off at 2+ items a program of unequal length), and the launcher then needs no
            # reduce kernel (nothing to merge, no counter to reset)
            schedule = "static"
    max_q_blocks = sizes.max_num_tokens // tiles.block_q + max_num_seqs
    max_items = max(1, max_q_blocks * num_kv_heads * max_splits)
    plan = AttentionPlan.create(
        "persistent", tiles, sizes, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        device=device, num_splits=max_splits, **work_buffers(max_items, sizes.max_num_tokens, num_programs, device),
        num_programs=num_programs, split_programs=split_programs, resident_programs=resident,
        schedule=schedule, max_num_seqs=max_num_seqs, sliding_window=sliding_window,
        max_registers=UNEQUAL_MAX_REGISTERS if capped else tiles.max_registers or PERSISTENT_MAX_REGISTERS,
    )
    if fit_splits:  # the list above, cut under the splits it uses, is the one update() would make
        plan._load(qsl, lens, *listed)
    else:
        plan.update(qsl, lens)
    return plan


GRAPH_WORKSPACE_BYTES = 256 * 2**20  # split-KV workspace of a plan for CUDA graphs (plan_for_graphs)


def plan_for_graphs(max_num_tokens: int, max_query_len: int, max_context_len: int, *, num_q_heads: int,
                    num_kv_heads: int, head_size: int, device, sliding_window: int | None = None,
                    dtype: torch.dtype = torch.bfloat16, workspace_bytes: int = GRAPH_WORKSPACE_BYTES) -> AttentionPlan:
    """A persistent plan behind CUDA graphs: capture ``paged_attention(..., plan=plan)`` once, then
    for each step ``plan.update(query_start_loc, seq_lens)`` and replay. It holds any step of up
    to ``max_num_tokens`` tokens (as many sequences, queries up to ``max_query_len``) over
    contexts up to ``max_context_len``. Its split count is the most that context needs at
    MIN_SEGMENT_TOKENS a segment, lowered until the split-KV workspace (``max_num_tokens`` x
    query heads x splits x ``head_size`` fp32) fits ``workspace_bytes`` (Llama-3.1-8B, 512
    tokens: 8 MiB a split, so 32 splits)."""
    per_split = max_num_tokens * num_q_heads * head_size * 4
    by_length = -(-max_context_len // MIN_SEGMENT_TOKENS)
    splits = max(1, min(by_length, workspace_bytes // per_split))
    q = max_query_len  # the tiles for the graphs' query length
    return plan_attention(
        [0, q], [q], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=head_size, device=device,
        path="persistent", max_num_tokens=max_num_tokens, max_num_seqs=max_num_tokens,
        max_context_len=splits * MIN_SEGMENT_TOKENS, sliding_window=sliding_window, dtype=dtype,
    )


def plan_for_call(num_seqs: int, num_tokens: int, max_query_len: int, max_seq_len: int, *, num_q_heads: int,
                  num_kv_heads: int, head_size: int, dtype: torch.dtype, device: torch.device,
                  sliding_window: int | None) -> AttentionPlan:
    """The plan a call without ``plan=`` runs: the ``"auto"`` rule of :func:`plan_attention` from
    the host maxima alone (no per-sequence lengths: every sequence counted at ``max_query_len``,
    and the prefill kernel's grid covering every sequence). Cached per shape and stream, so that
    repeated calls reuse the split-KV workspaces and the recorded launches."""
    stream = current_stream_handle(device)
    key = (num_seqs, num_tokens, max_query_len, max_seq_len, num_q_heads, num_kv_heads, head_size, dtype, device,
           sliding_window, stream)
    plan = _CALL_PLANS.pop(key, None)
    if plan is None:
        plan = _plan_for_call(num_seqs, num_tokens, max_query_len, max_seq_len, num_q_heads=num_q_heads,
                              num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype, device=device,
                              sliding_window=sliding_window)
        if len(_CALL_PLANS) >= CALL_PLANS_KEPT:
            _CALL_PLANS.pop(next(iter(_CALL_PLANS)))
    _CALL_PLANS[key] = plan  # most recently used last
    return plan


CALL_PLANS_KEPT = 8  # plans (and their split-KV workspaces) kept for calls without a plan
_CALL_PLANS: dict = {}


def _plan_for_call(num_seqs, num_tokens, max_query_len, max_seq_len, *, num_q_heads, num_kv_heads, head_size,
                   dtype, device, sliding_window) -> AttentionPlan:
    tiles = batch_tiles(max_query_len, num_q_heads, num_kv_heads, head_size, dtype, target_props(device))
    choice = choose_path("auto", None, max_query_len=max_query_len, max_seq_len=max_seq_len,
                         num_kv_heads=num_kv_heads, tiles=tiles, sms=num_sms(device), sliding_window=sliding_window,
                         num_seqs=num_seqs, head_size=head_size)
    sizes = PlanSizes(num_seqs=num_seqs, num_tokens=num_tokens, max_query_len=max_query_len, max_seq_len=max_seq_len,
                      max_num_tokens=num_tokens)
    heads = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=head_size)
    if choice.path == "prefill":
        # one sequence: the large-tile kernel serves it whatever its length (max_query_len may
        # be a loose bound), so the call is one launch without a unified launch for short ones
        one = num_seqs == 1
        return AttentionPlan.create(
            "prefill", tiles, sizes, **heads, device=device, sliding_window=sliding_window,
            prefill_tiles=prefill_tiles(max_query_len, max_seq_len, num_seqs, num_q_heads=num_q_heads,
                                        head_size=head_size, dtype=dtype, device=device),
            prefill_min_q_len=0 if one else PREFILL_MIN_QUERY_LEN, rest_max_query_len=0 if one else None,
        )
    return AttentionPlan.create(choice.path, tiles, sizes, **heads, device=device, num_splits=choice.num_splits,
                                sliding_window=sliding_window)
