"""Merging a row's split-KV partials (out_i, lse_i), shared by the split-KV, persistent and MLA
reductions (``merge_row``: the merge and the row's stores)."""

import triton
import triton.language as tl


@triton.constexpr_function
def split_block(head_size_pad):
    """Partials a merge reads at once: a [SPLIT_BLOCK, HEAD_SIZE_PAD] fp32 tile of at most 4096 values."""
    return max(2, min(32, 4096 // head_size_pad))


@triton.jit
def merge_partials(partial_out_row, partial_lse_row, num_splits, stride_po_s, stride_pl_s,
                   HEAD_SIZE: tl.constexpr, HEAD_SIZE_PAD: tl.constexpr, ALL_WRITTEN: tl.constexpr = False):
    """(out [HEAD_SIZE_PAD], lse) of one row from its ``num_splits`` partials.

    out = sum_i e^{lse_i - lse} out_i, lse = log sum_i e^{lse_i}; partials with lse -inf are not
    read, unless ALL_WRITTEN (every split below ``num_splits`` stored its out, 0 where its
    segment held no key: the persistent kernel's, and split-KV's even cut): then the outs are read with the lses, not
    after them, one L2 round trip less. A partial with lse NaN (a segment that read a NaN or inf) or +inf makes its weight NaN,
    so the row comes out NaN (out and lse), never as if the segment held no keys. SPLIT_BLOCK partials are loaded per step as one tile and merged online (a loop of one
    load per split waited on the L2 once per split: at batch 1 with 66 splits the call went from
    62.5 to 56.3 us with the tiles on the H200). The blocks start at fixed split indices and reduce in a
    fixed order, so the result is deterministic, and splits with lse -inf add exact zeros
    (batch-invariant mode relies on both).
    """
    SPLIT_BLOCK: tl.constexpr = split_block(HEAD_SIZE_PAD)
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    offs_s = tl.arange(0, SPLIT_BLOCK)
    dim_ok = offs_d < HEAD_SIZE
    m = tl.full([], float("-inf"), tl.float32)
    acc = tl.zeros([HEAD_SIZE_PAD], dtype=tl.float32)
    total = tl.full([], 0.0, tl.float32)
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        idx = s0 + offs_s
        lse_i = tl.load(partial_lse_row + idx * stride_pl_s, mask=idx < num_splits, other=float("-inf"))
        if ALL_WRITTEN:
            written = idx < num_splits  # no wait for the lses
        else:
            written = lse_i > float("-inf")
        part = tl.load(partial_out_row + idx[:, None] * stride_po_s + offs_d[None, :],
                       mask=written[:, None] & dim_ok[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse_i, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - shift)  # 0 while m is -inf; 1 when the max did not move
        w = tl.exp(lse_i - shift)  # [SPLIT_BLOCK]; 0 for splits without keys
        acc = acc * alpha + tl.sum(w[:, None] * part, axis=0)
        total = total * alpha + tl.sum(w, axis=0)
        m = m_new
    empty = total == 0.0  # every partial -inf; a NaN total is not empty
    out = acc / tl.where(empty, 1.0, total)
    lse = tl.where(empty, float("-inf"), m + tl.log(total))
    return out, lse


@triton.jit
def merge_row(out_ptr, lse_ptr, partial_out_ptr, partial_lse_ptr, token, head, num_splits,
              stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
              stride_po_t, stride_po_h, stride_po_s, stride_pl_t, stride_pl_h, stride_pl_s,
              HEAD_SIZE: tl.constexpr, HEAD_SIZE_PAD: tl.constexpr, RETURN_LSE: tl.constexpr,
              ALL_WRITTEN: tl.constexpr = False):
    """Merge row (token, head)'s partials and store its out (in out_ptr's dtype) and, with
    RETURN_LSE, its lse. ``token`` is int64; ALL_WRITTEN: see ``merge_partials``."""
    out, lse = merge_partials(
        partial_out_ptr + token * stride_po_t + head * stride_po_h,
        partial_lse_ptr + token * stride_pl_t + head * stride_pl_h,
        num_splits, stride_po_s, stride_pl_s, HEAD_SIZE, HEAD_SIZE_PAD, ALL_WRITTEN,
    )
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_SIZE)
    if RETURN_LSE:
        tl.store(lse_ptr + token * stride_lse_t + head * stride_lse_h, lse)
