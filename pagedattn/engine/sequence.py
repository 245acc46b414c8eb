"""A request's state: its tokens, how many of them are in the KV cache, its pages and limits."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    ``temperature`` 0 is greedy (after the repetition penalty). With ``temperature > 0`` the
    distribution ``softmax(logits / temperature)`` is cut by ``top_k`` (the k most likely tokens;
    0 or -1: off), ``top_p`` (the smallest set whose mass reaches p; 1: off) and ``min_p`` (tokens
    at least ``min_p`` times as likely as the most likely one; 0: off), then sampled.
    ``repetition_penalty`` r != 1 divides the positive logits (multiplies the negative ones) of
    every token already in the prompt or the output by r. ``seed``: this request draws from its
    own generator seeded with it, so its tokens do not depend on the rest of the batch.
    ``stop``: strings that end the output (the text stops before the first match); ``stop_token_ids``:
    tokens that end it like an end-of-sequence token (kept in ``token_ids``). ``ignore_eos`` keeps
    generating past the model's end-of-sequence tokens (not past ``stop`` / ``stop_token_ids``).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple = ()
    stop_token_ids: tuple = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if int(self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if float(self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if int(self.top_k) < -1:
            raise ValueError(f"top_k must be >= 1, or 0 / -1 for no limit, got {self.top_k}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if not 0.0 <= float(self.min_p) <= 1.0:
            raise ValueError(f"min_p must lie in [0, 1], got {self.min_p}")
        if not float(self.repetition_penalty) > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        """Whether top_k, top_p or min_p cut the distribution."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens ``token_ids`` (prompt, then generated); the first ``num_computed`` have K/V in the
    cache. ``block_table`` lists its pages; ``slot`` is its row in per-sequence buffers (the SDPA
    backend's static cache), -1 when it holds none. ``generator``: the request's own random
    generator (``params.seed``), made by the sampler at its first draw. ``stop_index``: where
    the output text ends when a stop string matched."""

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
        self.generator = None
        self.stop_index: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed}, "
                f"status={self.status.value})")
