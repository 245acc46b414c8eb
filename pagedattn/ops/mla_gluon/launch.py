"""Launcher of the Gluon MLA decode kernels (sm90): which calls they serve, grid, keyword arguments.

The default is the warp-specialized kernel (``kernel_ws.py``); the older one without warp
specialization (``kernel.py``, "sync") stays reachable through ``PAGEDATTN_MLA_GLUON`` for
same-run comparisons.

Compiled for sm90 only. The contract is ``launch_mla_decode``'s: one split writes out / lse,
several write the same ``[num_tokens, num_heads, num_splits, 512]`` fp32 partials (and lse)
that ``launch_merge_splits`` merges.

Triton's Gluon (``triton.experimental.gluon``) is imported only when a kernel is needed, so
that pagedattn imports where it is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedattn.ops.common.device import environ_value
from pagedattn.ops.common.gluon import (
    GLUON_DTYPES,
    GLUON_OFF,
    aligned,
    load_kernel,
    on_sm9x,
    required,
    unavailable_reason,
)
from pagedattn.ops.common.launching import launch
from pagedattn.ops.mla.launch import MLAConfig, MLAInputs, mla_strides, split_destination
from pagedattn.ops.split_kv.launch import launch_merge_splits

GLUON_ENV = "PAGEDATTN_MLA_GLUON"
GLUON_LATENT_DIM = 512
GLUON_ROPE_DIM = 64
GLUON_BLOCK_H = 64  # heads a CTA (the M of a warpgroup's wgmma); fewer heads are padded


@dataclass(frozen=True)
class GluonMLAConfig:
    """A CTA of 64 heads: ``tile_n`` keys a step, a ring of ``num_stages`` latent tiles, and
    which kernel runs them."""

    tile_n: int = 64
    num_stages: int = 2
    # the warp-specialized kernel (kernel_ws.py, the default): a copy warpgroup feeding two MMA
    # warpgroups through mbarriers, one computing the scores and half of O, the other the other
    # half; False: the older kernel (kernel.py), 8 warps copying and computing alike between CTA
    # barriers
    warp_specialized: bool = True
    # the warp-specialized kernel only: its copy warps complete each tile's copies through a
    # cp.async commit group (wait_group, fence) and arrive on the slot's ready barrier once, the
    # form Triton's ConSan (TRITON_INSTRUMENTATION_MODE=consan) can follow (one tile in flight);
    # the default, cp.async.mbarrier.arrive.noinc, lets the copy warps go on to the next slot
    # while a tile's copies land, and ConSan in triton 3.6 counts cp.async as done only at a
    # wait_group. The sync kernel waits on its groups already
    group_signal: bool = False

    def __post_init__(self):
        if self.group_signal and not self.warp_specialized:
            raise ValueError("group_signal: a signal of the warp-specialized kernel's ring")

    @property
    def label(self) -> str:
        ws = ("-ws" if self.warp_specialized else "") + ("-groups" if self.group_signal else "")
        return f"gluon-n{self.tile_n}-s{self.num_stages}{ws}"

    @property
    def num_warps(self) -> int:
        """The launch's num_warps: the default partition's warps (warpgroup 0 for the
        warp-specialized kernel, whose two worker partitions add 8 more)."""
        return 4 if self.warp_specialized else 8

    def mla_config(self) -> MLAConfig:
        """The portable kernel's config of the same rows and tiles (what the split rule reads)."""
        return MLAConfig(block_h=GLUON_BLOCK_H, block_q=1, tile_n=self.tile_n, value_split=1, num_warps=8,
                         num_stages=self.num_stages)


# the warp-specialized kernel, 64 keys a step, 2 stages: 230,528 B of shared memory, 168
# registers a thread at launch (setmaxnreg: 248 for warpgroup 0, 160 for warpgroup 1, 96 for the
# copy warps; at most 243 / 156 / 51 used), no spills (ptxas for sm_90a, bf16 and fp16). Same run
# on the H200 with FlashInfer 0.6.14 (128 heads, bf16, us, this / sync / FlashInfer): page 16,
# B=1 L=32768 37.7 / 42.4 / 40.2; 32 x 4096 83.2 / 106.0 / 78.8; 32 x 32768 550.5 / 723.1 /
# 562.8; 128 x 4096 286.8 / 373.2 / 275.4; page 64, 32 x 4096 82.8 / 102.8 / 81.0; 128 x 4096
# 290.7 / 368.9 / 281.3; 32 x 32768 561.8 / 724.7 / 594.7; 128 x 32768 2253.9 / 2836.1 /
# 2179.2: 1.12-1.31x the sync kernel at every point, 0.95-1.07x FlashInfer
GLUON_MLA_CONFIG = GluonMLAConfig()
# what PAGEDATTN_MLA_GLUON may ask for: 0 the portable kernel everywhere, 1 (or ws) the default
# config for every call the kernel serves, or a variant of the older kernel kept for same-run
# comparisons on the GPU: sync (64 keys, 2 stages, 8 warps, CTA barriers: 229,888 B, 217
# registers, no spills) and n32 (its 32 keys at 4 stages: 225,792 B, 200 registers, 0.74x its
# speed at B >= 32 on the H200); or groups, the default kernel with the ring signal ConSan
# follows, for a ConSan run (the default's 230,528 B, 168 registers at launch and setmaxnreg
# caps, no spills; its copy warps wait for each tile's copies); tests/test_gluon_mla.py
# compiles all four
GLUON_MLA_SYNC_CONFIG = GluonMLAConfig(warp_specialized=False)
GLUON_MLA_CONFIGS = {"1": GLUON_MLA_CONFIG, "ws": GLUON_MLA_CONFIG, "sync": GLUON_MLA_SYNC_CONFIG,
                     "n32": GluonMLAConfig(tile_n=32, num_stages=4, warp_specialized=False),
                     # the default with the ring's ready barriers signalled in the form ConSan follows
                     "groups": GluonMLAConfig(group_signal=True), "0": GLUON_OFF}


def gluon_kernel(config: GluonMLAConfig = GLUON_MLA_CONFIG):
    """The ``@gluon.jit`` kernel of ``config``, or None where this Triton has no usable Gluon."""
    if config.warp_specialized:
        return load_kernel("pagedattn.ops.mla_gluon.kernel_ws", "mla_decode_gluon_ws_kernel")
    return load_kernel("pagedattn.ops.mla_gluon.kernel", "mla_decode_gluon_kernel")


def gluon_mla_requested():
    """What ``PAGEDATTN_MLA_GLUON`` asks for, read at each call: a :class:`GluonMLAConfig`
    (``1`` or a variant's name), ``GLUON_OFF`` (``0``: the portable kernel), or None (unset or
    any other value: the rule of :func:`use_gluon_mla`)."""
    return environ_value(GLUON_ENV, GLUON_MLA_CONFIGS)


def gluon_mla_supported(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                        max_query_len: int) -> str | None:
    """None when the Gluon kernel can serve this ``mla_decode`` call, else the reason it cannot.

    It serves one query token a sequence, a 16-bit cache of q's dtype, 512 latent + 64 rope
    columns, pages of a power-of-2 size, any number of heads (64 a CTA), 16-byte aligned rows.
    Inputs are assumed to have passed ``mla_decode``'s checks.
    """
    reason = unavailable_reason(gluon_kernel())
    if reason is not None:
        return reason
    if max_query_len != 1:
        return f"max_query_len {max_query_len}: the Gluon kernel takes one query token a sequence"
    if q_nope.dtype not in GLUON_DTYPES:
        return f"q_nope dtype {q_nope.dtype}: the Gluon kernel takes bfloat16 or float16"
    if kv_cache.dtype != q_nope.dtype:
        return f"kv_cache dtype {kv_cache.dtype}: the Gluon kernel takes a cache of q's dtype (no fp8)"
    if q_nope.shape[-1] != GLUON_LATENT_DIM or q_pe.shape[-1] != GLUON_ROPE_DIM:
        return (f"latent {q_nope.shape[-1]} + rope {q_pe.shape[-1]}: the Gluon kernel takes "
                f"{GLUON_LATENT_DIM} + {GLUON_ROPE_DIM}")
    page_size = kv_cache.shape[1]
    if page_size & (page_size - 1):
        return f"kv_cache block_size {page_size}: the Gluon kernel takes a power of 2"
    for name, t, dims in (("q_nope", q_nope, (0, 1)), ("q_pe", q_pe, (0, 1)), ("kv_cache", kv_cache, (0, 1))):
        if not aligned(t, dims):
            return f"{name}: the Gluon kernel needs 16-byte aligned rows (strides {tuple(t.stride())})"
    return None


def use_gluon_mla(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  max_query_len: int) -> GluonMLAConfig | None:
    """The Gluon config of this ``mla_decode`` call, or None for the portable kernel.

    On a CUDA GPU of compute capability 9.x, for a call the kernel serves: the config
    ``PAGEDATTN_MLA_GLUON`` names, else (unset) the default one when the heads fill whole 64-row
    CTAs. At 128 heads, bf16, the default (the warp-specialized kernel) beat the portable kernel
    at every point timed in the same run on the H200 with FlashInfer 0.6.14 (B 1 / 32 / 128 x L
    4096 / 32768, pages 16 and 64: 1.5x at B=1, 1.9-2.3x at B >= 32) and the older sync kernel
    by 1.12-1.31x; fewer heads pad the CTA's rows and were not timed, so they keep the portable
    kernel unless asked.
    """
    asked = gluon_mla_requested()
    if asked is GLUON_OFF or not on_sm9x(q_nope):
        return None
    if asked is None:
        if q_nope.shape[1] % GLUON_BLOCK_H:
            return None
        asked = GLUON_MLA_CONFIG
    return asked if gluon_mla_supported(q_nope, q_pe, kv_cache, max_query_len) is None else None


def launch_mla_decode_gluon(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    x: MLAInputs,
    *,
    scale: float,
    kv_scale: torch.Tensor | None = None,
    config: GluonMLAConfig = GLUON_MLA_CONFIG,
    num_splits: int,
    partial_out: torch.Tensor | None = None,
    partial_lse: torch.Tensor | None = None,
) -> None:
    """``launch_mla_decode`` for the Gluon kernel (``gluon_mla_supported`` must have said None).

    ``config``: keys a step, stages and the kernel; a CTA is always 64 heads (12 warps for the
    warp-specialized kernel, 8 for the sync one). ``kv_scale`` must be None (no fp8 cache). ``partial_out``
    ``[num_tokens, num_heads, num_splits, 512]`` fp32 and ``partial_lse`` ``[num_tokens,
    num_heads, num_splits]`` fp32 are needed when ``num_splits > 1``.
    """
    if kv_scale is not None:
        raise ValueError("kv_scale: the Gluon MLA kernel takes no fp8 cache")
    kernel = required(gluon_kernel(config))
    q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc = x
    num_tokens, num_heads, _ = q_nope.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    dst, dst_lse, o_strides, l_strides = split_destination(out, lse, partial_out, partial_lse, num_splits)
    head_groups = -(-num_heads // GLUON_BLOCK_H)
    launch(kernel, (num_seqs * num_splits * head_groups,),
           out_ptr=dst, lse_ptr=dst_lse, q_nope_ptr=q_nope, q_pe_ptr=q_pe, kv_cache_ptr=kv_cache,
           block_table_ptr=block_table, seq_lens_ptr=seq_lens, query_start_loc_ptr=query_start_loc,
           # the portable kernel's strides, one parameter each: Gluon 3.6 fails to compile a bundle whose
           # member Triton specializes to 1 (the split partials' last stride)
           **mla_strides(q_nope, q_pe, kv_cache, block_table, o_strides, l_strides)._asdict(),
           scale=scale, num_heads=num_heads, num_seqs=num_seqs, num_tokens=num_tokens,
           num_blocks=kv_cache.shape[0], max_blocks_per_seq=block_table.shape[1], num_splits=num_splits,
           PAGE_SIZE=kv_cache.shape[1], TILE_N=config.tile_n, NUM_STAGES=config.num_stages,
           **({"GROUP_SIGNAL": config.group_signal} if config.warp_specialized else {}), num_warps=config.num_warps)
    if num_splits == 1:
        return
    launch_merge_splits(out, lse, partial_out, partial_lse, num_splits, pdl=False, num_warps=4)
