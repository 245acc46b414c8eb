"""Small @triton.jit helpers shared by the kernel families: math only, no memory access.

Scores handled here are in natural-log units until ``online_softmax_step``, which works in
base 2 (scores are multiplied by log2(e) once, so the exponentials are ``exp2``).

NaN and inf (docs/contract.md): a row that reads a NaN or inf in its query or in a key or value it sees
ends with output NaN and lse NaN; lse -inf means only "no visible key". Three places keep it:
``nonfinite_to_nan`` turns a +-inf dot product into NaN before the mask (a -inf score from the
data would otherwise look like a masked key and drop out); NaN scores then make the running sum
``l`` NaN, which no later tile can undo; ``finalize_softmax`` tells NaN from empty (``l == 0``)
and also catches an inf value, once per row.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# ALIBI_MODE values (kernel globals must be tl.constexpr instances; launchers pass ``.value``)
ALIBI_NONE = tl.constexpr(0)
ALIBI_LINEAR = tl.constexpr(1)
ALIBI_SQRT = tl.constexpr(2)


@triton.jit
def tanh(x):
    """tanh from exp2, portable to every backend and the interpreter."""
    e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))  # tensor first: Triton 3.8's interpreter rejects constexpr * tensor here
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def softcap_and_alibi(s, q_pos, k_pos, softcap, slope, USE_SOFTCAP: tl.constexpr, ALIBI_MODE: tl.constexpr):
    """s = softcap(s) + alibi bias; s: [M, N] fp32, q_pos: [M], k_pos: [N], slope: [M]."""
    if USE_SOFTCAP:
        s = softcap * tanh(s / softcap)
    if ALIBI_MODE == ALIBI_LINEAR:
        s += slope[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
    elif ALIBI_MODE == ALIBI_SQRT:
        dist = tl.maximum(q_pos[:, None] - k_pos[None, :], 0).to(tl.float32)
        s -= slope[:, None] * tl.sqrt(dist)
    return s


@triton.jit
def nonfinite_to_nan(qk):
    """``qk`` with +-inf turned into NaN (finite values unchanged exactly: qk + 0 * qk).

    Apply to the raw dot products before the mask: a dot product is +-inf only when a query or a
    key holds an inf, and a -inf score would otherwise get weight 0 like a masked key (and a
    softcap would turn +-inf into a finite score). One FMA per score.
    """
    return qk + qk * 0.0


@triton.jit
def scores_log2(qk, scale, q_pos, k_pos, softcap, slope, USE_SOFTCAP: tl.constexpr, ALIBI_MODE: tl.constexpr):
    """Scores in base-2 units from the raw dot products ``qk``: one multiply by scale * log2(e)
    unless a softcap or ALiBi needs the natural-log scores first. An infinite ``qk`` gives NaN
    (``nonfinite_to_nan``)."""
    qk = nonfinite_to_nan(qk)
    if USE_SOFTCAP or ALIBI_MODE != 0:
        return softcap_and_alibi(qk * scale, q_pos, k_pos, softcap, slope, USE_SOFTCAP, ALIBI_MODE) * LOG2E
    return qk * (scale * LOG2E)


@triton.jit
def causal_window_mask(q_pos, k_pos, sliding_window, IS_CAUSAL: tl.constexpr):
    """[M, N] visibility by the causal and sliding-window rules (window <= 0 means none)."""
    p = q_pos[:, None]
    k = k_pos[None, :]
    if IS_CAUSAL:
        vis = k <= p
        vis = vis & ((sliding_window <= 0) | (k > p - sliding_window))
    else:
        vis = (sliding_window <= 0) | ((k > p - sliding_window) & (k < p + sliding_window))
    return vis


@triton.jit
def online_softmax_step(m_i, l_i, x, c):
    """One tile of the online softmax in base 2 on the scores c * x (c > 0); x is [M, N] with
    -inf where masked.

    The scores are not formed: the row max is taken on x and scaled once per row (c > 0, so
    max(c x) = c max(x) exactly), and each weight is exp2(c x - m), one fused multiply-add. Pass
    c = 1.0 when x are the base-2 scores already (the multiplies fold away).
    Returns (p, alpha, m_new, l_new): the tile's unnormalized weights, the factor that rescales
    the old accumulator, and the new running max and sum. Rows that have seen no visible key
    keep m = -inf and l = 0 without producing NaN. A NaN score makes its weight NaN, so l and the
    accumulator turn NaN and stay NaN (NaN * alpha is NaN even where alpha is 0), whether or not
    the max reduction skips NaN (GPUs' max does, the interpreter's does not).
    """
    m_new = tl.maximum(m_i, tl.max(x, 1) * c)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(x * c - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def online_softmax_step_finite(m_i, l_i, x, c):
    """``online_softmax_step`` for a tile whose scores are all finite (every key visible to every
    row): the new max is finite, so no -inf guard."""
    m_new = tl.maximum(m_i, tl.max(x, 1) * c)
    p = tl.exp2(x * c - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def finalize_softmax(acc, m_i, l_i):
    """(out, lse) from the running state; lse in natural log.

    l == 0 (no visible key): out 0 and lse -inf, whatever the accumulator holds. l NaN (a NaN
    score) or a non-finite accumulator (an inf or NaN value): out NaN and lse NaN on the whole
    row, so a merge downstream cannot mistake the row for an empty one.

    1/l is taken once per row and multiplied in: Triton's fp32 division is IEEE-rounded, and one
    per element cost more sm90 instructions than the NaN check adds.
    """
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    bad = tl.sum(acc * 0.0, 1)  # [M]: 0, or NaN where the accumulator holds an inf or NaN
    inv = tl.where(empty, 0.0, 1.0 / l_safe) + bad
    out = tl.where(empty[:, None], 0.0, acc * inv[:, None])
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2 + bad)
    return out, lse


@triton.jit
def round_to_fp8e4m3(x):
    """Round fp32 x to the nearest-even e4m3 value (saturating at +-448), still in fp32.

    Casting the result to fp8 is then exact on every backend, which sidesteps rounding
    differences between hardware and the interpreter's conversion.
    """
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, -6)  # e4m3 subnormals share the step of the smallest normal
    step = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)
    y = x / step
    y = (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: round half to even in fp32
    r = y * step
    return tl.where(r == 0.0, x * 0.0, r)  # keep the sign of values that round to zero
