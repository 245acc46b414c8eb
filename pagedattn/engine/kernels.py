"""Fused elementwise kernels of the decoder (GPU path): residual add + RMSNorm, RoPE of q and k,
SiLU-and-multiply. Each replaces several torch launches per layer, which in a CUDA-graph decode
step of a small batch cost about as much as the weights' reads. The torch code in
:mod:`pagedattn.engine.model` is the reference (``tests/test_engine.py`` compares them)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedattn.ops.common.device import interpreter_on


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_x, stride_r, stride_o,
    num_cols, eps, weight_offset,
    HAS_RESIDUAL: tl.constexpr,
    WEIGHT_FP32: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """s = x (+ residual, stored back to residual); out = weight * (s / sqrt(mean(s^2) + eps)),
    the normalized row rounded to x's dtype first, or (WEIGHT_FP32) multiplied in fp32 by
    ``weight + weight_offset`` and rounded once (Gemma's ``1 + w``, GPT-OSS)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < num_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / num_cols + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_FP32:
        out = xf * inv_rms * (w + weight_offset)
    else:
        out = (xf * inv_rms).to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, stride_src_h, stride_dst_h, cos, sin, offs_d, d_mask,
                  NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
    offs_h = tl.arange(0, HEADS_PAD)
    mask = (offs_h < NUM_HEADS)[:, None] & d_mask[None, :]
    src = src_ptr + offs_h[:, None] * stride_src_h + offs_d[None, :]
    dst = dst_ptr + offs_h[:, None] * stride_dst_h + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # [HEADS_PAD, HALF_PAD]
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, positions_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h,
    stride_qo_t, stride_qo_h, stride_ko_t, stride_ko_h,
    NUM_Q_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    """Rotate-half RoPE of one token's q and k heads: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    cos = tl.load(cos_ptr + pos * HALF + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * HALF + offs_d, mask=d_mask, other=0.0)[None, :]
    _rotate_heads(q_ptr + t * stride_q_t, q_out_ptr + t * stride_qo_t, stride_q_h, stride_qo_h, cos, sin,
                  offs_d, d_mask, NUM_Q_HEADS, Q_HEADS_PAD, HALF)
    _rotate_heads(k_ptr + t * stride_k_t, k_out_ptr + t * stride_ko_t, stride_k_h, stride_ko_h, cos, sin,
                  offs_d, d_mask, NUM_KV_HEADS, KV_HEADS_PAD, HALF)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, num_cols, BLOCK: tl.constexpr):
    """out = silu(x[:, :n]) * x[:, n:], in fp32, rounded once."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_cols
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + num_cols + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             style: str = "llama"):
    """x ``[n, hidden]`` -> (normed ``[n, hidden]``, residual): with ``residual`` the sum
    ``x + residual`` is normalized and written into ``residual`` in place, else residual is x.
    ``style``: as :class:`pagedattn.engine.model.RMSNorm` ("llama", "gemma", "fp32")."""
    if style not in ("llama", "gemma", "fp32"):
        raise ValueError(f"style must be llama, gemma or fp32, got {style!r}")
    n, cols = x.shape
    out = torch.empty_like(x)
    if n == 0:
        return out, x if residual is None else residual
    block = triton.next_power_of_2(cols)
    _rms_norm_kernel[(n,)](
        x, residual, weight, out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        cols, eps, 1.0 if style == "gemma" else 0.0,
        HAS_RESIDUAL=residual is not None, WEIGHT_FP32=style != "llama", BLOCK=block,
        num_warps=1 if interpreter_on() else (4 if block <= 1024 else 8 if block <= 8192 else 16),
    )
    return out, x if residual is None else residual


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor):
    """q ``[n, num_q_heads, head_size]``, k ``[n, num_kv_heads, head_size]`` (rows may be strided),
    cos/sin ``[max_len, head_size // 2]`` fp32, positions ``[n]`` -> new contiguous (q, k)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    k_out = torch.empty(n, hkv, d, dtype=k.dtype, device=k.device)
    if n == 0:
        return q_out, k_out
    half = d // 2
    _rope_kernel[(n,)](
        q, k, q_out, k_out, cos, sin, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        NUM_Q_HEADS=hq, Q_HEADS_PAD=triton.next_power_of_2(hq),
        NUM_KV_HEADS=hkv, KV_HEADS_PAD=triton.next_power_of_2(hkv),
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
        num_warps=1 if interpreter_on() else 4,
    )
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x ``[n, 2 * inter]`` (gate, then up) -> ``[n, inter]``."""
    n, cols = x.shape
    inter = cols // 2
    out = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(n, triton.cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=1 if interpreter_on() else 4,
    )
    return out
