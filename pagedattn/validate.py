"""Metadata validation: the checks an engine can turn on while it is being developed.

The kernels never read or write outside the cache whatever the metadata says (bad pages are
masked); this module says *what* is wrong, naming the sequence and the index, at the cost of
one host synchronization per call. ``paged_attention`` and ``write_kv`` run it by default on
CPU tensors (the interpreter, where a sync costs nothing beside the kernels) and not on a GPU
(where it would synchronize every call); ``validate=True`` / ``False`` decides per call, and the
environment variable ``PAGEDATTN_VALIDATE=1`` turns it on for every call.
"""

from __future__ import annotations

import torch

from pagedattn.ops.common.device import environ_is

__all__ = ["validate_metadata", "validation_requested"]


def validation_requested(flag: bool | None, device: torch.device | None = None) -> bool:
    """``flag`` (None: on for tensors on the CPU), or the environment variable
    PAGEDATTN_VALIDATE=1 (read on every call)."""
    if flag is None:
        flag = device is not None and device.type == "cpu"
    return flag or environ_is("PAGEDATTN_VALIDATE", "1")


def validate_metadata(
    block_table: torch.Tensor | None,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    *,
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    causal: bool = True,
    slot_mapping: torch.Tensor | None = None,
    allow_shared_blocks: bool = False,
) -> None:
    """Raise ValueError naming the sequence and the index of the first bad metadata entry.

    Parameters
    ----------
    block_table : ``[num_seqs, max_blocks_per_seq]`` int32, or None (write_kv only)
    seq_lens : ``[num_seqs]`` int32, or None
    query_start_loc : ``[num_seqs + 1]`` int32, or None
    num_tokens : tokens in q (or in key/value for write_kv)
    num_blocks, block_size : the cache's first two dimensions
    causal : with causal attention every sequence needs seq_len >= its query length
    slot_mapping : ``[num_tokens]`` int32/int64, optional: every slot in [-1, num_blocks * block_size)
    allow_shared_blocks : blocks shared between sequences are an error unless prefix sharing
        is intended

    Checks: query_start_loc starts at 0, never decreases and ends at num_tokens; seq_lens are
    >= 0 (and >= the query length when causal); the block table covers every sequence and every
    block id it uses lies in [0, num_blocks); no block is used by two sequences (unless
    allowed); slot_mapping entries are in range. All tensors are copied to the host in one
    transfer (one synchronization).
    """
    parts = [t for t in (block_table, seq_lens, query_start_loc, slot_mapping) if t is not None]
    if not parts:
        return
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in parts]).cpu()  # the one sync
    host = {}
    offset = 0
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc), ("slot_mapping", slot_mapping)):
        if t is not None:
            host[name] = flat[offset : offset + t.numel()].reshape(t.shape)
            offset += t.numel()

    if "query_start_loc" in host:
        qsl = host["query_start_loc"]
        if qsl.numel() == 0 or int(qsl[0]) != 0:
            raise ValueError(f"query_start_loc[0] must be 0, got {int(qsl[0]) if qsl.numel() else 'nothing'}")
        q_lens = qsl[1:] - qsl[:-1]
        bad = (q_lens < 0).nonzero()
        if bad.numel():
            s = int(bad[0])
            raise ValueError(
                f"query_start_loc decreases at index {s + 1} (sequence {s}: "
                f"{int(qsl[s])} -> {int(qsl[s + 1])})"
            )
        if int(qsl[-1]) > num_tokens:  # fewer is padding (rows past it are neither read nor written)
            raise ValueError(f"query_start_loc[-1] = {int(qsl[-1])}, but q has {num_tokens} tokens")
    if "seq_lens" in host:
        lens = host["seq_lens"]
        bad = (lens < 0).nonzero()
        if bad.numel():
            s = int(bad[0])
            raise ValueError(f"sequence {s}: seq_lens[{s}] = {int(lens[s])} is negative")
        if causal and "query_start_loc" in host:
            bad = (lens < q_lens).nonzero()
            if bad.numel():
                s = int(bad[0])
                raise ValueError(
                    f"sequence {s}: seq_lens[{s}] = {int(lens[s])} is shorter than its "
                    f"{int(q_lens[s])} new query tokens (causal attention needs seq_len >= query_len)"
                )
    if "block_table" in host and "seq_lens" in host:
        table, lens = host["block_table"], host["seq_lens"]
        pages = (lens + block_size - 1) // block_size
        bad = (pages > table.shape[1]).nonzero()
        if bad.numel():
            s = int(bad[0])
            raise ValueError(
                f"sequence {s}: seq_lens[{s}] = {int(lens[s])} needs {int(pages[s])} blocks, but "
                f"block_table has {table.shape[1]} columns"
            )
        used = torch.arange(table.shape[1])[None, :] < pages[:, None]
        out_of_range = used & ((table < 0) | (table >= num_blocks))
        bad = out_of_range.nonzero()
        if bad.numel():
            s, i = (int(v) for v in bad[0])
            raise ValueError(
                f"sequence {s}: block_table[{s}, {i}] = {int(table[s, i])} is outside [0, {num_blocks})"
            )
        if not allow_shared_blocks:
            ids = table[used]
            seq_of = torch.arange(table.shape[0])[:, None].expand_as(table)[used]
            col_of = torch.arange(table.shape[1])[None, :].expand_as(table)[used]
            order = torch.argsort(ids, stable=True)
            ids, seq_of, col_of = ids[order], seq_of[order], col_of[order]
            dup = ((ids[1:] == ids[:-1]) & (seq_of[1:] != seq_of[:-1])).nonzero()
            if dup.numel():
                j = int(dup[0])
                raise ValueError(
                    f"block {int(ids[j])} is used by sequence {int(seq_of[j])} (block_table[{int(seq_of[j])}, "
                    f"{int(col_of[j])}]) and by sequence {int(seq_of[j + 1])} (block_table[{int(seq_of[j + 1])}, "
                    f"{int(col_of[j + 1])}]); pass allow_shared_blocks=True if prefix sharing is intended"
                )
    if "slot_mapping" in host:
        slots = host["slot_mapping"]
        num_slots = num_blocks * block_size
        bad = ((slots < -1) | (slots >= num_slots)).nonzero()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(f"slot_mapping[{i}] = {int(slots[i])} is outside [-1, {num_slots})")
