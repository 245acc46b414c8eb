"""The config of one MLA decode launch (``MLAConfig``), chosen by the planner
(:func:`pagedattn.plan.mla.pick_mla_config`) and read by the launcher.

A program owns ``block_m = block_h * block_q`` rows (heads of query tokens of one sequence) and
``latent / value_split`` output columns, and streams ``tile_n`` keys a step through
``num_stages`` shared-memory buffers. The budget on Hopper-class GPUs, from compiling the kernel
for sm_90a (ptxas register and spill counts, Triton's shared-memory figure; docs/perf-notes.md):

* the fp32 accumulator takes ``block_m * latent / value_split / (32 * num_warps)`` registers a
  thread; at 128 (64 rows x 512 columns on 8 warps, or x 256 on 4) the rest still fits in the
  255-register limit without spills inside the loop, except 64-key tiles on 4 warps;
* shared memory holds the queries (``block_m * 576 * 2`` bytes) and ``num_stages`` latent tiles
  (``tile_n * 576 * 2`` bytes each): 64 rows + 2 x 64 keys (or 4 x 32) = 216 KB of the 227 KB;
* ``tl.dot`` lays its warps along M when a second dot consumes its result, so ``block_m`` below
  ``16 * num_warps`` (below 64 per warp group on Hopper) computes the scores redundantly.
"""

from __future__ import annotations

from dataclasses import dataclass

SMEM_BYTES = 227 * 1024  # per block on sm_90 (opt-in maximum); the budget the configs are sized for
ROW_WIDTH_BYTES = 576 * 2  # DeepSeek's latent + rope row at 16 bits: the sizing unit below


@dataclass(frozen=True)
class MLAConfig:
    """Tiling of one MLA decode launch (internal; tests and sweeps pass one to ``_mla_decode``).

    ``num_splits`` None means the split rule decides; an explicit ``num_splits`` argument of
    ``mla_decode`` overrides both.
    """

    block_h: int  # heads of one query token per program
    block_q: int = 1  # query tokens of one sequence per program
    tile_n: int = 32  # keys per step of the inner loop
    value_split: int = 1  # programs sharing one row block, each with latent / value_split output columns
    num_warps: int = 4
    num_stages: int = 3
    num_splits: int | None = None

    @property
    def block_m(self) -> int:
        return self.block_h * self.block_q

    @property
    def label(self) -> str:
        text = f"h{self.block_h}q{self.block_q}-n{self.tile_n}-v{self.value_split}-w{self.num_warps}-s{self.num_stages}"
        return text + (f"-k{self.num_splits}" if self.num_splits else "")

    def acc_registers(self, latent_pad: int = 512) -> int:
        """fp32 accumulator registers a thread holds."""
        return self.block_m * (latent_pad // self.value_split) // (32 * self.num_warps)

    def smem_bytes(self, row_bytes: int = ROW_WIDTH_BYTES) -> int:
        """Shared memory the kernel needs (queries + pipelined latent tiles), within a few KB."""
        return (self.block_m + self.num_stages * self.tile_n) * row_bytes

    def problems(self, latent_pad: int = 512, row_bytes: int = ROW_WIDTH_BYTES) -> list[str]:
        """Why this config cannot run (or would spill heavily) on a Hopper-class GPU; [] if fine."""
        out = []
        if self.value_split not in (1, 2, 4):
            out.append(f"value_split {self.value_split} not in (1, 2, 4)")
        elif latent_pad // self.value_split < 16:
            out.append(f"value_split {self.value_split} leaves fewer than 16 columns")
        if self.block_m < 16 or self.tile_n < 16:
            out.append("tl.dot needs block_m and tile_n >= 16")
        if self.acc_registers(latent_pad) > 128:
            out.append(f"accumulator needs {self.acc_registers(latent_pad)} registers a thread (> 128)")
        if self.smem_bytes(row_bytes) > SMEM_BYTES:
            out.append(f"needs {self.smem_bytes(row_bytes) // 1024} KB of shared memory (> {SMEM_BYTES // 1024})")
        return out
