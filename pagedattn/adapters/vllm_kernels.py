"""vLLM's ahead-of-time compiled attention kernels on pagedattn's own cache tensors.

vLLM's wheel ships two kernels that need no compile on first use, both built for Hopper (sm90)
only:

* FlashAttention-3 (``vllm.vllm_flash_attn``, extension ``_vllm_fa3_C``):
  ``flash_attn_varlen_func(..., fa_version=3)`` with a paged KV cache (:func:`fa3_call`).
  pagedattn's cache ``[num_blocks, block_size, num_kv_heads, head_size]`` is FA's paged layout,
  so K and V go in as they are; ``block_table`` is FA's page table, ``seq_lens`` its
  ``seqused_k`` and ``query_start_loc`` its ``cu_seqlens_q``. The call is the one vLLM's
  FLASH_ATTN backend makes per layer (``vllm/v1/attention/backends/flash_attn.py``), with the
  scheduler metadata its metadata builder computes once per step (``get_scheduler_metadata``)
  made here, outside the timed call, and the split cap it passes under full CUDA graphs
  (``FA3_GRAPH_MAX_SPLITS``). Windows become FA's ``window_size`` (:func:`fa_window`),
  sinks FA3's ``s_aux`` (bf16, at most 64 query heads).
* FlashMLA dense decode (``vllm._flashmla_C`` through vLLM's copy of FlashMLA's wrappers,
  ``vllm/third_party/flashmla/flash_mla_interface.py``): ``flash_mla_with_kvcache`` on
  pagedattn's ``[num_blocks, 64, 576]`` latent cache viewed with one KV head (:func:`flashmla_call`),
  as vLLM's FLASHMLA backend calls it. This FlashMLA computes its tile-scheduler metadata on the
  first call through the holder ``get_mla_metadata`` returns; that first call is made here,
  outside the timed call, and later calls reuse the metadata.

* The Triton unified-attention kernel of vLLM's TRITON_ATTN backend
  (``vllm/v1/attention/ops/triton_unified_attention.py``, compiled by Triton on first use, so
  any GPU Triton targets): ``unified_attention`` on pagedattn's paged tensors with the
  segment buffers TRITON_ATTN's metadata builder allocates once (:func:`triton_unified_call`):
  decode batches of up to ``128 // num_kv_heads`` sequences (with CUDA graphs, the capture size
  nearest that) run its 3D kernel, 16 softmax segments a sequence, then a reduce.

``*_availability()`` says why a kernel cannot run here without raising: no CUDA GPU, a GPU
other than sm90, vLLM missing, or its extension not loading (a wheel built against another
torch fails here with the loader's message). Nothing imports ``vllm`` at import time; asking
for availability does, and importing vLLM sets ``TORCHINDUCTOR_COMPILE_THREADS=1`` and patches
a few inductor passes in this process (``vllm/env_override.py``), so it is asked only after the
hardware checks pass. Used by the benchmark's ``vllm-fa3`` provider
(:mod:`pagedattn.bench.providers`) and the ``flashmla`` row of ``pagedattn bench mla``
(:mod:`pagedattn.bench.mla`).
"""

from __future__ import annotations

import importlib

import torch

from pagedattn.adapters.common import NotApplicable, first_failure, gpu_status, module_status, query_lens_of

FA3_MODULE = "vllm.vllm_flash_attn"
FLASHMLA_MODULE = "vllm.third_party.flashmla.flash_mla_interface"
TRITON_UNIFIED_MODULE = "vllm.v1.attention.ops.triton_unified_attention"
DTYPES = (torch.float16, torch.bfloat16)

# vLLM's FLASH_ATTN backend runs FA3 on block sizes that are multiples of 16 only
# (get_supported_kernel_block_sizes -> [MultipleOf(16)]; get_kv_cache_shape raises otherwise).
FA3_BLOCK_MULTIPLE = 16
# The wheel instantiates head dims 64, 96, 128, 192, 256 (a head size is rounded up to one);
# flash_api.cpp wants a multiple of 8 for fp16/bf16 rows (16-byte loads).
FA3_MAX_HEAD_SIZE = 256
FA3_HEAD_ALIGN = 8
# FA3's s_aux: "We only support query heads <= 64 with S aux" and bf16 only (flash_api.cpp).
FA3_SINK_MAX_HEADS = 64
FA3_FEATURES = ("sliding_window", "softcap", "sinks")
# Under full CUDA graphs vLLM's FLASH_ATTN builder hands FA3 a split cap, for the scheduler
# metadata and the call alike (``AttentionConfig.flash_attn_max_num_splits_for_cuda_graph``, 32),
# on every batch of at most the largest capture size (512 tokens by default); larger batches run
# eager with 0, FA3's own heuristic. The cap is what its graphs replay: inside vLLM 0.26 on the
# H200 (Llama-3.1-8B, 64 x 2048 decode, torch.profiler) FA3 took 122 us a layer plus 3 us of
# combine, where the heuristic's call alone took 135.
FA3_GRAPH_MAX_SPLITS = 32
FA3_GRAPH_MAX_TOKENS = 512

# TRITON_ATTN's metadata builder (vllm/v1/attention/backends/triton_attn.py): the 2D kernel's grid
# should hold at least 128 programs, so decodes of up to 128 // num_kv_heads sequences take the 3D
# (segmented) kernel, with 16 softmax segments a sequence
TRITON_MIN_GRID_2D = 128
TRITON_SEGMENTS = 16
TRITON_FEATURES = ("sliding_window", "softcap", "sinks")

# FlashMLA's dense decode: "Currently page_block_size must be 64"; q/k rows of 576 (512 latent
# + 64 rope), output rows of 512 (dense_decode.h); vLLM's FLASHMLA backend lists block size 64.
FLASHMLA_BLOCK_SIZE = 64
FLASHMLA_HEAD_DIM = 576
FLASHMLA_HEAD_DIM_V = 512


def _hopper_status(what: str):
    def status() -> tuple[bool, str]:
        major, minor = torch.cuda.get_device_capability()
        if major != 9:
            return False, f"{what} is compiled for Hopper (sm90) only; this GPU is sm{major}{minor}"
        return True, ""

    return status


def _fa3_extension_status() -> tuple[bool, str]:
    """``vllm.vllm_flash_attn`` imports when either FA2 or FA3 loads; FA3 is asked for here."""
    fai = importlib.import_module(f"{FA3_MODULE}.flash_attn_interface")
    if not getattr(fai, "FA3_AVAILABLE", False):
        return False, f"vLLM's FA3 extension (_vllm_fa3_C) does not load: {getattr(fai, 'FA3_UNAVAILABLE_REASON', '?')}"
    return True, ""


def fa3_availability() -> tuple[bool, str]:
    """(can run here, why not): a CUDA GPU of compute capability 9.x, vLLM, and its FA3 extension."""
    return first_failure(gpu_status, _hopper_status("vLLM's FlashAttention-3"), lambda: module_status("vllm"),
                         lambda: module_status(FA3_MODULE), _fa3_extension_status)


def flashmla_availability() -> tuple[bool, str]:
    """(can run here, why not): a CUDA GPU of compute capability 9.x, vLLM, and its FlashMLA extension."""
    return first_failure(gpu_status, _hopper_status("FlashMLA's dense decode"), lambda: module_status("vllm"),
                         lambda: module_status(FLASHMLA_MODULE))


def triton_unified_availability() -> tuple[bool, str]:
    """(can run here, why not): a CUDA GPU and vLLM with its Triton unified-attention module."""
    return first_failure(gpu_status, lambda: module_status("vllm"), lambda: module_status(TRITON_UNIFIED_MODULE))


def _load(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise NotApplicable(f"{name} does not import ({e})") from None


def version() -> str:
    return getattr(_load("vllm"), "__version__", "?")


# ---------------------------------------------------------------------------------------------
# FlashAttention-3


def fa_window(sliding_window: int | None, causal: bool = True) -> tuple[int, int]:
    """pagedattn's window W (a query sees its own key and the W - 1 before it; without causal
    also the W - 1 after it) as FA's ``window_size`` (keys left, keys right of the query that
    stay visible); ``(-1, -1)``: no window. vLLM's FLASH_ATTN backend maps its sliding_window
    the same way: ``(W - 1, 0)`` for decoders, ``(W - 1, W - 1)`` for non-causal attention."""
    if not sliding_window:
        return (-1, -1)
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    w = int(sliding_window) - 1
    return (w, 0) if causal else (w, w)


def fa3_supports(features, *, num_q_heads: int, num_kv_heads: int, head_size: int,
                 block_size: int) -> tuple[bool, str]:
    """(can FA3 here compute it, why not); ``features``: the names of the score modifiers and
    masks a call uses beside causal (sliding_window, softcap, sinks)."""
    extra = sorted(set(features) - set(FA3_FEATURES))
    if extra:
        return False, f"vLLM's FA3 call here wires no {', '.join(extra)}"
    if block_size % FA3_BLOCK_MULTIPLE:
        return False, (f"vLLM runs FA3's paged KV on block sizes that are multiples of {FA3_BLOCK_MULTIPLE}; "
                       f"got {block_size}")
    if head_size % FA3_HEAD_ALIGN or head_size > FA3_MAX_HEAD_SIZE:
        return False, (f"FA3 in vLLM's wheel has head sizes up to {FA3_MAX_HEAD_SIZE}, multiples of "
                       f"{FA3_HEAD_ALIGN}; got {head_size}")
    if num_q_heads % num_kv_heads:
        return False, "num_q_heads is not a multiple of num_kv_heads"
    if "sinks" in features and num_q_heads > FA3_SINK_MAX_HEADS:
        return False, f"FA3 takes sinks (s_aux) for at most {FA3_SINK_MAX_HEADS} query heads; got {num_q_heads}"
    return True, ""


def _check_dtypes(kernel: str, q, k_cache, v_cache) -> None:
    if q.dtype not in DTYPES:
        raise NotApplicable(f"{kernel} takes fp16/bf16 here, not {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise NotApplicable("K/V cache dtype differs from q's (fp8 descales not wired)")


def _varlen_metadata(block_table, seq_lens, query_start_loc, max_query_len, max_seq_len):
    """(cu_seqlens_q, seqused_k, block table) as int32 contiguous tensors, and the host maxima
    (read from the metadata where not given), as FlashAttention-style varlen calls take them."""
    if max_query_len is None:
        max_query_len = max(query_lens_of(query_start_loc.tolist()))
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    as_int32 = (t.to(torch.int32).contiguous() for t in (query_start_loc, seq_lens, block_table))
    return *as_int32, int(max_query_len), int(max_seq_len)


def fa3_call(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, *, out, causal=True,
             sliding_window=None, softcap=None, sinks=None, scale=None, max_query_len=None, max_seq_len=None,
             aot_schedule=True, max_num_splits=None):
    """(zero-argument call, note): vLLM's FA3 ``flash_attn_varlen_func`` on pagedattn's paged
    tensors, writing ``out`` (like q).

    ``max_query_len`` / ``max_seq_len`` (host ints) are read from the metadata when not given;
    with ``aot_schedule`` the scheduler metadata is computed here once, as vLLM's metadata
    builder does per step, so the call skips FA3's own scheduling launch. ``max_num_splits``
    None: what vLLM's builder passes with full CUDA graphs (FA3_GRAPH_MAX_SPLITS up to
    FA3_GRAPH_MAX_TOKENS tokens, else 0, FA3's heuristic). ``sinks`` go in as FA3's ``s_aux``,
    rounded to bf16 (the only dtype it takes). ``scale`` None: 1 / sqrt(head_size).
    """
    _check_dtypes("vLLM's FA3", q, k_cache, v_cache)
    num_q_heads, head_size = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    features = [k for k, v in (("sliding_window", sliding_window), ("softcap", softcap), ("sinks", sinks))
                if v is not None]
    ok, why = fa3_supports(features, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                           block_size=block_size)
    if not ok:
        raise NotApplicable(why)
    fa = _load(FA3_MODULE)
    cu_seqlens_q, seqused_k, table, max_query_len, max_seq_len = _varlen_metadata(
        block_table, seq_lens, query_start_loc, max_query_len, max_seq_len)
    window = fa_window(sliding_window, causal)
    s_aux = None if sinks is None else sinks.to(device=q.device, dtype=torch.bfloat16).contiguous()
    softcap = float(softcap) if softcap else 0.0  # FA: 0.0 is off
    scale = float(scale) if scale is not None else head_size ** -0.5
    if max_num_splits is None:
        max_num_splits = FA3_GRAPH_MAX_SPLITS if q.shape[0] <= FA3_GRAPH_MAX_TOKENS else 0
    scheduler_metadata = None
    if aot_schedule:
        scheduler_metadata = fa.get_scheduler_metadata(
            batch_size=seqused_k.shape[0], max_seqlen_q=max_query_len, max_seqlen_k=max_seq_len,
            num_heads_q=num_q_heads, num_heads_kv=num_kv_heads, headdim=head_size, cache_seqlens=seqused_k,
            qkv_dtype=q.dtype, headdim_v=v_cache.shape[3], cu_seqlens_q=cu_seqlens_q, page_size=block_size,
            causal=bool(causal), window_size=window, has_softcap=softcap > 0, num_splits=max_num_splits,
        )
    args = dict(q=q, k=k_cache, v=v_cache, max_seqlen_q=max_query_len, cu_seqlens_q=cu_seqlens_q,
                max_seqlen_k=max_seq_len, seqused_k=seqused_k, softmax_scale=scale, causal=bool(causal),
                window_size=list(window), softcap=softcap, block_table=table, out=out,
                scheduler_metadata=scheduler_metadata, fa_version=3, s_aux=s_aux, num_splits=max_num_splits)
    flash_attn_varlen_func = fa.flash_attn_varlen_func

    def run():
        flash_attn_varlen_func(**args)
        return out

    extras = [f"window {tuple(window)}" if window != (-1, -1) else "", "softcap" if softcap else "",
              "sinks as bf16 s_aux" if s_aux is not None else "",
              "AOT scheduler metadata" if aot_schedule else "FA3 schedules in the call",
              f"split cap {max_num_splits}" if max_num_splits else "FA3's split heuristic"]
    note = f"FA3 flash_attn_varlen_func, paged KV (block {block_size})"
    return run, f"{note}; {', '.join(e for e in extras if e)}; vLLM {version()}"


# ---------------------------------------------------------------------------------------------
# vLLM's Triton unified attention


def triton_unified_call(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, *, out, causal=True,
                        sliding_window=None, softcap=None, sinks=None, scale=None, max_query_len=None,
                        max_seq_len=None):
    """(zero-argument call, note): vLLM's ``unified_attention`` (the kernel of its TRITON_ATTN
    backend) on pagedattn's paged tensors, writing ``out`` (like q), as TRITON_ATTN's forward
    calls it for a bf16/fp16 cache: unit descales, the window as ``(W - 1, 0)``, the segment
    buffers its metadata builder allocates (made here, outside the timed call) and its 3D-kernel
    threshold ``128 // num_kv_heads`` (with full CUDA graphs vLLM takes the capture size nearest
    that: the same 16 for 8 KV heads and the usual sizes 1, 2, 4, ..., 16, ...)."""
    _check_dtypes("vLLM's Triton kernel", q, k_cache, v_cache)
    num_seqs, num_q_heads, head_size = seq_lens.shape[0], q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise NotApplicable("num_q_heads is not a multiple of num_kv_heads")
    unified_attention = _load(TRITON_UNIFIED_MODULE).unified_attention
    cu_seqlens_q, seqused_k, table, max_query_len, max_seq_len = _varlen_metadata(
        block_table, seq_lens, query_start_loc, max_query_len, max_seq_len)
    threshold = TRITON_MIN_GRID_2D // num_kv_heads
    pad = 1 << (head_size - 1).bit_length()
    f32 = dict(dtype=torch.float32, device=q.device)
    descale = torch.ones(1, **f32).expand(num_seqs, num_kv_heads)
    window = fa_window(sliding_window, causal)
    args = dict(
        q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_query_len,
        seqused_k=seqused_k, max_seqlen_k=max_seq_len,
        softmax_scale=float(scale) if scale is not None else head_size ** -0.5, causal=bool(causal),
        window_size=window, block_table=table,
        softcap=float(softcap) if softcap else 0.0, q_descale=None, k_descale=descale, v_descale=descale,
        seq_threshold_3D=threshold, num_par_softmax_segments=TRITON_SEGMENTS,
        softmax_segm_output=torch.empty(threshold, num_q_heads, TRITON_SEGMENTS, pad, **f32),
        softmax_segm_max=torch.empty(threshold, num_q_heads, TRITON_SEGMENTS, **f32),
        softmax_segm_expsum=torch.empty(threshold, num_q_heads, TRITON_SEGMENTS, **f32),
        sinks=None if sinks is None else sinks.to(device=q.device, dtype=torch.float32).contiguous(),
    )

    def run():
        unified_attention(**args)
        return out

    kernel = "3D kernel, 16 segments + reduce" if num_seqs <= threshold and max_query_len == 1 else "2D kernel"
    extras = [f"window {tuple(window)}" if window != (-1, -1) else "", "softcap" if softcap else "",
              "sinks" if sinks is not None else ""]
    note = f"Triton unified_attention, {kernel} (3D up to {threshold} sequences), paged KV (block {k_cache.shape[1]})"
    return run, f"{'; '.join([note] + [e for e in extras if e])}; vLLM {version()}"


# ---------------------------------------------------------------------------------------------
# FlashMLA


def flashmla_supports(*, block_size: int, dtype: torch.dtype, row_dim: int, latent_dim: int,
                      query_lens=None) -> tuple[bool, str]:
    """(can FlashMLA's dense decode compute it, why not). ``row_dim``: the cache's and q's
    row width (latent + rope), ``query_lens``: each sequence's query tokens (FlashMLA takes one
    query length for the whole batch)."""
    if block_size != FLASHMLA_BLOCK_SIZE:
        return False, (f"FlashMLA's dense decode takes {FLASHMLA_BLOCK_SIZE}-token pages only; "
                       f"got block size {block_size}")
    if dtype not in DTYPES:
        return False, f"FlashMLA's dense decode takes fp16/bf16 here, not {dtype}"
    if row_dim != FLASHMLA_HEAD_DIM or latent_dim != FLASHMLA_HEAD_DIM_V:
        return False, (f"FlashMLA's dense decode takes {FLASHMLA_HEAD_DIM_V} latent + "
                       f"{FLASHMLA_HEAD_DIM - FLASHMLA_HEAD_DIM_V} rope; got {latent_dim} + {row_dim - latent_dim}")
    if query_lens is not None and len(set(query_lens)) > 1:
        return False, "FlashMLA takes one query length for the whole batch"
    if query_lens is not None and min(query_lens) < 1:
        return False, "a sequence without query tokens"
    return True, ""


def flashmla_call(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, *, scale: float, latent_dim: int, out: torch.Tensor):
    """(zero-argument call, note): FlashMLA's dense decode on pagedattn's latent cache.

    ``q`` is ``[num_tokens, num_heads, 576]`` (absorbed query, then rope part; the
    concatenation FlashMLA takes), viewed ``[num_seqs, query_len, num_heads, 576]``;
    ``kv_cache`` ``[num_blocks, 64, 576]`` is viewed with one KV head (``unsqueeze(-2)``, as
    vLLM's backend passes it). The call writes ``out`` ``[num_tokens, num_heads, 512]``
    through the view FlashMLA checks for ``out=`` (``[num_seqs, 1, query_len * num_heads,
    512]``; the same memory). Queries of a sequence with more than one token are causal
    (bottom-right), as vLLM calls it. The first call, made here, computes the tile-scheduler
    metadata the later ones reuse.
    """
    qsl = query_start_loc.tolist()
    q_lens = query_lens_of(qsl)
    ok, why = flashmla_supports(block_size=kv_cache.shape[1], dtype=q.dtype, row_dim=q.shape[2],
                                latent_dim=latent_dim, query_lens=q_lens)
    if not ok:
        raise NotApplicable(why)
    if kv_cache.dtype != q.dtype:
        raise NotApplicable(f"latent cache dtype {kv_cache.dtype} differs from q's {q.dtype} (fp8 path not wired)")
    if kv_cache.shape[2] != q.shape[2]:
        raise ValueError(f"kv_cache rows of {kv_cache.shape[2]} do not match q's {q.shape[2]}")
    fm = _load(FLASHMLA_MODULE)
    num_seqs, query_len, num_heads = len(q_lens), q_lens[0], q.shape[1]
    if out.shape != (q.shape[0], num_heads, latent_dim) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {(q.shape[0], num_heads, latent_dim)}, got {tuple(out.shape)}")
    q4 = q.view(num_seqs, query_len, num_heads, q.shape[2])
    k_cache = kv_cache.unsqueeze(-2)  # [num_blocks, 64, 1, 576]: MLA's one KV head
    out4 = out.view(num_seqs, 1, query_len * num_heads, latent_dim)
    table = block_table.to(torch.int32).contiguous()
    cache_seqlens = seq_lens.to(torch.int32).contiguous()
    # vLLM's FLASHMLA metadata builder's arguments (ignored by this FlashMLA, which schedules
    # on the first call through the returned holder)
    sched_meta, num_splits = fm.get_mla_metadata(cache_seqlens, query_len * num_heads, 1, is_fp8_kvcache=False)
    flash_mla_with_kvcache = fm.flash_mla_with_kvcache

    def run():
        flash_mla_with_kvcache(q4, k_cache, table, cache_seqlens, latent_dim, sched_meta, num_splits,
                               softmax_scale=float(scale), causal=True, is_fp8_kvcache=False, out=out4)
        return out

    run()  # computes the tile-scheduler metadata (outside the timing)
    return run, f"FlashMLA dense decode ({num_heads} heads, q_len {query_len}, page 64), vLLM {version()}"
