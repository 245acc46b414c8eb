"""Multi-head latent attention (MLA) decode and the latent-cache write: validate, then launch.

The cache holds one row per token, ``[c_kv | k_pe]`` (DeepSeek-V2/V3: 512 latent + 64 rope =
576), shared by every head. Decode works in the latent space ("absorbed" queries); prefill
decompresses the latent and takes the ordinary attention path.
"""

from __future__ import annotations

import functools

import torch

from pagedattn._checks import (
    check_fp8_cache,
    FLOAT_DTYPES,
    FP8_DTYPES,
    check_optional_int,
    check_paged_metadata,
    check_runs_on,
    check_scale_arg,
    check_shape,
    check_tensor,
    interpreted,
    refuse_autograd,
)
from pagedattn.ops.mla.launch import (
    MLA_MAX_QUERY_LEN,
    MLAConfig,
    MLAInputs,
    launch_mla_decode,
    launch_write_mla_kv,
)
from pagedattn.conversions import rounded_into, scale_tensor
from pagedattn.ops.common.device import interpreter_on
from pagedattn.ops.common.launching import Tapes, call_context, scalar_or_tensor
from pagedattn.ops.common.target import target_props
from pagedattn.ops.mla.kernel import mla_decode_kernel
from pagedattn.ops.mla_gluon.launch import gluon_mla_requested, launch_mla_decode_gluon, use_gluon_mla
from pagedattn.plan import choose_mla_splits, num_sms, resolve_mla_config
from pagedattn.plan.workspace import split_partials

__all__ = ["mla_decode", "write_mla_kv"]

MAX_LATENT_DIM = 512
MAX_ROPE_DIM = 128


_INTERPRETED = interpreted(mla_decode_kernel)  # the kernels were made for Triton's interpreter

def check_mla_dims(latent_name: str, latent_dim: int, rope_name: str, rope_dim: int) -> None:
    """Raise ValueError naming the argument when the kernels have no tiles for these widths."""
    for name, what, dim, top in ((latent_name, "latent", latent_dim, MAX_LATENT_DIM),
                                 (rope_name, "rope", rope_dim, MAX_ROPE_DIM)):
        if not (16 <= dim <= top) or dim % 16:
            raise ValueError(f"{name}: {what} dim {dim} is not supported; use a multiple of 16 from 16 to {top}")


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    kv_scale: float | torch.Tensor | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """MLA decode (and speculative decode, up to 8 query tokens a sequence) over a paged latent cache.

    ``s = scale * (q_nope . c_kv + q_pe . k_pe)`` for every head against the shared latent row
    ``[c_kv | k_pe]`` of each key; ``out = softmax(s) c_kv``. Query j of sequence s sits at
    position ``seq_lens[s] - query_len_s + j`` and sees keys ``0 .. position`` (causal). The new
    tokens' latents must already be in the cache (see :func:`write_mla_kv`).

    Parameters
    ----------
    q_nope : ``[num_tokens, num_heads, latent_dim]`` float16, bfloat16 or float32
        The query absorbed into the latent space (``latent_dim`` 512 for DeepSeek-V2/V3).
    q_pe : ``[num_tokens, num_heads, rope_dim]`` q_nope's dtype
        The rotary part of the query (``rope_dim`` 64).
    kv_cache : ``[num_blocks, block_size, latent_dim + rope_dim]`` q_nope's dtype or float8_e4m3fn
        Per token ``[c_kv | k_pe]``; for fp8 the value is ``kv_cache * kv_scale``.
    block_table : ``[num_seqs, max_blocks_per_seq]`` int32
    seq_lens : ``[num_seqs]`` int32
        KV length of each sequence, new tokens included.
    query_start_loc : ``[num_seqs + 1]`` int32
        Sequence s owns ``q_nope[query_start_loc[s]:query_start_loc[s+1]]``; at most 8 tokens.
    scale : float
        Score scale (DeepSeek: ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``, times the YaRN
        factor where used).
    max_query_len, max_seq_len : int, optional
        Host-side maxima; with both given (or ``num_splits`` and ``max_query_len``) the call never
        synchronizes with the host.
    kv_scale : float or 1-element float32 tensor, optional
        Dequantization scale of an fp8 cache (default 1.0; ignored for other caches).
    num_splits : int, optional
        Split each sequence's keys into this many segments merged in order (default: enough to
        fill the GPU, see :mod:`pagedattn.plan.mla`).
    out : ``[num_tokens, num_heads, latent_dim]`` q_nope's dtype, optional
        Written in place and returned.
    return_lse : bool
        Also return lse ``[num_tokens, num_heads]`` float32 (natural log; -inf for a row that
        sees no key, whose output is 0).

    Returns
    -------
    out, or ``(out, lse)`` when ``return_lse``.

    Notes
    -----
    On a GPU of compute capability 9.x, the calls the Gluon kernel of
    :mod:`pagedattn.ops.mla_gluon` serves (one query token a sequence, a bf16 / fp16 cache, 512
    + 64 columns) and whose heads fill 64-row CTAs go to it (warp-specialized), with the same
    split and merge; ``PAGEDATTN_MLA_GLUON=0`` keeps the portable kernel, ``=1`` takes Gluon for
    fewer heads too, ``=sync`` / ``=n32`` the older Gluon kernel (same-run comparisons).

    Examples
    --------
    >>> out = mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc,
    ...                  scale=192 ** -0.5, max_query_len=1, max_seq_len=4096)
    """
    return _mla_decode(
        q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, scale=scale,
        max_query_len=max_query_len, max_seq_len=max_seq_len, kv_scale=kv_scale, num_splits=num_splits,
        out=out, return_lse=return_lse,
    )


def _mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, *, scale, max_query_len=None,
                max_seq_len=None, kv_scale=None, num_splits=None, out=None, return_lse=False,
                config: MLAConfig | None = None):
    """:func:`mla_decode` with an optional fixed :class:`MLAConfig` (tests and sweeps; not public API).

    Split count: ``num_splits`` if given, else ``config.num_splits``, else the split rule.
    """
    key = None
    if (config is None and isinstance(q_nope, torch.Tensor) and q_nope.is_cuda and max_query_len is not None
            and (max_seq_len is not None or num_splits is not None)):
        # The thin path: a call whose scalars and layouts match an earlier, checked one replays its launches.
        key = (scale, max_query_len, max_seq_len, scalar_or_tensor(kv_scale), num_splits, return_lse,
               gluon_mla_requested(), *call_context(q_nope))
        if key in _TAPES and q_nope.dim() == 3:
            if out is None:
                out = torch.empty(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
            lse = torch.empty(q_nope.shape[:2], dtype=torch.float32, device=q_nope.device) if return_lse else None
            binds = (q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, out, lse,
                     kv_scale if isinstance(kv_scale, torch.Tensor) else None)
            if _TAPES.replay(key, binds):
                return (out, lse) if return_lse else out
    check_tensor("q_nope", q_nope, ndim=3, dtypes=FLOAT_DTYPES)
    check_runs_on("q_nope", q_nope, _INTERPRETED)
    device = q_nope.device
    num_tokens, num_heads, latent_dim = q_nope.shape
    check_tensor("q_pe", q_pe, ndim=3, dtypes=(q_nope.dtype,), device=device)
    check_shape("q_pe", q_pe, (num_tokens, num_heads, None))
    rope_dim = q_pe.shape[2]
    check_mla_dims("q_nope", latent_dim, "q_pe", rope_dim)
    if num_heads < 1:
        raise ValueError("q_nope must have at least one head (dim 1)")
    check_tensor("kv_cache", kv_cache, ndim=3, dtypes=(q_nope.dtype, *FP8_DTYPES), device=device)
    check_shape("kv_cache", kv_cache, (None, None, latent_dim + rope_dim))
    check_fp8_cache("kv_cache", kv_cache, device)
    refuse_autograd("mla_decode", q_nope=q_nope, q_pe=q_pe, kv_cache=kv_cache)
    if kv_cache.shape[1] < 1:
        raise ValueError("kv_cache block_size (dim 1) must be >= 1")
    num_seqs = check_paged_metadata(block_table, seq_lens, query_start_loc, device)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    check_optional_int("max_query_len", max_query_len, minimum=0)
    check_optional_int("max_seq_len", max_seq_len, minimum=0)
    check_optional_int("num_splits", num_splits, minimum=1)
    check_scale_arg("kv_scale", kv_scale, device)
    if out is not None:
        check_tensor("out", out, dtypes=(q_nope.dtype,), device=device)
        check_shape("out", out, (num_tokens, num_heads, latent_dim))
    if max_query_len is not None and max_query_len > MLA_MAX_QUERY_LEN:
        raise ValueError(f"max_query_len {max_query_len} exceeds {MLA_MAX_QUERY_LEN}: mla_decode serves decode "
                         "and speculative steps; prefill takes the decompressed attention path")

    if max_query_len is None:
        # One host sync, documented: pass max_query_len to avoid it.
        lens = query_start_loc[1:] - query_start_loc[:-1]
        max_query_len = int(lens.max().item()) if num_seqs > 0 else 0
        if max_query_len > MLA_MAX_QUERY_LEN:
            raise ValueError(f"query_start_loc gives a query of {max_query_len} tokens; mla_decode takes at most "
                             f"{MLA_MAX_QUERY_LEN} (prefill takes the decompressed attention path)")
    fp8 = kv_cache.dtype in FP8_DTYPES
    if q_nope.dtype == torch.bfloat16 and interpreter_on():
        # The interpreter's bf16 tl.dot multiplies bit patterns: compute in fp32 and round once.
        res = _mla_decode(q_nope.float(), q_pe.float(), kv_cache if fp8 else kv_cache.float(), block_table, seq_lens,
                          query_start_loc, scale=scale, max_query_len=max_query_len, max_seq_len=max_seq_len,
                          kv_scale=kv_scale, num_splits=num_splits, return_lse=return_lse, config=config)
        return rounded_into(res, out, q_nope)
    target = target_props(device)
    gluon = use_gluon_mla(q_nope, q_pe, kv_cache, max_query_len) if config is None else None  # sm90 kernel
    config = resolve_mla_config(gluon.mla_config() if gluon else config, num_heads, max_query_len,
                                (latent_dim + rope_dim) * q_nope.element_size(), fp8, num_seqs=num_seqs,
                                sms=num_sms(device), max_shared=target.max_shared, max_rows=target.mla_max_rows)
    if num_splits is None:
        num_splits = config.num_splits
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item()) if num_seqs > 0 else 0
        num_splits = choose_mla_splits(num_seqs, num_heads, max_query_len, max_seq_len, config, num_sms(device))

    if out is None:
        out = torch.empty(num_tokens, num_heads, latent_dim, dtype=q_nope.dtype, device=device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=device) if return_lse else None
    partial_out = partial_lse = None
    if num_splits > 1 and num_tokens > 0:
        partial_out, partial_lse = split_partials(num_tokens, num_heads, num_splits, latent_dim, device)
    run = functools.partial(
        launch_mla_decode_gluon if gluon else launch_mla_decode, out, lse,
        MLAInputs(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc),
        scale=float(scale), kv_scale=scale_tensor(kv_scale, device) if fp8 else None, config=gluon or config,
        num_splits=num_splits, partial_out=partial_out, partial_lse=partial_lse,
    )
    if key is None:
        run()
    else:  # recorded, so that the next call with this layout replays it
        _TAPES.record(key, (q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, out, lse,
                            kv_scale if isinstance(kv_scale, torch.Tensor) else None), run)
    return (out, lse) if return_lse else out


_TAPES = Tapes(kept=32)  # recorded mla_decode calls (each keeps its split workspace)


def write_mla_kv(
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_scale: float | torch.Tensor | None = None,
) -> None:
    """Scatter new tokens' latents ``[c_kv | k_pe]`` into the paged MLA cache, in place.

    Parameters
    ----------
    c_kv : ``[num_tokens, latent_dim]`` float16, bfloat16 or float32
    k_pe : ``[num_tokens, rope_dim]`` c_kv's dtype
    kv_cache : ``[num_blocks, block_size, latent_dim + rope_dim]`` c_kv's dtype or float8_e4m3fn
        For fp8 the stored value is ``x / kv_scale``, rounded to nearest even and saturated at
        +-448.
    slot_mapping : ``[num_tokens]`` int32 or int64
        ``slot = block * block_size + offset``; a slot of -1 (or outside the cache) skips the token.
    kv_scale : float or 1-element float32 tensor, optional
        Quantization scale of an fp8 cache (default 1.0; ignored for other caches).

    Examples
    --------
    >>> write_mla_kv(c_kv, k_pe, kv_cache, slot_mapping)
    """
    check_tensor("c_kv", c_kv, ndim=2, dtypes=FLOAT_DTYPES)
    check_runs_on("c_kv", c_kv, _INTERPRETED)
    device = c_kv.device
    num_tokens, latent_dim = c_kv.shape
    check_tensor("k_pe", k_pe, ndim=2, dtypes=(c_kv.dtype,), device=device)
    check_shape("k_pe", k_pe, (num_tokens, None))
    rope_dim = k_pe.shape[1]
    check_mla_dims("c_kv", latent_dim, "k_pe", rope_dim)
    check_tensor("kv_cache", kv_cache, ndim=3, dtypes=(c_kv.dtype, *FP8_DTYPES), device=device)
    check_shape("kv_cache", kv_cache, (None, None, latent_dim + rope_dim))
    check_fp8_cache("kv_cache", kv_cache, device)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int32, torch.int64), device=device)
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_scale_arg("kv_scale", kv_scale, device)
    fp8 = kv_cache.dtype in FP8_DTYPES
    launch_write_mla_kv(c_kv, k_pe, kv_cache, slot_mapping, scale_tensor(kv_scale, device) if fp8 else None)
