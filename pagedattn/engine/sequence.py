"""A request's state: its tokens, how many of them are in the KV cache, its pages and limits."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 is greedy; ``ignore_eos`` keeps generating past an end-of-sequence token."""

    max_tokens: int = 16
    temperature: float = 0.0
    ignore_eos: bool = False

    def __post_init__(self):
        if int(self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if float(self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens ``token_ids`` (prompt, then generated); the first ``num_computed`` have K/V in the
    cache. ``block_table`` lists its pages; ``slot`` is its row in per-sequence buffers (the SDPA
    backend's static cache), -1 when it holds none."""

    _counter = itertools.count()

    def __init__(self, token_ids, params: SamplingParams):
        self.seq_id = next(Sequence._counter)
        self.token_ids = [int(t) for t in token_ids]
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.num_computed = 0
        self.block_table: list[int] = []
        self.slot = -1
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.arrival_time = self.first_token_time = self.finish_time = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed}, "
                f"status={self.status.value})")
