"""Host-side planning of a Helion call: which tokens take the split-KV decode kernel, their
KV segments, the prefill kernel's query chunks, and the partial-state workspaces.

A plan is built once per engine step from host copies of the metadata and reused by every
layer: the per-layer call then only launches. The plan fixes the work lists, so it must come
from the same step's metadata as the call (the call checks the token and sequence counts and
the masking arguments that change the segment counts, not the lengths inside the tensors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pagedattn.plan import host_list

__all__ = ["HelionPlan", "plan_attention", "PREFILL_MIN_QUERY_LEN", "PREFILL_CHUNK", "MIN_SEGMENT"]

# Sequences with at least this many queries run the prefill kernel (one K/V read per query
# chunk and head); shorter ones the decode kernel (one K/V read per token and KV head).
PREFILL_MIN_QUERY_LEN = 16
# Queries per prefill program; the autotuned Q tile (16..128 rows) loops inside it.
PREFILL_CHUNK = 128
# Fewest keys per decode segment: below this the merge and the per-program set-up outweigh
# what another program adds to the memory-bound loop.
MIN_SEGMENT = 256
SEGMENT_ALIGN = 64  # segments start on 64-key boundaries, so no page is read by two segments


@dataclass
class HelionPlan:
    """The work lists and workspaces of one step (see :func:`plan_attention`).

    decode_items ``[num_items, 3]`` int32: (token, sequence, segment index); decode_tokens
    ``[num_decode]`` int32 and item_start ``[num_decode + 1]`` int32 (token w owns items
    ``item_start[w]:item_start[w + 1]``); prefill_items ``[num_chunks, 3]`` int32: (sequence,
    first token, end token); part_out ``[num_items, num_q_heads, head_size]`` and part_lse
    ``[num_items, num_q_heads]`` fp32 are the decode kernel's partial states.
    """

    num_tokens: int
    num_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    device: torch.device
    causal: bool
    sliding_window: int | None
    segment: int
    decode_items: torch.Tensor
    decode_tokens: torch.Tensor
    item_start: torch.Tensor
    prefill_items: torch.Tensor
    part_out: torch.Tensor
    part_lse: torch.Tensor
    stats: dict = field(default_factory=dict)


def _target_programs(device: torch.device) -> int:
    """Decode programs to aim for: four per SM keeps the memory pipes busy (and the tail short)
    on a GPU; on the CPU (reference mode) every program is Python work, so a few."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def plan_attention(
    query_start_loc,
    seq_lens,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    device=None,
    causal: bool = True,
    sliding_window: int | None = None,
    segment_size: int | None = None,
) -> HelionPlan:
    """Plan one step for :func:`pagedattn.helion.paged_attention`.

    Parameters
    ----------
    query_start_loc : ``[num_seqs + 1]`` ints (host list or tensor; a device tensor costs one sync)
    seq_lens : ``[num_seqs]`` ints
    num_q_heads, num_kv_heads, head_size : the attention shape.
    device : where the kernels run (default: CUDA when available, else the CPU).
    causal, sliding_window : as the calls of this step will pass them; they decide how many keys
        each decode token sees and so its number of segments.
    segment_size : keys per decode segment (rounded up to a multiple of 64); default from the
        batch: enough segments for about four programs per SM, at least 256 keys each.

    Examples
    --------
    >>> plan = plan_attention(qsl_host, seq_lens_host, num_q_heads=32, num_kv_heads=8, head_size=128)
    >>> out = pagedattn.helion.paged_attention(q, k_cache, v_cache, block_table, seq_lens, qsl, plan=plan)
    """
    qsl = host_list(query_start_loc, "query_start_loc")
    lens = host_list(seq_lens, "seq_lens")
    if len(qsl) != len(lens) + 1:
        raise ValueError(f"query_start_loc has {len(qsl)} entries; expected len(seq_lens) + 1 = {len(lens) + 1}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be an int >= 1 or None, got {sliding_window!r}")
    if segment_size is not None and (not isinstance(segment_size, int) or segment_size < 1):
        raise ValueError(f"segment_size must be an int >= 1 or None, got {segment_size!r}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # compared with q.device, which names its index
        device = torch.device("cuda", torch.cuda.current_device())
    window = sliding_window or 0

    decode_tok, decode_seq, decode_vis, chunks = [], [], [], []
    for s, (q0, q1, seq_len) in enumerate(zip(qsl[:-1], qsl[1:], lens)):
        q_len = q1 - q0
        if q_len < 0:
            raise ValueError(f"query_start_loc must be non-decreasing; sequence {s} has {q_len} queries")
        if q_len >= PREFILL_MIN_QUERY_LEN:
            for c0 in range(q0, q1, PREFILL_CHUNK):
                c1 = min(c0 + PREFILL_CHUNK, q1)
                last = seq_len - q_len + (c1 - q0) - 1  # position of the chunk's last query
                work = last + 1 if causal else seq_len
                if window:
                    work = min(work, window + (c1 - c0))
                chunks.append((max(work, 0), s, c0, c1))
            continue
        for j in range(q_len):
            pos = seq_len - q_len + j
            hi = min(seq_len, pos + 1) if causal else (min(seq_len, pos + window) if window else seq_len)
            lo = max(0, pos - window + 1) if window else 0
            decode_tok.append(q0 + j)
            decode_seq.append(s)
            decode_vis.append(max(0, hi - lo))

    if segment_size is None:
        total = sum(max(v, 1) for v in decode_vis) * num_kv_heads
        segment_size = max(MIN_SEGMENT, -(-total // _target_programs(device)))
    segment = -(-segment_size // SEGMENT_ALIGN) * SEGMENT_ALIGN
    items, item_start = [], [0]
    for tok, seq, vis in zip(decode_tok, decode_seq, decode_vis):
        items.extend((tok, seq, i) for i in range(max(1, math.ceil(vis / segment))))
        item_start.append(len(items))
    # Longest chunks first: the causal triangle's last chunks hold the most keys, and starting
    # them first shortens the tail where few programs are left.
    chunks.sort(key=lambda c: -c[0])

    def ints(rows, width=None):
        t = torch.tensor(rows, dtype=torch.int32)
        return (t.reshape(-1, width) if width else t).to(device)

    num_items = len(items)
    return HelionPlan(
        num_tokens=qsl[-1] if qsl else 0,
        num_seqs=len(lens),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        device=device,
        causal=bool(causal),
        sliding_window=sliding_window,
        segment=segment,
        decode_items=ints(items, 3),
        decode_tokens=ints(decode_tok),
        item_start=ints(item_start),
        prefill_items=ints([c[1:] for c in chunks], 3),
        part_out=torch.empty(num_items, num_q_heads, head_size, dtype=torch.float32, device=device),
        part_lse=torch.empty(num_items, num_q_heads, dtype=torch.float32, device=device),
        stats={"decode_tokens": len(decode_tok), "decode_items": num_items, "prefill_chunks": len(chunks)},
    )
