"""Launcher of the K/V cache write: the strides and compile-time sizes as bundles, one launch."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedattn.ops.common.host_math import next_power_of_2
from pagedattn.ops.common.launching import launch
from pagedattn.ops.kv_write.kernel import write_kv_kernel


class KVWriteStrides(NamedTuple):
    """The strides of the write kernel's tensors: new K/V by token and head, the caches by block,
    slot and head."""

    stride_key_t: int
    stride_key_h: int
    stride_value_t: int
    stride_value_h: int
    stride_k_b: int
    stride_k_s: int
    stride_k_h: int
    stride_v_b: int
    stride_v_s: int
    stride_v_h: int


class KVWriteConstants(NamedTuple):
    """The compile-time shape of a write (the kernel's constexpr CFG)."""

    HEAD_SIZE: int
    HEAD_SIZE_PAD: int
    PAGE_SIZE: int


def launch_write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """One program per (token, KV head). ``k_scale`` / ``v_scale``: ``[1]`` fp32 for an fp8
    cache, else None (which also selects the unquantized kernel)."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    st = KVWriteStrides(key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    launch(write_kv_kernel, (num_tokens, num_kv_heads),
           key_ptr=key, value_ptr=value, k_cache_ptr=k_cache, v_cache_ptr=v_cache, slot_mapping_ptr=slot_mapping,
           k_scale_ptr=k_scale, v_scale_ptr=v_scale, st=st, num_tokens=num_tokens,
           num_slots=k_cache.shape[0] * k_cache.shape[1],
           CFG=KVWriteConstants(HEAD_SIZE=head_size, HEAD_SIZE_PAD=next_power_of_2(head_size),
                                PAGE_SIZE=k_cache.shape[1]))
