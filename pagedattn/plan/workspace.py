"""A plan's device workspaces: the split partials, the persistent kernel's work-list buffers,
and the pinned host staging through which a new work list reaches them."""

from __future__ import annotations

import torch


def split_partials(num_tokens: int, num_q_heads: int, num_splits: int, head_size: int,
                   device) -> tuple[torch.Tensor, torch.Tensor]:
    """``partial_out`` ``[num_tokens, num_q_heads, num_splits, head_size]`` fp32 and
    ``partial_lse`` ``[num_tokens, num_q_heads, num_splits]`` fp32: each split's output and LSE,
    merged by the reduce kernel.

    ``partial_lse`` is a view of rows padded to a multiple of 16 splits: Triton specializes a
    kernel on whether each stride is a multiple of 16, so with rows of ``num_splits`` a call of 16
    splits and one of 10 ran different compiled variants, and a warm-up of one split count left
    the other to compile during a request."""
    padded = -(-num_splits // 16) * 16
    return (torch.empty(num_tokens, num_q_heads, num_splits, head_size, dtype=torch.float32, device=device),
            torch.empty(num_tokens, num_q_heads, padded, dtype=torch.float32, device=device)[..., :num_splits])


def work_buffers(max_items: int, max_num_tokens: int, num_programs: int, device) -> dict[str, torch.Tensor]:
    """The persistent kernel's device lists, by :class:`AttentionPlan` field: ``work_items``
    ``[max_items + num_programs, 5]`` (the kernel reads each program's next item before it knows
    whether the list holds it: a list of at most ``max_items`` and a grid of at most
    ``num_programs`` read no further), ``work_counts`` ``[3]``, ``work_counter`` ``[1]`` and
    ``reduce_rows`` ``[max(1, max_num_tokens), 2]``, int32, zeroed."""
    return dict(
        work_items=torch.zeros(max_items + num_programs, 5, dtype=torch.int32, device=device),
        work_counts=torch.zeros(3, dtype=torch.int32, device=device),
        work_counter=torch.zeros(1, dtype=torch.int32, device=device),
        reduce_rows=torch.zeros(max(1, max_num_tokens), 2, dtype=torch.int32, device=device),
    )


class PinnedStaging:
    """Pinned host copies of a set of CUDA buffers, and an event after their last copies.

    The lists go through the pinned buffers and non-blocking copies on the current stream, so
    they land after any replay already enqueued that reads the old lists and the host goes on at
    once (a copy from pageable memory would wait for the stream). A non-blocking copy reads the
    staging buffers when it executes: the event recorded after the copies makes the next upload
    wait for them before rewriting (normally long done).
    """

    def __init__(self, buffers) -> None:
        self.stages = [torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True) for buf in buffers]
        self.copied = torch.cuda.Event()

    def copy(self, pairs) -> None:
        """Copy each host tensor of ``pairs`` ((device buffer, host tensor), ...) into the front
        of its buffer."""
        self.copied.synchronize()
        for stage, (buf, src) in zip(self.stages, pairs):
            n = src.shape[0]
            stage[:n].copy_(src)
            buf[:n].copy_(stage[:n], non_blocking=True)
        self.copied.record(torch.cuda.current_stream(pairs[0][0].device))


def upload(pairs, staging: PinnedStaging | None) -> PinnedStaging | None:
    """Write each host tensor of ``pairs`` ((device buffer, host tensor), ...) into the front of
    its buffer without waiting for the device: on CUDA through ``staging`` (made on the first
    upload and returned, for the next one), elsewhere by plain copies."""
    if pairs[0][0].device.type != "cuda":
        for buf, src in pairs:
            buf[: src.shape[0]].copy_(src)
        return staging
    if staging is None:
        staging = PinnedStaging([buf for buf, _ in pairs])
    staging.copy(pairs)
    return staging
