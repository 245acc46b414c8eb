"""The argument bundles of the attention kernels, and the one place that builds them from a call.

A bundle is a NamedTuple of what travels together: the queries and the batch metadata
(``Queries``), the paged KV source (``PagedKV``), the score modifiers (``ScoreMods``), the rows
a kernel writes (``Output``, ``Partials``). Triton 3.6 takes tuples as kernel and @triton.jit
arguments: a helper takes ``kv`` as one argument and reads ``kv.k_cache``; the compiled kernel
receives the members as separate parameters, specialized exactly as if each were passed alone
(16-byte aligned pointers, strides of 1 or multiples of 16), so bundling changes no compiled
code. A member that is None is a compile-time None: a kernel asks ``mods.sinks is not None``
where it once took a USE_SINKS flag, and no flag can disagree with its tensor.

Two kinds of value stay out of the runtime bundles:

* the sizes that change from one batch to the next (``Sizes``: num_seqs, num_tokens, ...) are
  kernel parameters of their own, listed in ``do_not_specialize``. Triton specializes a
  tuple's members whatever ``do_not_specialize`` says (an int equal to 1 becomes a constant, a
  multiple of 16 gets a divisibility hint), so a size inside a bundle would compile a new kernel
  for new batch shapes. Kernels pack them into a ``Sizes`` as their first statement;
* compile-time shapes and modes travel as one constexpr NamedTuple, ``Config``, read as
  ``CFG.TILE_N``.

Bundles hold tensors, ints, floats and None only, one level deep: a recorded launch
(``launching.Tape``) re-binds a bundle's tensors on replay.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from pagedattn.ops.common.host_math import next_power_of_2
from pagedattn.ops.common.offsets import needs_int64_offsets
from pagedattn.ops.common.tiles import Tiles

Tensor = Optional[torch.Tensor]


@dataclass
class AttentionArgs:
    """Validated inputs of one attention call, as the launchers of every path take them."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor | None
    seq_lens: torch.Tensor | None
    query_start_loc: torch.Tensor
    scale: float
    causal: bool
    sliding_window: int  # 0: none
    softcap: float  # 0: none
    alibi_mode: int
    alibi_slopes: torch.Tensor | None
    sinks: torch.Tensor | None
    prefix_ranges: torch.Tensor | None
    k_scale: torch.Tensor | None  # [1] fp32 for an fp8 cache
    v_scale: torch.Tensor | None
    max_q_len_served: int = 2**31 - 1  # longer sequences go to the prefill kernel

    def score_modifiers(self) -> list[str]:
        """The fields that change the scores beyond ``scale * q.k`` and the causal mask and are on
        (not None, 0 or False). Every field not in ``_INPUT_FIELDS`` counts, so a modifier added
        here is seen by the kernels that serve none (the Gluon prefill) without touching them."""
        return [f.name for f in dataclasses.fields(self)
                if f.name not in _INPUT_FIELDS and _on(getattr(self, f.name))]


# AttentionArgs' fields that are the call's tensors, its scale and mask and the fp8 scales, not
# score modifiers
_INPUT_FIELDS = frozenset({"q", "k_cache", "v_cache", "block_table", "seq_lens", "query_start_loc", "scale",
                           "causal", "k_scale", "v_scale", "max_q_len_served"})


def _on(value) -> bool:
    return value is not None and not (isinstance(value, (bool, int, float)) and not value)


class Queries(NamedTuple):
    """The queries and the metadata that places them in the batch."""

    q: torch.Tensor  # [num_tokens, num_q_heads, head_size]
    stride_q_t: int
    stride_q_h: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: Tensor  # [num_seqs] int32 KV lengths; contiguous prefill: cu_seqlens_k [num_seqs + 1]


class PagedKV(NamedTuple):
    """The KV source: the paged cache and its block table, or (block_table None, stride_*_b 0)
    contiguous ``[total_k, num_kv_heads, head_size]`` K/V whose rows are the ``*_s`` stride apart."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor
    block_table: Tensor  # [num_seqs, max_blocks_per_seq] int32
    stride_k_b: int
    stride_k_s: int
    stride_k_h: int
    stride_v_b: int
    stride_v_s: int
    stride_v_h: int
    stride_bt_s: int


class ScoreMods(NamedTuple):
    """What changes the scores ``scale * q.k`` beyond the causal mask; None: not used.
    (The sliding window and the number of prefix ranges are sizes, see the module docstring.)
    The members' order is the kernels' parameter order, which steers ptxas's register choices a
    little: this one compiles to the register counts of the unbundled kernels."""

    alibi_slopes: Tensor  # [num_q_heads] fp32
    sinks: Tensor  # [num_q_heads] fp32
    prefix_ranges: Tensor  # [num_seqs, R, 2] int32
    k_scale: Tensor  # [1] fp32 for an fp8 cache
    v_scale: Tensor
    stride_pr_s: int
    stride_pr_r: int
    scale: float
    softcap: Optional[float]  # s = softcap * tanh(s / softcap)


class Output(NamedTuple):
    """Final rows: out [num_tokens, num_q_heads, head_size]; lse [num_tokens, num_q_heads] fp32 or None."""

    out: torch.Tensor
    lse: Tensor
    stride_o_t: int
    stride_o_h: int
    stride_lse_t: int
    stride_lse_h: int


class Partials(NamedTuple):
    """Per-split rows: out [tokens, heads, splits, head_size] fp32, lse [tokens, heads, splits] fp32."""

    out: torch.Tensor
    lse: Tensor
    stride_po_t: int
    stride_po_h: int
    stride_po_s: int
    stride_pl_t: int
    stride_pl_h: int
    stride_pl_s: int


class Sizes(NamedTuple):
    """The sizes that vary per batch (kernel parameters, never specialized)."""

    num_seqs: int
    num_tokens: int
    num_blocks: int
    max_blocks_per_seq: int
    num_prefix_ranges: int
    sliding_window: int  # 0: none


SIZES = list(Sizes._fields)  # for do_not_specialize


class Config(NamedTuple):
    """The compile-time shape and modes of a launch (one constexpr argument, ``CFG``)."""

    NUM_QUERIES_PER_KV: int
    HEAD_SIZE: int
    HEAD_SIZE_PAD: int
    HEAD_SIZE_V: int  # values may be narrower or wider than queries/keys (MLA prefill: 192 / 128)
    HEAD_SIZE_V_PAD: int
    PAGE_SIZE: int
    BLOCK_Q: int  # query tokens of a program (the prefill kernel: BLOCK_M of one head)
    BLOCK_M: int
    TILE_N: int
    IS_CAUSAL: bool
    ALIBI_MODE: int
    DOT_PRECISION: Optional[str]  # None: the backend's default (16-bit operands)
    LARGE_CACHE: bool  # a K/V offset reaches 2**31 elements: int64 offsets
    POSITIVE_SCALE: bool


def dot_precision(dtype: torch.dtype) -> str | None:
    """``tl.dot``'s input precision for operands of ``dtype``: "ieee" for fp32 (exact products,
    no TF32); None otherwise, the backend's default ("tf32" on NVIDIA, "ieee" on AMD), which
    16-bit operands ignore. (gfx950 and gfx1100 refuse an explicit "tf32".)"""
    return "ieee" if dtype == torch.float32 else None


def output_rows(out: torch.Tensor, lse: torch.Tensor | None) -> Output:
    return Output(out, lse, out.stride(0), out.stride(1),
                  lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0)


def partial_rows(partial_out: torch.Tensor, partial_lse: torch.Tensor) -> Partials:
    po, pl = partial_out.stride(), partial_lse.stride()
    return Partials(partial_out, partial_lse, po[0], po[1], po[2], pl[0], pl[1], pl[2])


def score_mods_of(a: AttentionArgs) -> ScoreMods:
    """The call's score modifiers as the kernels take them (a soft cap of 0 becomes None: off)."""
    pr = a.prefix_ranges
    return ScoreMods(a.alibi_slopes, a.sinks, pr, a.k_scale, a.v_scale,
                     pr.stride(0) if pr is not None else 0, pr.stride(1) if pr is not None else 0,
                     a.scale, a.softcap if a.softcap > 0 else None)


def kernel_args(a: AttentionArgs, tiles: Tiles, *, contiguous_kv: torch.Tensor | None = None) -> dict:
    """Keyword arguments of the attention kernels of every path: the bundles, the sizes, CFG and
    the launch options. ``contiguous_kv``: cu_seqlens_k when ``a.k_cache`` / ``a.v_cache`` are
    contiguous ``[total_k, num_kv_heads, head_size]`` K/V (the prefill kernel only)."""
    q, k, v = a.q, a.k_cache, a.v_cache
    num_seqs = a.query_start_loc.shape[0] - 1
    if contiguous_kv is None:
        kv = PagedKV(k, v, a.block_table, *k.stride()[:3], *v.stride()[:3], a.block_table.stride(0))
        queries = Queries(q, q.stride(0), q.stride(1), a.query_start_loc, a.seq_lens)
        num_seqs = a.seq_lens.shape[0]
        num_blocks, page_size, num_kv_heads, max_blocks = k.shape[0], k.shape[1], k.shape[2], a.block_table.shape[1]
    else:
        kv = PagedKV(k, v, None, 0, k.stride(0), k.stride(1), 0, v.stride(0), v.stride(1), 0)
        queries = Queries(q, q.stride(0), q.stride(1), a.query_start_loc, contiguous_kv)
        num_blocks, page_size, num_kv_heads, max_blocks = 1, 1, k.shape[1], 1
    pr = a.prefix_ranges
    sizes = Sizes(num_seqs, q.shape[0], num_blocks, max_blocks, pr.shape[1] if pr is not None else 0,
                  a.sliding_window)
    cfg = Config(
        NUM_QUERIES_PER_KV=q.shape[1] // num_kv_heads,
        HEAD_SIZE=q.shape[2],
        HEAD_SIZE_PAD=max(16, next_power_of_2(q.shape[2])),
        HEAD_SIZE_V=v.shape[-1],
        HEAD_SIZE_V_PAD=max(16, next_power_of_2(v.shape[-1])),
        PAGE_SIZE=page_size,
        BLOCK_Q=tiles.block_q,
        BLOCK_M=tiles.block_m,
        TILE_N=tiles.tile_n,
        IS_CAUSAL=a.causal,
        ALIBI_MODE=a.alibi_mode,
        DOT_PRECISION=dot_precision(q.dtype),
        LARGE_CACHE=needs_int64_offsets(k, v),
        POSITIVE_SCALE=a.scale > 0,
    )
    budget = {"maxnreg": tiles.max_registers} if tiles.max_registers else {}
    return dict(queries=queries, kv=kv, mods=score_mods_of(a), **sizes._asdict(), CFG=cfg,
                num_warps=tiles.num_warps, num_stages=tiles.num_stages, **budget)
