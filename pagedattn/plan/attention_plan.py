"""The plan object: what ``paged_attention(..., plan=plan)`` runs, its one constructor, and the
in-place re-plan of a persistent plan (``update``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from pagedattn.ops.common.launching import Tapes
from pagedattn.ops.common.tiles import Tiles
from pagedattn.plan.workspace import PinnedStaging, split_partials, upload
from pagedattn.plan.worklist import ATOMIC_MIN_ITEMS_PER_PROGRAM, _reduce_rows, _work_items, work_list_layout


class PlanSizes(NamedTuple):
    """The batch a plan is made for, in host ints."""

    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    max_num_tokens: int  # the workspaces' capacity in tokens (>= num_tokens)


@dataclass
class AttentionPlan:
    """What ``paged_attention(..., plan=plan)`` runs; built by :func:`pagedattn.plan_attention`.

    ``partial_out`` ``[max_num_tokens, num_q_heads, num_splits, head_size]`` fp32 and
    ``partial_lse`` ``[max_num_tokens, num_q_heads, num_splits]`` fp32 are the split-KV
    workspaces (None on the unified path).
    """

    path: str
    tiles: Tiles
    num_splits: int
    segment_size: int  # > 0: fixed tokens per split (batch-invariant mode)
    max_query_len: int
    max_seq_len: int
    max_num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    batch_invariant: bool
    partial_out: torch.Tensor | None
    partial_lse: torch.Tensor | None
    # persistent path only: the device work lists, their capacity and the fixed grid
    work_items: torch.Tensor | None = None  # [max_items + num_programs, 5] int32: seq, q block, kv head, split, splits
    work_counts: torch.Tensor | None = None  # [3] int32: items, reduce rows, 1 = atomic schedule
    work_counter: torch.Tensor | None = None  # [1] int32 (atomic schedule)
    reduce_rows: torch.Tensor | None = None  # [max_num_tokens, 2] int32: token, splits
    num_programs: int = 0  # the persistent grid
    split_programs: int = 0  # the programs of one wave, which the work list is cut for
    # the programs the kernel holds at once, when fewer than split_programs (0: as many): a
    # uniform batch's split items fill one wave of them
    resident_programs: int = 0
    max_registers: int | None = None  # the persistent kernel's register limit (persistent plans always state one)
    schedule: str = "auto"
    max_num_seqs: int = 0
    sliding_window: int | None = None
    # prefill path: sequences with at least prefill_min_q_len queries run the large-tile kernel,
    # the others (at most rest_max_query_len queries; 0: none; None: up to prefill_min_q_len - 1)
    # the unified kernel with tiles for that length, so a prefill among decodes leaves the
    # decodes on decode tiles
    prefill_tiles: Tiles | None = None
    prefill_min_q_len: int = 0
    rest_max_query_len: int | None = None
    prefill_seqs: tuple[int, int] | None = None  # [first, end): the sequences holding every long one
    # the batch the plan was made or last updated for: a call with fewer tokens or sequences
    # raises (its work list or grid would address rows the call does not have)
    num_tokens: int = 0
    num_seqs: int = 0
    # persistent path on CUDA: update()'s pinned staging buffers (workspace.PinnedStaging)
    _staging: PinnedStaging | None = field(default=None, repr=False, compare=False)
    # recorded launches of the per-layer call, by input layout (pagedattn.ops.common.launching)
    _tapes: Tapes = field(default_factory=Tapes, repr=False, compare=False)
    # persistent path: (query_start_loc, splits per sequence) of the list update() last uploaded
    _listed: tuple | None = field(default=None, repr=False, compare=False)

    @classmethod
    def create(cls, path: str, tiles: Tiles, sizes: PlanSizes, *, num_q_heads: int, num_kv_heads: int,
               head_size: int, device, num_splits: int = 1, segment_size: int = 0, batch_invariant: bool = False,
               **fields) -> AttentionPlan:
        """The planner's constructor: a plan of ``path`` for the batch ``sizes``, with the split
        partials its path needs (split_kv and persistent: ``num_splits`` per row of
        ``sizes.max_num_tokens``, on ``device``). ``fields``: the path's own (the prefill
        path's tiles and sequences, the persistent path's buffers and grid, the window)."""
        partial_out = partial_lse = None
        if path in ("split_kv", "persistent"):
            partial_out, partial_lse = split_partials(sizes.max_num_tokens, num_q_heads, num_splits, head_size, device)
        return cls(
            path=path, tiles=tiles, num_splits=num_splits, segment_size=segment_size,
            max_query_len=sizes.max_query_len, max_seq_len=sizes.max_seq_len, max_num_tokens=sizes.max_num_tokens,
            num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=head_size, batch_invariant=batch_invariant,
            partial_out=partial_out, partial_lse=partial_lse, num_tokens=sizes.num_tokens, num_seqs=sizes.num_seqs,
            **fields,
        )

    def update(self, query_start_loc, seq_lens) -> None:
        """Re-plan a persistent plan for a new batch in place (same buffers, same grid).

        For CUDA graphs: capture ``paged_attention(..., plan=plan)`` once at the maximum shape,
        then per step write the step's metadata into the captured input buffers, call
        ``plan.update(query_start_loc, seq_lens)`` with the same metadata on the host, and replay.
        Raises ValueError if the batch exceeds the capacity the plan was made for.
        """
        if self.path != "persistent":
            raise ValueError(f"update() re-plans persistent plans only; this plan's path is {self.path!r}")
        qsl, lens = host_list(query_start_loc), host_list(seq_lens)
        if len(lens) > self.max_num_seqs or (qsl and qsl[-1] > self.max_num_tokens):
            raise ValueError(
                f"batch of {len(lens)} sequences / {qsl[-1] if qsl else 0} tokens exceeds the plan's capacity "
                f"({self.max_num_seqs} sequences, {self.max_num_tokens} tokens)"
            )
        blocks, splits, order = work_list_layout(
            qsl, lens, tiles=self.tiles, num_kv_heads=self.num_kv_heads,
            num_programs=self.split_programs or self.num_programs, max_splits=self.partial_out.shape[2],
            sliding_window=self.sliding_window, resident=self.resident_programs or None,
        )
        if self._listed == (qsl, splits, order):
            # the device already holds this list (steady decode steps: same batch, same splits;
            # the kernels read the lengths from seq_lens): no rebuild, no upload, no wait on the
            # last upload (H200 host, 64 decodes inside vLLM: ~480 us a step otherwise)
            self.max_seq_len = max(lens + [0])
            return
        self._load(qsl, lens, _work_items(blocks, splits, self.num_kv_heads, order), _reduce_rows(qsl, splits))
        self._listed = (qsl, splits, order)

    def _load(self, qsl: list[int], lens: list[int], items: torch.Tensor, rows: torch.Tensor) -> None:
        """Upload the work list made for the batch (qsl, lens) and record that batch."""
        capacity = self.work_items.shape[0] - self.num_programs  # the rows past it: workspace.work_buffers
        if items.shape[0] > capacity:
            raise ValueError(f"{items.shape[0]} work items exceed the plan's capacity {capacity}")
        atomic = self.schedule == "atomic" or (
            self.schedule == "auto" and items.shape[0] >= ATOMIC_MIN_ITEMS_PER_PROGRAM * self.num_programs)
        self._upload(items, rows, torch.tensor([items.shape[0], rows.shape[0], int(atomic)], dtype=torch.int32))
        q_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
        self.max_query_len = max(q_lens + [0])
        self.max_seq_len = max(lens + [0])
        self.num_tokens = qsl[-1] if qsl else 0
        self.num_seqs = len(lens)
        self._tapes.clear()

    def _upload(self, items: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor) -> None:
        """Write the host work list into the device buffers without waiting for the device
        (:func:`pagedattn.plan.workspace.upload`)."""
        dst = ((self.work_items, items), (self.reduce_rows, rows), (self.work_counts, counts))
        self._staging = upload(dst, self._staging)


def host_list(x, name: str = "x") -> list[int]:
    """``x`` (a sequence of ints, or a tensor: one sync if it lives on the device) as a new list of
    Python ints; TypeError naming ``name`` for anything else."""
    if isinstance(x, torch.Tensor):
        return x.tolist()  # Python ints (one sync if x lives on the device)
    try:
        return [int(v) for v in x]
    except TypeError:
        raise TypeError(f"{name} must be a tensor or a sequence of ints, got {type(x).__name__}") from None
