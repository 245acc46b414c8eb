"""Launcher of the persistent path: fixed grids, work lists from the plan."""

from __future__ import annotations

import torch

from pagedattn.ops.common.bundles import AttentionArgs, kernel_args, output_rows, partial_rows
from pagedattn.ops.common.host_math import next_power_of_2
from pagedattn.ops.common.launching import launch
from pagedattn.ops.common.pdl import pdl_option, use_pdl
from pagedattn.ops.common.target import target_props
from pagedattn.ops.persistent.kernel import WorkList, persistent_attention_kernel, persistent_reduce_kernel


def launch_persistent(out: torch.Tensor, lse: torch.Tensor | None, a: AttentionArgs, plan) -> None:
    """Run ``plan``'s work list (see pagedattn.plan.AttentionPlan.update) with its fixed grid."""
    pdl = use_pdl(a.q.device)
    max_splits = plan.partial_out.shape[2]
    shared = dict(work=WorkList(plan.work_items, plan.work_counts, plan.work_counter, plan.reduce_rows),
                  dst=output_rows(out, lse), part=partial_rows(plan.partial_out, plan.partial_lse), max_splits=max_splits, USE_PDL=pdl)
    args = kernel_args(a, plan.tiles)
    # the plan's register limit (the 168 cap of unequal batches, else the tiles' budget or the
    # ISA's limit: plan.worklist) over the tiles' budget; maxnreg is a ptxas option: NVIDIA
    # targets only (the ROCm build of torch also says "cuda")
    if plan.max_registers and target_props(a.q.device).is_cuda:
        args["maxnreg"] = plan.max_registers
    launch(persistent_attention_kernel, (plan.num_programs,), **shared, **args, num_kv_heads=a.k_cache.shape[2])
    if max_splits == 1 and plan.schedule == "static":
        # nothing to merge and no counter to reset, for every batch update() can give this plan
        # (its partials hold one split): one launch less (~7 us of host time a call)
        return
    head_size = a.q.shape[2]
    launch(persistent_reduce_kernel, (max(1, plan.num_programs // 4),), **shared, num_tokens=a.q.shape[0],
           max_rows=plan.reduce_rows.shape[0],
           NUM_Q_HEADS=a.q.shape[1], HEAD_SIZE=head_size, HEAD_SIZE_PAD=next_power_of_2(head_size),
           num_warps=1 if head_size <= 64 else 2, **pdl_option(pdl))
