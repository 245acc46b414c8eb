"""The tile shape of a paged-attention launch, chosen by the planner and read by the launchers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tiles:
    block_m: int  # rows of a Q block: block_q tokens x the query heads of one KV head
    block_q: int
    tile_n: int  # keys per step of the inner loop
    num_warps: int
    num_stages: int = 2
    max_registers: int | None = None  # ptxas's register budget (maxnreg), NVIDIA only; None: ptxas's choice
