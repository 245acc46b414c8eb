"""Continuous batching with chunked prefill.

Every step takes up to ``max_num_batched_tokens`` new tokens: first one token for each running
sequence that is generating (decode), then the next chunk of each running sequence whose prompt
is partly in the cache (extend), then first chunks of waiting sequences while there is budget,
room (``max_num_seqs``) and pages (prefill). The batch is ordered [decode | extend | prefill],
the order pagedattn's paths expect. When pages run out for a running sequence, the most recently
admitted one that is not yet in this step is preempted: its pages are freed and it waits to be
recomputed from its tokens so far.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field

from pagedattn.engine.block_manager import BlockManager
from pagedattn.engine.config import EngineConfig
from pagedattn.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """``seqs[i]`` computes ``num_new[i]`` tokens; ``num_decode`` / ``num_extend`` / ``num_prefill``
    count the three groups in that order."""

    seqs: list = field(default_factory=list)
    num_new: list = field(default_factory=list)
    num_decode: int = 0
    num_extend: int = 0
    num_prefill: int = 0

    @property
    def is_decode(self) -> bool:
        return bool(self.seqs) and self.num_decode == len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def samples(self, i: int) -> bool:
        """Whether sequence i reaches its last token this step (then a token is sampled for it)."""
        return self.seqs[i].num_computed + self.num_new[i] == self.seqs[i].num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, eos_token_ids=(), stop_checker=None):
        self.config = config
        self.blocks = blocks
        self.eos_token_ids = set(eos_token_ids)
        self.stop_checker = stop_checker  # seq -> True when its text holds a stop string (sets seq.stop_index)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(config.max_num_seqs))
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; ValueError when it could never fit (``max_model_len``, ``num_blocks``)."""
        self.check(seq)
        seq.arrival_time = seq.arrival_time or time.perf_counter()
        self.waiting.append(seq)

    def check(self, seq: Sequence) -> None:
        """ValueError when ``seq`` could never run: empty, or longer than the cache allows."""
        total = seq.num_prompt_tokens + seq.params.max_tokens
        if seq.num_prompt_tokens == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        if total > self.config.max_model_len:
            raise ValueError(f"prompt of {seq.num_prompt_tokens} tokens + max_tokens {seq.params.max_tokens} "
                             f"exceeds max_model_len {self.config.max_model_len}")
        if -(-total // self.blocks.block_size) > self.blocks.num_blocks:
            raise ValueError(f"prompt of {seq.num_prompt_tokens} tokens + max_tokens {seq.params.max_tokens} "
                             f"needs more KV-cache pages than num_blocks {self.blocks.num_blocks}")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        self._release_slot(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release_slot(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            heapq.heappush(self._free_slots, seq.slot)
            seq.slot = -1

    def _reserve(self, seq: Sequence, num_tokens: int, scheduled: set) -> bool:
        """Pages for ``num_tokens`` tokens of a running ``seq``, preempting later unscheduled
        sequences if needed; False (``seq`` itself preempted) when even that is not enough."""
        while not self.blocks.can_allocate(seq, num_tokens):
            victims = [s for s in self.running if s is not seq and s.seq_id not in scheduled]
            if not victims:
                self._preempt(seq)
                return False
            self._preempt(victims[-1])
        self.blocks.allocate(seq, num_tokens)
        return True

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        groups = {"decode": [], "extend": [], "prefill": []}
        scheduled: set = set()
        for phase in ("decode", "extend"):
            for seq in list(self.running):
                if budget == 0:
                    break
                remaining = seq.num_tokens - seq.num_computed
                if seq.status is not Status.RUNNING or (remaining == 1) != (phase == "decode"):
                    continue
                n = min(remaining, budget)
                if not self._reserve(seq, seq.num_computed + n, scheduled):
                    continue
                groups[phase].append((seq, n))
                scheduled.add(seq.seq_id)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.blocks.can_allocate(seq, seq.num_computed + n):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, seq.num_computed + n)
            seq.slot = heapq.heappop(self._free_slots)
            seq.status = Status.RUNNING
            self.running.append(seq)
            groups["prefill"].append((seq, n))
            budget -= n
        batch = ScheduledBatch(num_decode=len(groups["decode"]), num_extend=len(groups["extend"]),
                               num_prefill=len(groups["prefill"]))
        for seq, n in groups["decode"] + groups["extend"] + groups["prefill"]:
            batch.seqs.append(seq)
            batch.num_new.append(n)
        return batch

    def postprocess(self, batch: ScheduledBatch, sampled: list[int]) -> list[Sequence]:
        """Advance the sequences of ``batch``, append ``sampled`` tokens (one per sequence that
        samples, in batch order) and retire finished ones. Returns the finished sequences."""
        now = time.perf_counter()
        tokens = iter(sampled)
        finished = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new)):
            samples = batch.samples(i)
            seq.num_computed += n
            if not samples:
                continue
            token = next(tokens)
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            params = seq.params
            if token in self.eos_token_ids and not params.ignore_eos:
                seq.finish_reason = "eos"
            elif token in params.stop_token_ids or (params.stop and self.stop_checker(seq)):
                seq.finish_reason = "stop"
            elif len(seq.output_ids) >= params.max_tokens:
                seq.finish_reason = "length"
            else:
                continue
            seq.status = Status.FINISHED
            seq.finish_time = now
            self.blocks.free(seq)
            self._release_slot(seq)
            self.running.remove(seq)
            finished.append(seq)
        return finished
