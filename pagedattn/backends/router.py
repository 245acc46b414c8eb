"""The ``router`` backend: three-path routing of a mixed batch (decode | extend | prefill, each on its kernel).

Sequences are ordered as ``[decode | extend | prefill | empty]``:

* decode, ``query_len == 1``: one ``paged_attention`` call whose plan takes the planner's
  decode rule (the split-KV path when the grid would not fill the GPU);
* extend, ``1 < query_len < seq_len``: the cached part of the context is gathered in chunks of
  at most ``chunk_tokens`` keys (summed over the extend sequences of a step) into a contiguous
  workspace laid out as pages; the new tokens attend each chunk without the causal rule (every
  cached key precedes them) with ``return_lse``, attend the new tokens (also gathered) with the
  caller's causal rule, and the parts are merged with :func:`pagedattn.merge_attention_states`.
  This is exact: the sink term joins one part only, and an ALiBi chunk's constant position
  offset is added back to its lse;
* prefill, ``query_len >= seq_len`` (``>`` only without the causal rule): one
  ``paged_attention`` call whose plan takes the planner's rule (the large-tile prefill kernel
  for long prompts);
* empty, ``query_len == 0``: nothing to compute.

A sliding window, prefix ranges or ALiBi-sqrt make a chunk's visibility depend on absolute
positions that a gathered chunk does not keep, so with those features (named in the plan's
``BackendConfig``) extend sequences run as one ``paged_attention`` call instead (exact too; a
window bounds the keys read anyway).

:func:`route_order` gives the permutation (and its inverse) of sequences and of tokens. The
router accepts a batch in any order and writes outputs back in the caller's token order; an
engine that reorders its batch once per step with ``route_order`` (and plans the reordered
batch) saves the two per-layer gathers (``RouteOrder.is_identity``).

Per-layer cost: ``plan`` reads the host metadata once and, given
``block_size``, also builds every device tensor of the step (sub-batch metadata, the extend
chunks' slot lists, block tables and plans, the gather workspace) and the token workspaces.
``forward`` then never synchronizes with the host nor copies host data to the device, so it can
be captured in a CUDA graph; with ``out=`` the extend chunks write their lse into the plan's
workspace (``lse_out=``), so only the decode/prefill launches' returned lse (when asked for) is
allocated. Without ``block_size`` the first layer's call builds the extend workspaces
(host-to-device copies).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedattn.backends.base import BackendConfig, BatchMetadata, features_of_call
from pagedattn.backends.triton_backend import TritonBackend, plan_for_config
from pagedattn.plan import host_list

__all__ = ["DEFAULT_CHUNK_TOKENS", "KINDS", "RouteOrder", "RouterPlan", "RouterBackend", "route_order"]

DEFAULT_CHUNK_TOKENS = 32768
KINDS = ("decode", "extend", "prefill", "empty")
# Features whose masks depend on absolute positions: extend runs unchunked with them.
POSITIONAL_FEATURES = frozenset({"window", "prefix", "alibi_sqrt"})


def _kind(query_len: int, seq_len: int) -> str:
    if query_len == 0:
        return "empty"
    if query_len == 1:
        return "decode"
    if query_len < seq_len:
        return "extend"
    return "prefill"


@dataclass
class RouteOrder:
    """The routed order of one batch.

    ``seq_perm[i]`` is the caller's index of the i-th routed sequence and ``seq_inv_perm[s]`` the
    routed position of the caller's sequence s (both ``[num_seqs]`` int64, on the device);
    ``token_perm`` / ``token_inv_perm`` ``[num_tokens]`` int64 are the same for tokens
    (``q_routed = q[token_perm]``, ``out = out_routed[token_inv_perm]``). ``counts`` and
    ``token_counts`` give the number of sequences / tokens of each kind in :data:`KINDS`.
    """

    seq_perm: torch.Tensor
    seq_inv_perm: torch.Tensor
    token_perm: torch.Tensor
    token_inv_perm: torch.Tensor
    seq_perm_host: list
    counts: dict
    token_counts: dict
    is_identity: bool

    def seq_range(self, kind: str) -> tuple[int, int]:
        start = sum(self.counts[k] for k in KINDS[: KINDS.index(kind)])
        return start, start + self.counts[kind]

    def token_range(self, kind: str) -> tuple[int, int]:
        start = sum(self.token_counts[k] for k in KINDS[: KINDS.index(kind)])
        return start, start + self.token_counts[kind]

    def query_start_loc(self, query_start_loc: list, kind: str | None = None) -> list:
        """The caller's host ``query_start_loc`` for the routed sequences (of ``kind`` only, if
        given), from 0."""
        s0, s1 = self.seq_range(kind) if kind else (0, len(self.seq_perm_host))
        out = [0]
        for s in self.seq_perm_host[s0:s1]:
            out.append(out[-1] + query_start_loc[s + 1] - query_start_loc[s])
        return out


def route_order(query_start_loc, seq_lens, *, device="cpu") -> RouteOrder:
    """Order sequences as ``[decode | extend | prefill | empty]`` (stable within each kind).

    Parameters
    ----------
    query_start_loc : ``[num_seqs + 1]`` ints (list or tensor; a device tensor costs a sync)
    seq_lens : ``[num_seqs]`` ints
    device : where the permutation tensors go.

    Examples
    --------
    >>> order = route_order([0, 40, 41, 46], [40, 1328, 18])
    >>> order.seq_perm_host            # decode (seq 1), extend (seq 2), prefill (seq 0)
    [1, 2, 0]
    """
    qsl = host_list(query_start_loc, "query_start_loc")
    lens = host_list(seq_lens, "seq_lens")
    if len(qsl) != len(lens) + 1:
        raise ValueError(f"query_start_loc has {len(qsl)} entries; expected len(seq_lens) + 1 = {len(lens) + 1}")
    kinds = [_kind(b - a, n) for a, b, n in zip(qsl[:-1], qsl[1:], lens)]
    perm = sorted(range(len(lens)), key=lambda s: KINDS.index(kinds[s]))
    counts = {k: kinds.count(k) for k in KINDS}
    token_counts = {k: sum(qsl[s + 1] - qsl[s] for s in range(len(lens)) if kinds[s] == k) for k in KINDS}
    token_perm = [t for s in perm for t in range(qsl[s], qsl[s + 1])]

    def t64(x):
        return torch.tensor(x, dtype=torch.int64, device=device)

    def inverse(p):
        return torch.argsort(t64(p))

    return RouteOrder(
        seq_perm=t64(perm), seq_inv_perm=inverse(perm), token_perm=t64(token_perm),
        token_inv_perm=inverse(token_perm),
        seq_perm_host=perm, counts=counts, token_counts=token_counts,
        is_identity=perm == list(range(len(perm))) and token_perm == list(range(len(token_perm))),
    )


@dataclass
class _Part:
    """One kind's sub-batch: routed sequence / token ranges, its metadata (routed order) and plan."""

    kind: str
    seqs: tuple
    tokens: tuple
    metadata: BatchMetadata
    plan: object = None
    chunks: "_ExtendChunks | None" = None


@dataclass
class _ChunkStep:
    """One gathered part of the extend sub-batch: key range ``[a, b)`` of each extend sequence."""

    ranges: list
    causal: bool  # the new-token part keeps the caller's causal rule; context chunks need none
    # made by _ExtendChunks.materialize:
    seq_lens_host: list = field(default_factory=list)
    src_slots: torch.Tensor | None = None  # [workspace tokens used] int64: cache slot of each
    block_table: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    alibi_shift: torch.Tensor | None = None  # [extend tokens] float32: seq_len - chunk end
    plan: object = None

    def pages(self, block_size: int) -> list:
        return [-(-(b - a) // block_size) for a, b in self.ranges]


@dataclass
class _ExtendChunks:
    """The chunked-context schedule of the extend sub-batch and its workspace (pages of the
    cache's block size, so the workspace is itself a paged cache with an arange block table)."""

    new_tokens: _ChunkStep
    context: list
    ws_k: torch.Tensor | None = None
    ws_v: torch.Tensor | None = None
    ws_out: torch.Tensor | None = None  # [extend tokens, num_q_heads, head_size]: one chunk's output
    ws_lse: torch.Tensor | None = None  # [2, extend tokens, num_q_heads] fp32: running and chunk lse
    key: tuple = ()

    def materialize(self, part: _Part, config: BackendConfig, block_size: int, cache_dtype: torch.dtype) -> None:
        """Device tensors, plans and workspaces (once per step: in plan, or by the first layer's call)."""
        from pagedattn.plan import plan_attention

        key = (block_size, cache_dtype)
        if self.key == key:
            return
        device = part.metadata.block_table.device
        md = part.metadata
        bt = md.block_table.long()
        steps = [self.new_tokens, *self.context]
        blocks = max(max(sum(st.pages(block_size)) for st in steps), 1)
        self.ws_k = torch.empty(blocks, block_size, config.num_kv_heads, config.head_size,
                                dtype=cache_dtype, device=device)
        self.ws_v = torch.empty_like(self.ws_k)
        self.ws_out = torch.empty(md.num_tokens, config.num_q_heads, config.head_size, dtype=config.dtype,
                                  device=device) if self.context else None
        self.ws_lse = torch.empty(2, md.num_tokens, config.num_q_heads, dtype=torch.float32, device=device)
        q_lens = md.query_lens_host
        for step in steps:
            seq_index, positions, pages = [], [], step.pages(block_size)
            table = torch.zeros(len(step.ranges), max(pages + [1]), dtype=torch.int32)
            offset = 0
            for s, ((a, b), p) in enumerate(zip(step.ranges, pages)):
                seq_index += [s] * (p * block_size)
                positions += list(range(a, b)) + [-1] * (p * block_size - (b - a))  # -1: page padding
                table[s, :p] = torch.arange(offset, offset + p, dtype=torch.int32)
                offset += p
            seq_index = torch.tensor(seq_index, dtype=torch.int64, device=device)
            pos = torch.tensor(positions, dtype=torch.int64, device=device)
            page_pos = pos.clamp(min=0)
            slots = bt[seq_index, page_pos // block_size] * block_size + page_pos % block_size
            step.src_slots = torch.where(pos >= 0, slots, torch.zeros_like(slots))
            step.block_table = table.to(device)
            step.seq_lens_host = [b - a for a, b in step.ranges]
            step.seq_lens = torch.tensor(step.seq_lens_host, dtype=torch.int32, device=device)
            shift = [float(n - b) for (a, b), n, ql in zip(step.ranges, md.seq_lens_host, q_lens) for _ in range(ql)]
            step.alibi_shift = torch.tensor(shift, dtype=torch.float32, device=device)
            step.plan = plan_attention(
                md.query_start_loc_host, step.seq_lens_host, num_q_heads=config.num_q_heads,
                num_kv_heads=config.num_kv_heads, head_size=config.head_size, device=device, dtype=config.dtype,
            )
        self.key = key


def _schedule_extend(q_lens: list, seq_lens: list, chunk_tokens: int) -> _ExtendChunks:
    """Split every extend sequence's cached keys ``[0, seq_len - query_len)`` into steps of at most
    ``chunk_tokens`` keys in all (filled greedily); the new tokens form one more part."""
    context = [n - q for q, n in zip(q_lens, seq_lens)]
    new = _ChunkStep(ranges=[(c, n) for c, n in zip(context, seq_lens)], causal=True)
    steps = []
    done = [0] * len(context)
    while any(d < c for d, c in zip(done, context)):
        budget = chunk_tokens
        ranges = []
        for s, c in enumerate(context):
            take = min(c - done[s], budget)
            ranges.append((done[s], done[s] + take))
            done[s] += take
            budget -= take
        steps.append(_ChunkStep(ranges=ranges, causal=False))
    return _ExtendChunks(new_tokens=new, context=steps)


@dataclass
class RouterPlan:
    """What :meth:`RouterBackend.plan` makes: the order and one :class:`_Part` per non-empty kind."""

    order: RouteOrder
    parts: dict
    config: BackendConfig
    workspaces: dict = field(default_factory=dict)

    def workspace(self, name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
        """A per-step buffer, made at the first request (``plan`` makes the usual ones)."""
        buf = self.workspaces.get(name)
        shape, device = tuple(shape), torch.device(device)
        same_device = buf is not None and buf.device.type == device.type and device.index in (None, buf.device.index)
        if not same_device or tuple(buf.shape) != shape or buf.dtype != dtype:
            buf = self.workspaces[name] = torch.empty(shape, dtype=dtype, device=device)
        return buf


def _sub_metadata(md: BatchMetadata, order: RouteOrder, kind: str) -> BatchMetadata:
    s0, s1 = order.seq_range(kind)
    idx = order.seq_perm[s0:s1].to(md.block_table.device)
    lens = [md.seq_lens_host[s] for s in order.seq_perm_host[s0:s1]]
    qsl = order.query_start_loc(md.query_start_loc_host, kind)
    q_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
    return BatchMetadata(
        block_table=md.block_table.index_select(0, idx),
        seq_lens=md.seq_lens.index_select(0, idx),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=md.query_start_loc.device),
        query_start_loc_host=qsl, seq_lens_host=lens,
        max_query_len=max(q_lens + [0]), max_seq_len=max(lens + [0]), backend="triton",
    )


def _run_paged(q, k_cache, v_cache, part: _Part, *, out, **features):
    from pagedattn.api import paged_attention

    md = part.metadata
    return paged_attention(
        q, k_cache, v_cache, md.block_table, md.seq_lens, md.query_start_loc,
        max_query_len=md.max_query_len, max_seq_len=md.max_seq_len, plan=part.plan, out=out, **features,
    )


def _run_extend_chunked(q, k_cache, v_cache, part: _Part, config: BackendConfig, *, out, lse_out=None, causal=True,
                        sinks=None, alibi_slopes=None, alibi_sqrt=False, **features):
    """The new tokens' part is attended into ``out``; each context chunk into the plan's output
    workspace, then merged into ``out`` in place (the merge reads a row before writing it)."""
    from pagedattn.api import merge_attention_states, paged_attention

    chunks = part.chunks
    chunks.materialize(part, config, k_cache.shape[1], k_cache.dtype)
    md = part.metadata
    num_kv_heads, head_size = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_size)
    v_flat = v_cache.view(-1, num_kv_heads, head_size)
    ws_k_flat = chunks.ws_k.view(-1, num_kv_heads, head_size)
    ws_v_flat = chunks.ws_v.view(-1, num_kv_heads, head_size)

    def attend(step: _ChunkStep, dest, lse_dest, **extra):
        # every cached key precedes the new tokens: a context chunk needs no causal rule
        extra["causal"] = causal if step.causal else False
        n = step.src_slots.shape[0]
        torch.index_select(k_flat, 0, step.src_slots, out=ws_k_flat[:n])
        torch.index_select(v_flat, 0, step.src_slots, out=ws_v_flat[:n])
        return paged_attention(
            q, chunks.ws_k, chunks.ws_v, step.block_table, step.seq_lens, md.query_start_loc,
            max_query_len=md.max_query_len, max_seq_len=max(step.seq_lens_host + [0]), plan=step.plan,
            out=dest, lse_out=lse_dest, alibi_slopes=alibi_slopes, alibi_sqrt=alibi_sqrt, **features, **extra,
        )

    # The sink joins exactly one part's denominator; merging then counts it once.
    lse_ws = chunks.ws_lse[:, : q.shape[0]]  # q matches the plan's config (checked in forward)
    acc = lse_out if lse_out is not None else lse_ws[0]  # the running lse: the caller's rows when it wants them
    _, acc_lse = attend(chunks.new_tokens, out, acc, sinks=sinks)
    ws_out = chunks.ws_out[: q.shape[0]] if chunks.context else None
    for step in chunks.context:
        o, lse = attend(step, ws_out, lse_ws[1])
        if alibi_slopes is not None:
            # the chunk's keys sit (seq_len - chunk end) further from the queries than the kernel saw
            lse.addcmul_(step.alibi_shift[:, None], alibi_slopes.float()[None, :], value=-1.0)
        _, acc_lse = merge_attention_states(o, lse, out, acc_lse, out=out, lse_out=acc_lse)
    return out, acc_lse


class RouterBackend(TritonBackend):
    """Decode / extend / prefill routed to their own paths (module docstring).

    ``plan`` options: ``chunk_tokens`` (default 32768), ``decode_path`` (``"auto"``,
    ``"split_kv"`` or ``"unified"``; default ``"auto"``, the planner's split-KV rule),
    ``block_size`` (the cache's page size: given, the extend workspaces are made in ``plan``;
    otherwise by the first layer's call), ``sliding_window`` (a planning hint).
    """

    name = "router"  # head sizes and devices: the Triton kernels', as TritonBackend's

    def _plan_state(self, md: BatchMetadata, config: BackendConfig, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                    decode_path: str = "auto", block_size: int | None = None, sliding_window: int | None = None):
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
        device = md.block_table.device
        order = route_order(md.query_start_loc_host, md.seq_lens_host, device=device)
        parts = {}
        for kind in ("decode", "extend", "prefill"):
            if order.counts[kind] == 0:
                continue
            sub = _sub_metadata(md, order, kind)
            part = _Part(kind, order.seq_range(kind), order.token_range(kind), sub)
            chunked = kind == "extend" and not (config.features & POSITIONAL_FEATURES)
            if chunked:
                part.chunks = _schedule_extend(sub.query_lens_host, sub.seq_lens_host, chunk_tokens)
                if block_size is not None:
                    part.chunks.materialize(part, config, block_size, config.cache_dtype)
            else:
                part.plan = plan_for_config(
                    sub.query_start_loc_host, sub.seq_lens_host, config,
                    path=decode_path if kind == "decode" else "auto", sliding_window=sliding_window,
                )
            parts[kind] = part
        plan = RouterPlan(order=order, parts=parts, config=config)
        if not order.is_identity:  # the per-layer gathers' buffers
            shape = (md.num_tokens, config.num_q_heads, config.head_size)
            plan.workspace("q", shape, config.dtype, device)
            plan.workspace("out", shape, config.dtype, device)
        return plan

    def forward(self, q, k_cache, v_cache, metadata, *, out=None, return_lse=False, prefix_ranges=None, **features):
        self._check_metadata(metadata)
        plan: RouterPlan = metadata.state
        cfg = plan.config
        if q.dtype != cfg.dtype or q.shape[1] != cfg.num_q_heads or q.shape[2] != cfg.head_size:
            # the plan's workspaces are shaped by its config
            raise ValueError(f"q ({q.dtype}, {q.shape[1]} heads of {q.shape[2]}) does not match the plan's config "
                             f"({cfg.dtype}, {cfg.num_q_heads} heads of {cfg.head_size}); plan with q's shape")
        order = plan.order
        if q.shape[0] != metadata.num_tokens:
            raise ValueError(f"q has {q.shape[0]} tokens; the plan's batch has {metadata.num_tokens}")
        if features_of_call(prefix_ranges=prefix_ranges, **features) & POSITIONAL_FEATURES:
            extend = plan.parts.get("extend")
            if extend is not None and extend.chunks is not None:
                raise ValueError(
                    "this call uses a sliding window, prefix_ranges or alibi_sqrt, but the router's plan was made "
                    "for a BackendConfig without them (its extend sequences are chunked); plan with those features"
                )
        if out is None:
            out = torch.empty_like(q)
        if order.is_identity:
            q_r, out_r = q, out
        else:  # the caller's token order: gather q into, and the output from, the plan's workspaces
            q_r = torch.index_select(q, 0, order.token_perm, out=plan.workspace("q", q.shape, q.dtype, q.device))
            out_r = plan.workspace("out", q.shape, q.dtype, q.device)
        lse_r = None
        if return_lse:
            lse_shape, f32 = q.shape[:2], torch.float32
            lse_r = (torch.empty(lse_shape, dtype=f32, device=q.device) if order.is_identity
                     else plan.workspace("lse", lse_shape, f32, q.device))
        for kind, part in plan.parts.items():
            t0, t1 = part.tokens
            if t1 == t0:
                continue
            kw = dict(features)
            if prefix_ranges is not None:
                s0, s1 = part.seqs
                if order.is_identity:
                    kw["prefix_ranges"] = prefix_ranges[s0:s1]
                else:
                    buf = plan.workspace(f"prefix_{kind}", (s1 - s0, *prefix_ranges.shape[1:]), prefix_ranges.dtype,
                                         prefix_ranges.device)
                    kw["prefix_ranges"] = torch.index_select(prefix_ranges, 0, order.seq_perm[s0:s1], out=buf)
            lse_part = lse_r[t0:t1] if return_lse else None  # each part writes its rows' lse in place
            if kind == "extend" and part.chunks is not None:
                _run_extend_chunked(q_r[t0:t1], k_cache, v_cache, part, plan.config, out=out_r[t0:t1],
                                    lse_out=lse_part, **kw)
            else:
                _run_paged(q_r[t0:t1], k_cache, v_cache, part, out=out_r[t0:t1], lse_out=lse_part, **kw)
        if not order.is_identity:
            out.index_copy_(0, order.token_perm, out_r)
            if return_lse:
                lse = torch.empty_like(lse_r)  # returned to the caller: not a workspace
                lse.index_copy_(0, order.token_perm, lse_r)
                lse_r = lse
        return (out, lse_r) if return_lse else out
