"""Launcher of the two-state merge (``merge_attention_states``): strides and sizes as bundles."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedattn.ops.common.host_math import next_power_of_2
from pagedattn.ops.common.launching import launch
from pagedattn.ops.merge.kernel import merge_states_kernel


class MergeStrides(NamedTuple):
    """Token and head strides of the merged output and lse, then of each side's."""

    stride_o_t: int
    stride_o_h: int
    stride_l_t: int
    stride_l_h: int
    stride_a_t: int
    stride_a_h: int
    stride_la_t: int
    stride_la_h: int
    stride_b_t: int
    stride_b_h: int
    stride_lb_t: int
    stride_lb_h: int


class MergeConstants(NamedTuple):
    """The compile-time shape of a merge (the kernel's constexpr CFG)."""

    HEAD_SIZE: int
    HEAD_SIZE_PAD: int


def launch_merge_states(out: torch.Tensor, lse: torch.Tensor, out_a: torch.Tensor, lse_a: torch.Tensor,
                        out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """One program per (token, head); nothing for an empty batch."""
    num_tokens, num_heads, head_size = out_a.shape
    if num_tokens == 0 or num_heads == 0:
        return
    st = MergeStrides(out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), out_a.stride(0), out_a.stride(1),
                      lse_a.stride(0), lse_a.stride(1), out_b.stride(0), out_b.stride(1), lse_b.stride(0),
                      lse_b.stride(1))
    launch(merge_states_kernel, (num_tokens, num_heads),
           out_ptr=out, lse_ptr=lse, out_a_ptr=out_a, lse_a_ptr=lse_a, out_b_ptr=out_b, lse_b_ptr=lse_b, st=st,
           CFG=MergeConstants(HEAD_SIZE=head_size, HEAD_SIZE_PAD=next_power_of_2(head_size)),
           num_warps=1 if head_size <= 64 else 2)
