"""The Helion kernels: split-KV decode partials, their merge, and Q-chunk prefill.

Each kernel is a plain function here; :func:`kernel` wraps it with ``helion.kernel`` once per
(kernel, execution mode, config). A key k is visible to a query at position p when
``p - left < k < p + right`` and ``0 <= k < seq_len`` (``right = 1`` is the causal rule,
``left = W`` the sliding window, ``NO_LIMIT`` switches a side off), so causal, window and
non-causal calls compile to one kernel. Scores run in base 2 (``exp2``); the lse they return is
a natural logarithm.

``LARGE_CACHE`` (a cache of 2**31 elements or more) computes page offsets in 64 bits: a page id
loaded from the int32 block table times the page stride would overflow 32 bits.

``EAGER`` selects the matrix products for Helion's reference mode (eager PyTorch, used on the
CPU): there ``hl.dot`` needs ``mm`` with an ``out_dtype``, which PyTorch's CPU backend lacks,
so the products run as fp32 ``matmul``. Compiled kernels use ``hl.dot`` with fp32 accumulation
on the inputs' own dtype (bf16 tensor cores).
"""

from __future__ import annotations

import functools

import helion
import helion.language as hl
import torch
from helion.runtime.ref_mode import RefMode

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NO_LIMIT = 1 << 30  # a window side that is off: p +- NO_LIMIT covers every int32 position


def _gather_kv(k_cache, v_cache, pages, kvh, LARGE_CACHE):
    """K and V of one KV tile, each ``[block_p * block_size, head_size]``: KV head ``kvh`` of
    the pages ``pages`` (``block_table[seq, tile_p]``, as read by the caller).

    Helion traces a called function into the caller's loop but turns subscripts into loads only
    in the kernel's own body, so the loads here are spelled ``hl.load``. The block-table read
    stays a subscript in the caller: in reference mode ``hl.load`` with a scalar tensor index
    (the sequence) keeps it as a unit dimension, where the compiled load drops it. The loads keep
    their place in the kernel's load order, which a stored config's per-load entries index.
    """
    pages = torch.where((pages >= 0) & (pages < k_cache.size(0)), pages, 0)  # never read outside the cache
    # page * stride past 2**31: offsets in 64 bits (else 32-bit math: fewer registers)
    pages = pages.to(torch.int64 if LARGE_CACHE else torch.int32)
    k = hl.load(k_cache, [pages, slice(None), kvh, slice(None)]).flatten(0, 1)
    v = hl.load(v_cache, [pages, slice(None), kvh, slice(None)]).flatten(0, 1)
    return k, v


def _scores(qx, k, scale, softcap, SOFTCAP, EAGER):
    """``qx @ k.T`` in fp32, scaled (and soft-capped) into base-2 logits. An inf product (inf in
    q or k) becomes NaN: never a masked-looking -inf."""
    if EAGER:
        s = torch.matmul(qx.to(torch.float32), k.to(torch.float32).T)
    else:
        s = hl.dot(qx, k.T, out_dtype=torch.float32)
    s = s + s * 0.0
    if SOFTCAP:
        return torch.tanh(s * (scale / softcap)) * (softcap * LOG2E)
    return s * (scale * LOG2E)


def _online_softmax_step(m_i, l_i, acc, s, v, EAGER):
    """One KV tile of the online softmax: the running max, sum and accumulator after the masked
    base-2 logits ``s`` and the values ``v``. Columns are ``unsqueeze(-1)``, not ``[:, None]``:
    in a called function Helion lowers a subscript to an inductor slice it cannot emit."""
    m_new = torch.maximum(m_i, torch.amax(s, -1))
    m_use = torch.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet
    p = torch.exp2(s - m_use.unsqueeze(-1))
    alpha = torch.exp2(m_i - m_use)
    l_i = l_i * alpha + torch.sum(p, -1)
    if EAGER:
        acc = acc * alpha.unsqueeze(-1) + torch.matmul(p, v.to(torch.float32))
    else:
        acc = acc * alpha.unsqueeze(-1) + hl.dot(p.to(v.dtype), v, out_dtype=torch.float32)
    return m_new, l_i, acc


def _finalize(m_i, l_i, acc):
    """The normalized rows and their natural-log lse; a row with no visible key: 0 and -inf; an
    inf or NaN in the accumulator reaches both as NaN."""
    empty = l_i == 0.0
    bad = torch.sum(acc * 0.0, -1)  # 0, or NaN where the accumulator holds an inf or NaN
    inv = torch.where(empty, 0.0, 1.0 / torch.where(empty, 1.0, l_i)) + bad
    lse_row = torch.where(empty, float("-inf"), (m_i + torch.log2(torch.where(empty, 1.0, l_i))) * LN2 + bad)
    return torch.where(empty.unsqueeze(-1), 0.0, acc * inv.unsqueeze(-1)), lse_row


def decode_partials(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    items: torch.Tensor,  # [num_items, 3] int32: (token, sequence, segment index)
    part_out: torch.Tensor,  # [num_items, num_q_heads, head_size] fp32
    part_lse: torch.Tensor,  # [num_items, num_q_heads] fp32, natural log
    scale: float,
    softcap: float,
    left: int,
    right: int,
    segment: int,
    GROUP_PAD: hl.constexpr,
    SOFTCAP: hl.constexpr,
    LARGE_CACHE: hl.constexpr,
    EAGER: hl.constexpr,
) -> None:
    """One (token, KV segment) item per program and KV head: the online softmax of the token's
    query heads of that KV head over the segment's keys, normalized, with its lse."""
    num_q_heads = hl.specialize(q.size(1))
    head_size = hl.specialize(q.size(2))
    block_size = hl.specialize(k_cache.size(1))
    num_kv_heads = hl.specialize(k_cache.size(2))
    max_blocks = block_table.size(1)
    group = num_q_heads // num_kv_heads
    block_p = hl.register_block_size(max(1, 16 // block_size), max(1, 256 // block_size))  # pages per KV tile
    # Heads split as [KV head, group] (always a view): a query head index is then a tile, not a
    # computed tensor, which Helion needs next to the scalar token index.
    q_grouped = q.view(q.size(0), num_kv_heads, group, head_size)
    out_grouped = part_out.view(part_out.size(0), num_kv_heads, group, head_size)
    lse_grouped = part_lse.view(part_lse.size(0), num_kv_heads, group)
    for item, kvh in hl.grid([items.size(0), num_kv_heads]):
        tok = items[item, 0].to(torch.int64)  # a row offset: q may hold 2**31 elements
        seq = items[item, 1]
        seq_len = seq_lens[seq]
        q_start = query_start_loc[seq]
        pos = seq_len - (query_start_loc[seq + 1] - q_start) + (tok - q_start)
        lo = torch.clamp(pos - left + 1, min=0) + items[item, 2] * segment
        hi = torch.clamp(torch.clamp(torch.minimum(pos + right, seq_len), max=lo + segment), min=0)
        page_hi = torch.clamp((hi + block_size - 1) // block_size, max=max_blocks)
        for tile_g in hl.tile(group, block_size=GROUP_PAD):
            qh = q_grouped[tok, kvh, tile_g, :]  # [GROUP_PAD, head_size]
            m_i = hl.full([tile_g], float("-inf"), dtype=torch.float32)
            l_i = hl.zeros([tile_g], dtype=torch.float32)
            acc = hl.zeros([tile_g, head_size], dtype=torch.float32)
            for tile_p in hl.tile(lo // block_size, page_hi, block_size=block_p):
                k, v = _gather_kv(k_cache, v_cache, block_table[seq, tile_p], kvh, LARGE_CACHE)
                k_pos = (tile_p.index[:, None] * block_size + hl.arange(block_size)[None, :]).flatten(0, 1)
                ok = (k_pos >= lo) & (k_pos < hi)
                v = torch.where(ok[:, None], v, 0.0)  # keys past the sequence never reach a row (0 x NaN)
                s = _scores(qh, k, scale, softcap, SOFTCAP, EAGER)  # [GROUP_PAD, keys]
                s = torch.where(ok[None, :], s, float("-inf"))
                m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, v, EAGER)
            rows, lse_row = _finalize(m_i, l_i, acc)  # no visible key in the segment: out 0, lse -inf
            out_grouped[item, kvh, tile_g, :] = rows
            lse_grouped[item, kvh, tile_g] = lse_row


def merge_partials(
    part_out: torch.Tensor,  # [num_items, num_q_heads, head_size] fp32
    part_lse: torch.Tensor,  # [num_items, num_q_heads] fp32
    tokens: torch.Tensor,  # [num_decode] int32: the output row of each decode token
    item_start: torch.Tensor,  # [num_decode + 1] int32: token w owns items item_start[w]:item_start[w+1]
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    lse: torch.Tensor,  # [num_tokens, num_q_heads] fp32
) -> None:
    """out = sum_i e^(lse_i) out_i / sum_i e^(lse_i) over a token's segments; lse = log sum_i e^(lse_i)."""
    num_q_heads = hl.specialize(out.size(1))
    head_size = hl.specialize(out.size(2))
    for w in hl.grid(tokens.size(0)):
        tok = tokens[w].to(torch.int64)
        first = item_start[w]
        last = item_start[w + 1]
        for tile_h in hl.tile(num_q_heads):
            m_i = hl.full([tile_h], float("-inf"), dtype=torch.float32)
            l_i = hl.zeros([tile_h], dtype=torch.float32)
            acc = hl.zeros([tile_h, head_size], dtype=torch.float32)
            for tile_i in hl.tile(first, last):
                x = part_lse[tile_i, tile_h] * LOG2E  # [tile_i, tile_h]
                m_new = torch.maximum(m_i, torch.amax(x, 0))
                m_use = torch.where(m_new == float("-inf"), 0.0, m_new)
                wgt = torch.exp2(x - m_use[None, :])
                alpha = torch.exp2(m_i - m_use)
                l_i = l_i * alpha + torch.sum(wgt, 0)
                acc = acc * alpha[:, None] + torch.sum(wgt[:, :, None] * part_out[tile_i, tile_h, :], 0)
                m_i = m_new
            empty = l_i == 0.0  # no visible key
            bad = torch.sum(acc * 0.0, -1)  # 0, or NaN where the accumulator holds an inf or NaN
            inv = torch.where(empty, 0.0, 1.0 / torch.where(empty, 1.0, l_i)) + bad
            lse_row = torch.where(empty, float("-inf"), (m_i + torch.log2(torch.where(empty, 1.0, l_i))) * LN2 + bad)
            out[tok, tile_h, :] = torch.where(empty[:, None], 0.0, acc * inv[:, None]).to(out.dtype)
            lse[tok, tile_h] = lse_row


def prefill(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    items: torch.Tensor,  # [num_items, 3] int32: (sequence, first token, end token) of a query chunk
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    lse: torch.Tensor,  # [num_tokens, num_q_heads] fp32, natural log
    scale: float,
    softcap: float,
    left: int,
    right: int,
    SOFTCAP: hl.constexpr,
    LARGE_CACHE: hl.constexpr,
    EAGER: hl.constexpr,
) -> None:
    """One query chunk per program and query head: FlashAttention-2 over the chunk's visible
    pages, in Q tiles of an autotuned size.

    A KV tile inside the keys that every row of the Q tile sees skips the mask; the others (window
    edge, causal diagonal, the sequence's last page) apply it."""
    num_q_heads = hl.specialize(q.size(1))
    head_size = hl.specialize(q.size(2))
    block_size = hl.specialize(k_cache.size(1))
    num_kv_heads = hl.specialize(k_cache.size(2))
    max_blocks = block_table.size(1)
    group = num_q_heads // num_kv_heads
    block_m = hl.register_block_size(16, 128)
    block_p = hl.register_block_size(max(1, 16 // block_size), max(1, 256 // block_size))
    # Heads vary fastest: the programs of one chunk run together and share its K/V pages in L2.
    for h, item in hl.grid([num_q_heads, items.size(0)]):
        seq = items[item, 0]
        chunk_end = items[item, 2]
        kvh = h // group
        seq_len = seq_lens[seq]
        q_start = query_start_loc[seq]
        base = seq_len - (query_start_loc[seq + 1] - q_start) - q_start  # position = base + token
        for tile_m in hl.tile(items[item, 1], chunk_end, block_size=block_m):
            q_pos = base + tile_m.index
            first = base + tile_m.begin
            last = base + torch.clamp(chunk_end, max=tile_m.end) - 1
            lo = torch.clamp(first - left + 1, min=0)  # keys some row sees: [lo, hi)
            hi = torch.clamp(torch.minimum(last + right, seq_len), min=0)
            all_lo = last - left + 1  # keys every row sees: [all_lo, all_hi)
            all_hi = torch.minimum(first + right, seq_len)
            page_hi = torch.clamp((hi + block_size - 1) // block_size, max=max_blocks)
            qt = q[tile_m, h, :]  # [block_m, head_size]
            m_i = hl.full([tile_m], float("-inf"), dtype=torch.float32)
            l_i = hl.zeros([tile_m], dtype=torch.float32)
            acc = hl.zeros([tile_m, head_size], dtype=torch.float32)
            for tile_p in hl.tile(lo // block_size, page_hi, block_size=block_p):
                k, v = _gather_kv(k_cache, v_cache, block_table[seq, tile_p], kvh, LARGE_CACHE)
                s = _scores(qt, k, scale, softcap, SOFTCAP, EAGER)  # [block_m, keys]
                # The bound uses the unclipped tile end: a last tile's pages past page_hi load as zeros.
                tile_lo = tile_p.begin * block_size
                if (tile_lo < all_lo) | (tile_lo + block_p * block_size > all_hi):
                    k_pos = (tile_p.index[:, None] * block_size + hl.arange(block_size)[None, :]).flatten(0, 1)
                    in_seq = k_pos < seq_len
                    ok = in_seq[None, :] & (k_pos[None, :] > q_pos[:, None] - left) & (
                        k_pos[None, :] < q_pos[:, None] + right)
                    s = torch.where(ok, s, float("-inf"))
                    v = torch.where(in_seq[:, None], v, 0.0)  # keys past the sequence never reach a row
                m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, v, EAGER)
            rows, lse_row = _finalize(m_i, l_i, acc)
            out[tile_m, h, :] = rows.to(out.dtype)
            lse[tile_m, h] = lse_row


KERNELS = {"decode": decode_partials, "merge": merge_partials, "prefill": prefill}


@functools.lru_cache(maxsize=None)
def kernel(name: str, eager: bool, config_json: str | None):
    """``KERNELS[name]`` as a Helion kernel: reference mode (eager PyTorch) or compiled, with
    ``config_json`` (a ``helion.Config`` as JSON) or Helion's default config when None.

    Sizes that change per batch stay symbolic (``static_shapes=False``): a new batch reuses the
    compiled kernel; head counts, head size and page size are specialized in the kernels.
    """
    settings = {"static_shapes": False}
    if eager:
        settings["ref_mode"] = RefMode.EAGER
    if config_json is not None:
        settings["config"] = helion.Config.from_json(config_json)
    else:
        settings["autotune_effort"] = "none"
    return helion.kernel(KERNELS[name], **settings)
