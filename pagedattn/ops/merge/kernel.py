"""Merge two attention states over disjoint key sets: (out_a, lse_a) + (out_b, lse_b)."""

import triton
import triton.language as tl


@triton.jit
def merge_states_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]
    lse_ptr,  # [num_tokens, num_heads] fp32
    out_a_ptr,
    lse_a_ptr,
    out_b_ptr,
    lse_b_ptr,
    st,  # MergeStrides (pagedattn.ops.merge.launch)
    CFG: tl.constexpr,  # MergeConstants
):
    """out = (e^{lse_a} out_a + e^{lse_b} out_b) / (e^{lse_a} + e^{lse_b}), lse = logaddexp.

    lse -inf: the side holds no keys and is not read. lse NaN or +inf on either side: its weight
    is NaN (e^{NaN}, or e^{inf - inf} after the shift), so out and lse come out NaN.
    """
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    HEAD_SIZE_PAD: tl.constexpr = CFG.HEAD_SIZE_PAD
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    dim_ok = offs_d < CFG.HEAD_SIZE
    lse_a = tl.load(lse_a_ptr + token * st.stride_la_t + head * st.stride_la_h).to(tl.float32)
    lse_b = tl.load(lse_b_ptr + token * st.stride_lb_t + head * st.stride_lb_h).to(tl.float32)
    m = tl.maximum(lse_a, lse_b)
    shift = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - shift)
    w_b = tl.exp(lse_b - shift)
    total = w_a + w_b
    a = tl.load(out_a_ptr + token * st.stride_a_t + head * st.stride_a_h + offs_d, mask=dim_ok & (tl.broadcast_to(w_a, [HEAD_SIZE_PAD]) > 0), other=0.0)
    b = tl.load(out_b_ptr + token * st.stride_b_t + head * st.stride_b_h + offs_d, mask=dim_ok & (tl.broadcast_to(w_b, [HEAD_SIZE_PAD]) > 0), other=0.0)
    empty = total == 0.0  # both sides -inf; a NaN total is not empty
    out = (w_a * a.to(tl.float32) + w_b * b.to(tl.float32)) / tl.where(empty, 1.0, total)
    tl.store(out_ptr + token * st.stride_o_t + head * st.stride_o_h + offs_d, out.to(out_ptr.dtype.element_ty), mask=dim_ok)
    lse = tl.where(empty, float("-inf"), shift + tl.log(total))
    tl.store(lse_ptr + token * st.stride_l_t + head * st.stride_l_h, lse)
