"""Launcher of the persistent path: fixed grids, work lists from the plan."""

from __future__ import annotations

import torch

from pagedattn.ops.common.host_math import next_power_of_2
from pagedattn.ops.common.pdl import use_pdl
from pagedattn.ops.common.launching import launch
from pagedattn.ops.persistent.kernel import persistent_attention_kernel, persistent_reduce_kernel
from pagedattn.ops.unified.launch import AttentionArgs, common_kernel_args


def launch_persistent(out: torch.Tensor, lse: torch.Tensor | None, a: AttentionArgs, plan) -> None:
    """Run ``plan``'s work list (see pagedattn.plan.AttentionPlan.update) with its fixed grid."""
    po, pl = plan.partial_out, plan.partial_lse
    pdl = use_pdl(a.q.device)
    shared = dict(  # the output, the partials and the work counters, as both kernels take them
        out_ptr=out,
        lse_ptr=lse,
        partial_out_ptr=po,
        partial_lse_ptr=pl,
        work_counts_ptr=plan.work_counts,
        work_counter_ptr=plan.work_counter,
        stride_o_t=out.stride(0), stride_o_h=out.stride(1),
        stride_lse_t=lse.stride(0) if lse is not None else 0,
        stride_lse_h=lse.stride(1) if lse is not None else 0,
        stride_po_t=po.stride(0), stride_po_h=po.stride(1), stride_po_s=po.stride(2),
        stride_pl_t=pl.stride(0), stride_pl_h=pl.stride(1),
        USE_PDL=pdl,
    )
    launch(persistent_attention_kernel, (plan.num_programs,),
        work_items_ptr=plan.work_items, **shared, **common_kernel_args(a, plan.tiles),
    )
    head_size = a.q.shape[2]
    launch(persistent_reduce_kernel, (max(1, plan.num_programs // 4),),
        reduce_rows_ptr=plan.reduce_rows,
        **shared,
        NUM_Q_HEADS=a.q.shape[1],
        HEAD_SIZE=head_size,
        HEAD_SIZE_PAD=next_power_of_2(head_size),
        num_warps=1 if head_size <= 64 else 2,
        launch_pdl=pdl,
    )
