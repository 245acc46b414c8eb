"""Launcher of the large-tile prefill kernel (paged cache or contiguous K/V)."""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from pagedattn.ops.common.bundles import AttentionArgs, kernel_args, output_rows
from pagedattn.ops.common.device import cuda_sm90_or_newer, interpreter_on
from pagedattn.ops.common.host_math import cdiv, next_power_of_2
from pagedattn.ops.common.launching import launch
from pagedattn.ops.prefill.kernel import prefill_attention_kernel
from pagedattn.ops.prefill.tuning import autotune_enabled, candidates, choose_tiles, query_bucket, remembered
from pagedattn.ops.common.tiles import Tiles


def tma_wanted(k: torch.Tensor) -> bool:
    """Whether the tensor-descriptor loads may be used on k's device (the settings below)."""
    setting = os.environ.get("PAGEDATTN_TMA", "")
    if setting == "0":
        return False
    if interpreter_on():
        return setting == "1"
    return cuda_sm90_or_newer(k.device)


def tma_layout_ok(t: torch.Tensor) -> bool:
    """Whether a descriptor over ``t`` ``[rows, heads, head_size]`` as ``[rows, heads * head_size]``
    is exact: a power-of-2 head of 16+ elements (the tile is the head), heads packed in each
    row, rows and the base 16-byte aligned."""
    d = t.shape[2]
    return not (d < 16 or d & (d - 1) or t.stride(2) != 1 or t.stride(1) != d or t.stride(0) < t.shape[1] * d
                or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16)


def tma_usable(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether contiguous K/V load through tensor descriptors (``tma_descriptors``): wanted on
    their device (``tma_wanted``), not empty, and a descriptor over each is exact (``tma_layout_ok``)."""
    return k.shape[0] > 0 and tma_wanted(k) and tma_layout_ok(k) and tma_layout_ok(v)


def tma_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int):
    """(k_desc, v_desc) over contiguous ``[total_k, num_kv_heads, head_size]`` K/V, or (None, None).

    On by default on sm90+ CUDA: 3-10% faster than the pointer loads at S = 512-32768 (graph
    replays) with no added eager time (docs/perf-notes.md);
    ``PAGEDATTN_TMA=0`` turns it off, ``=1`` also turns it on in the interpreter. Taken only
    where usable (``tma_usable``).
    """
    if not tma_usable(k, v):
        return None, None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return tuple(TensorDescriptor(t, shape=[t.shape[0], t.shape[1] * t.shape[2]], strides=[t.stride(0), 1],
                                  block_shape=[block_n, t.shape[2]]) for t in (k, v))


MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z sizes: the sequences and the Q tiles


def q_tiles_fit(max_query_len: int, block_m: int) -> bool:
    """Whether the grid's Q-tile dimension (z) stays within MAX_GRID_YZ for ``block_m``-row tiles."""
    return cdiv(max_query_len, block_m) <= MAX_GRID_YZ


def check_prefill_grid(max_query_len: int, num_seqs: int, tiles: Tiles) -> None:
    """ValueError, naming the argument, when the prefill grid (heads, sequences, Q tiles) would
    exceed CUDA's limits; called before any launch of the call (the same limits everywhere, the
    interpreter included, so a call that runs on the CPU runs on a GPU)."""
    if num_seqs > MAX_GRID_YZ:
        raise ValueError(f"query_start_loc describes {num_seqs} sequences; the prefill kernel's grid holds at "
                         f"most {MAX_GRID_YZ} (split the batch across calls)")
    if not q_tiles_fit(max_query_len, tiles.block_m):
        raise ValueError(f"max_query_len {max_query_len} needs more than {MAX_GRID_YZ} Q tiles of {tiles.block_m} "
                         f"rows in the prefill grid (split the sequence's queries across calls)")


def launch_prefill(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    a: AttentionArgs,
    tiles: Tiles,
    *,
    max_query_len: int,
    min_q_len: int = 0,
    cu_seqlens_k: torch.Tensor | None = None,
    seqs: tuple[int, int] | None = None,
) -> None:
    """``a.k_cache`` / ``a.v_cache`` are the paged cache, or with ``cu_seqlens_k`` contiguous
    ``[total_k, num_kv_heads, head_size]`` K/V (then ``a.block_table`` and ``a.seq_lens`` are unused).
    ``seqs``: the sequences [first, end) the grid covers (default: all).

    ``tiles`` is the deterministic choice; with ``PAGEDATTN_AUTOTUNE=1`` the first call of a shape
    may time other candidates and use the fastest from then on (``tuning.py``)."""
    first, end = (0, a.query_start_loc.shape[0] - 1) if seqs is None else seqs
    if a.q.shape[0] == 0 or end <= first or max_query_len == 0:
        return
    if tiles.block_q != tiles.block_m:  # a program's query tokens are its BLOCK_M rows
        tiles = replace(tiles, block_q=tiles.block_m)

    def run(t: Tiles) -> None:
        _launch_prefill_kernel(out, lse, a, t, max_query_len=max_query_len, min_q_len=min_q_len,
                               cu_seqlens_k=cu_seqlens_k, first=first, end=end)

    q = a.q
    if autotune_enabled(q.device):
        paged = cu_seqlens_k is None
        tma = not paged and tma_usable(a.k_cache, a.v_cache)
        key = (str(q.device), torch.cuda.get_device_name(q.device) if q.is_cuda else "interpreter", q.dtype,
               a.k_cache.dtype, q.shape[2], a.v_cache.shape[-1], q.shape[1] // a.k_cache.shape[-2], paged,
               a.k_cache.shape[1] if paged else 0, tma, a.causal, query_bucket(max_query_len),
               # the grid's size and the table's choice (short prefills differ from extends of the
               # same query length: an extend tuned on a short prefill's tiles ran 16% slower on the H200)
               q.shape[1], next_power_of_2(end - first), tiles)
        if _out_aliases_inputs(out, lse, a):
            tiles = remembered(key, tiles)
        else:
            head = max(16, next_power_of_2(max(q.shape[2], a.v_cache.shape[-1])))
            options = [t for t in candidates(head, q.dtype, tiles) if q_tiles_fit(max_query_len, t.block_m)]
            tiles = choose_tiles(key, tiles, options, run, q.device)
    run(tiles)


def _out_aliases_inputs(out, lse, a: AttentionArgs) -> bool:
    """Whether an output shares a storage with q, K or V: then timing candidates (several
    launches that each overwrite the outputs) would feed one launch's output to the next.
    Overlap between different storages (from_blob, DLPack views of one buffer) is not seen."""
    inputs = {t.untyped_storage().data_ptr() for t in (a.q, a.k_cache, a.v_cache)}
    return any(t is not None and t.untyped_storage().data_ptr() in inputs for t in (out, lse))


def _launch_prefill_kernel(out, lse, a: AttentionArgs, tiles: Tiles, *, max_query_len: int, min_q_len: int,
                           cu_seqlens_k: torch.Tensor | None, first: int, end: int) -> None:
    k_desc, v_desc = (None, None) if cu_seqlens_k is None else tma_descriptors(a.k_cache, a.v_cache, tiles.tile_n)
    grid = (a.q.shape[1], end - first, cdiv(max_query_len, tiles.block_m))  # the kernel's launch order
    launch(prefill_attention_kernel, grid, dst=output_rows(out, lse), k_desc=k_desc, v_desc=v_desc,
           **kernel_args(a, tiles, contiguous_kv=cu_seqlens_k), min_q_len=min_q_len, first_seq=first)
