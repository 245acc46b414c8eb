"""What the Gluon kernels share on the device: constants and the combine functions of their row
reductions. Imports Gluon (only the Gluon kernels import this module).

The reductions are written here because ``gl.max`` / ``gl.sum`` wrap triton.language's jit
functions, which Triton's CPU interpreter (``TRITON_INTERPRET=1``, the CPU test suite) replaces:
a kernel using them would then not compile for sm90 in that process.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def max_combine(a, b):
    return gl.maximum(a, b)


@gluon.jit
def sum_combine(a, b):
    return a + b


@gluon.jit
def to_16bit_pairs(x, DTYPE: gl.constexpr):
    """fp32 ``x`` rounded to DTYPE (bfloat16 or float16, round to nearest even, as ``x.to(DTYPE)``),
    two neighbouring elements of a thread by one ``cvt.rn.{bf16x2,f16x2}.f32``, the first in the
    low half. ``x.to(DTYPE)`` on a wgmma accumulator converts each element alone and packs the
    halves afterwards, which ptxas compiles to an F2FP pair conversion with the halves swapped and
    a PRMT to swap them back: one more instruction per two scores in the prefill's softmax."""
    if DTYPE == gl.bfloat16:
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.float16,
                                         is_pure=True, pack=2)


@gluon.jit
def tanh(x):
    """tanh from exp2 (``ops.common.attention_math.tanh``'s formula, so both paths round alike)."""
    e = gl.exp2(gl.abs(x) * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return gl.where(x < 0, -t, t)


@gluon.jit
def finalize_rows(acc, m_i, l_i, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """``(out, lse)`` of rows from the accumulator ``acc`` (layout ``o_layout``) and the running
    max ``m_i`` (base 2) and sum ``l_i`` (both sliced from ``s_layout``), as
    ``ops.common.attention_math.finalize_softmax``: l == 0 -> out 0 and lse -inf; an inf or NaN
    in the accumulator -> NaN on the whole row. lse in natural log."""
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    bad = gl.convert_layout(gl.reduce(acc * 0.0, 1, sum_combine), gl.SliceLayout(1, s_layout))
    inv = gl.where(empty, 0.0, 1.0 / l_safe) + bad
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * LN2 + bad)
    out = acc * gl.convert_layout(inv, gl.SliceLayout(1, o_layout))[:, None]
    out = gl.where(gl.convert_layout(empty, gl.SliceLayout(1, o_layout))[:, None], 0.0, out)
    return out, lse
