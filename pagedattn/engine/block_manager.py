"""Pages of the paged KV cache: allocation as sequences grow, release when they finish."""

from __future__ import annotations

from collections import deque

from pagedattn.engine.sequence import Sequence


class BlockManager:
    """``num_blocks`` pages of ``block_size`` tokens; a sequence holds ``ceil(tokens / block_size)``."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New pages ``seq`` needs to hold ``num_tokens`` tokens in total."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_tokens`` tokens; RuntimeError if pages run out."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV-cache pages: {need} needed, {len(self._free)} free")
        seq.block_table.extend(self._free.popleft() for _ in range(need))

    def free(self, seq: Sequence) -> None:
        """Return every page of ``seq``."""
        self._free.extend(reversed(seq.block_table))
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        """Cache slot (``block * block_size + offset``) of token ``position`` of ``seq``."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
