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
