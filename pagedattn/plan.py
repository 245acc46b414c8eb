"""Host-side planning: which path runs a batch, with which tiles, and the workspaces it needs.

An engine builds one :class:`AttentionPlan` per step with :func:`plan_attention` (from host
metadata; it may synchronize once if given device tensors) and passes it to every layer's
``paged_attention(..., plan=plan)``, which then allocates nothing and never synchronizes.

The path rule (``path="auto"``):

* Long queries (``max_query_len > SPLIT_KV_MAX_QUERY_LEN``) take the unified ("2D") path: the
  Q blocks of the prefill/extend tokens already give the GPU enough programs.
* Otherwise count the 2D grid, ``num_q_blocks * num_kv_heads``. If it reaches
  ``PROGRAMS_PER_SM * num_sms`` the GPU is full and 2D runs. If not, split each sequence's keys
  into ``num_splits = ceil(PROGRAMS_PER_SM * num_sms / programs_2d)`` segments (so the split grid
  fills the GPU), at most ``ceil(max_seq_len / MIN_SEGMENT_TOKENS)`` (a segment streams enough
  keys to amortize writing and merging its partial) and at most ``MAX_SPLITS``; one split
  means 2D.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

SPLIT_KV_MAX_QUERY_LEN = 8
PROGRAMS_PER_SM = 4
MIN_SEGMENT_TOKENS = 128
MAX_SPLITS = 128
INVARIANT_SEGMENT_TOKENS = 1024
PATHS = ("auto", "unified", "split_kv")


@dataclass(frozen=True)
class Tiles:
    block_m: int  # rows of a Q block: block_q tokens x the query heads of one KV head
    block_q: int
    tile_n: int  # keys per step of the inner loop
    num_warps: int
    num_stages: int = 2


@dataclass
class AttentionPlan:
    """What ``paged_attention(..., plan=plan)`` runs; built by :func:`plan_attention`.

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


def _is_interpreter() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def num_sms(device) -> int:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few programs are plenty


def pick_tiles(max_query_len: int, num_queries_per_kv: int, head_size: int, *, fixed: bool = False) -> Tiles:
    """Tile shapes from the shapes alone (``fixed``: independent of the batch, for invariance).

    Decode gets the smallest M that ``tl.dot`` accepts (16), filled by the query heads of one
    KV head; longer queries get 64-row blocks so each K/V tile serves more rows. Decode tiles
    (64 keys, 4 warps, 2 stages) won the H200 sweep in docs/perf-notes.md.
    """
    head_size_pad = max(16, triton.next_power_of_2(head_size))
    short = fixed or max_query_len <= 1
    block_m = max(16 if short else 64, triton.next_power_of_2(num_queries_per_kv))
    block_q = block_m // num_queries_per_kv
    tile_n = 32 if head_size_pad > 128 else 64
    num_warps = 4 if block_m * head_size_pad <= 64 * 128 else 8
    if _is_interpreter():
        num_warps = 1
    return Tiles(block_m, block_q, tile_n, num_warps, num_stages=2)


def choose_num_splits(num_q_blocks: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, sms: int,
                      sliding_window: int | None = None) -> int:
    """The module docstring's rule; 1 means the unified path.

    With a sliding window a query sees at most ``sliding_window + max_query_len - 1`` keys, and
    that length (not the sequence's) decides how many segments are worth it.
    """
    if sliding_window:
        max_seq_len = min(max_seq_len, sliding_window + max_query_len - 1)
    if max_query_len > SPLIT_KV_MAX_QUERY_LEN or max_seq_len <= MIN_SEGMENT_TOKENS:
        return 1
    programs_2d = max(1, num_q_blocks * num_kv_heads)
    target = PROGRAMS_PER_SM * sms
    if programs_2d >= target:
        return 1
    by_fill = -(-target // programs_2d)
    by_length = -(-max_seq_len // MIN_SEGMENT_TOKENS)
    return max(1, min(by_fill, by_length, MAX_SPLITS))


def _host_list(x) -> list[int]:
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.tolist()]  # one sync if x lives on the device
    return [int(v) for v in x]


def plan_attention(
    query_start_loc,
    seq_lens,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    device="cuda",
    path: str = "auto",
    num_splits: int | None = None,
    batch_invariant: bool = False,
    segment_size: int = INVARIANT_SEGMENT_TOKENS,
    max_num_tokens: int | None = None,
    sliding_window: int | None = None,
) -> AttentionPlan:
    """Plan one engine step.

    Parameters
    ----------
    query_start_loc : ``[num_seqs + 1]`` ints (list or host tensor; a device tensor costs a sync)
    seq_lens : ``[num_seqs]`` ints
    num_q_heads, num_kv_heads, head_size : the attention shape of every layer of the step.
    device : where the workspaces live (the kernels' device).
    path : ``"auto"`` (the module docstring's rule), ``"unified"`` or ``"split_kv"``.
    num_splits : force the split count of the split-KV path.
    batch_invariant : every sequence's output bitwise independent of the rest of the batch:
        the split-KV path with ``segment_size`` keys per split at fixed positions and tiles
        that depend on the head shape only. Workspace: ``num_tokens * num_q_heads *
        ceil(max_seq_len / segment_size) * head_size * 4`` bytes (large for long prefills).
    max_num_tokens : workspace capacity in tokens (default: this batch's token count).
    sliding_window : the layers' window, if any: it bounds the keys a query reads, which the
        split rule uses (correctness never depends on it).

    Examples
    --------
    >>> plan = plan_attention([0, 1, 2], [4096, 900], num_q_heads=32, num_kv_heads=8, head_size=128)
    >>> out = paged_attention(q, k_cache, v_cache, block_table, seq_lens, qsl, plan=plan)
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    qsl = _host_list(query_start_loc)
    lens = _host_list(seq_lens)
    if len(qsl) != len(lens) + 1:
        raise ValueError(f"query_start_loc has {len(qsl)} entries; expected len(seq_lens) + 1 = {len(lens) + 1}")
    q_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
    max_query_len = max(q_lens + [0])
    max_seq_len = max(lens + [0])
    num_tokens = qsl[-1] if qsl else 0
    max_num_tokens = max(num_tokens, max_num_tokens or 0)
    group = num_q_heads // num_kv_heads

    segment = 0
    if batch_invariant:
        tiles = pick_tiles(max_query_len, group, head_size, fixed=True)
        if segment_size < tiles.tile_n or segment_size % tiles.tile_n:
            raise ValueError(f"segment_size must be a positive multiple of {tiles.tile_n}, got {segment_size}")
        if path == "unified":
            raise ValueError("batch_invariant=True runs the split_kv path; path='unified' conflicts")
        path, segment = "split_kv", segment_size
        splits = max(1, -(-max_seq_len // segment))
    else:
        tiles = pick_tiles(max_query_len, group, head_size)
        if num_splits is not None:
            if num_splits < 1:
                raise ValueError(f"num_splits must be >= 1, got {num_splits}")
            splits = num_splits
        else:
            num_q_blocks = sum(-(-n // tiles.block_q) for n in q_lens)
            splits = choose_num_splits(num_q_blocks, num_kv_heads, max_query_len, max_seq_len, num_sms(device),
                                       sliding_window)
        if path == "auto":
            path = "split_kv" if splits > 1 else "unified"
    if path == "unified":
        splits = 1

    partial_out = partial_lse = None
    if path == "split_kv":
        partial_out = torch.empty(max_num_tokens, num_q_heads, splits, head_size, dtype=torch.float32, device=device)
        partial_lse = torch.empty(max_num_tokens, num_q_heads, splits, dtype=torch.float32, device=device)
    return AttentionPlan(
        path=path, tiles=tiles, num_splits=splits, segment_size=segment,
        max_query_len=max_query_len, max_seq_len=max_seq_len, max_num_tokens=max_num_tokens,
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        batch_invariant=batch_invariant, partial_out=partial_out, partial_lse=partial_lse,
    )
