"""Integer helpers for the host side of the launchers and the planner.

``triton.next_power_of_2`` and ``triton.cdiv`` are constexpr functions in Triton 3.6: called
from Python they go through the JIT wrapper, about 2 us each on the CPU, several times per
attention call. These are the same results in plain Python (~0.05 us).
"""


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)
