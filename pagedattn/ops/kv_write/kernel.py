"""Scatter new K/V tokens into the paged cache: one program per (token, KV head)."""

import triton
import triton.language as tl

from pagedattn.ops.common.attention_math import round_to_fp8e4m3


@triton.jit
def _store_row(src_ptr, dst_ptr, offs_d, dim_ok, scale_ptr, CACHE_FP8: tl.constexpr):
    x = tl.load(src_ptr + offs_d, mask=dim_ok, other=0.0)
    if CACHE_FP8:
        x = round_to_fp8e4m3(x.to(tl.float32) / tl.load(scale_ptr))
    tl.store(dst_ptr + offs_d, x.to(dst_ptr.dtype.element_ty), mask=dim_ok)


@triton.jit(do_not_specialize=["num_tokens", "num_slots"])
def write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int32 or int64; -1 = skip
    k_scale_ptr,  # [1] fp32 for an fp8 cache, else None
    v_scale_ptr,
    st,  # KVWriteStrides (pagedattn.ops.kv_write.launch)
    num_tokens,
    num_slots,
    CFG: tl.constexpr,  # KVWriteConstants
):
    """k_cache[slot // PAGE_SIZE, slot % PAGE_SIZE, h] = key[t, h] (divided by k_scale for fp8).

    Slots outside [0, num_slots) (-1 marks padding) are skipped, so no slot can write past the cache.
    """
    CACHE_FP8: tl.constexpr = k_scale_ptr is not None
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    page = slot // CFG.PAGE_SIZE
    in_page = slot % CFG.PAGE_SIZE
    offs_d = tl.arange(0, CFG.HEAD_SIZE_PAD)
    dim_ok = offs_d < CFG.HEAD_SIZE
    _store_row(
        key_ptr + token * st.stride_key_t + head * st.stride_key_h,
        k_cache_ptr + page * st.stride_k_b + in_page * st.stride_k_s + head * st.stride_k_h,
        offs_d, dim_ok, k_scale_ptr, CACHE_FP8,
    )
    _store_row(
        value_ptr + token * st.stride_value_t + head * st.stride_value_h,
        v_cache_ptr + page * st.stride_v_b + in_page * st.stride_v_s + head * st.stride_v_h,
        offs_d, dim_ok, v_scale_ptr, CACHE_FP8,
    )
