"""The vLLM attention backend: :class:`PagedAttnBackend`, its metadata builder and its impl.

Imports vLLM (0.26.0 through 0.33.0; :mod:`.compat` adapts to the release installed). vLLM reaches it through ``AttentionBackendEnum.CUSTOM``
once :func:`pagedattn.integrations.vllm.register` has run (the package's entry point).

How vLLM's objects map onto pagedattn's contract
------------------------------------------------
* ``CommonAttentionMetadata`` carries ``query_start_loc``, ``seq_lens`` (new tokens included),
  ``block_table_tensor`` and ``slot_mapping`` (-1 for padding) in exactly the layout
  :func:`pagedattn.paged_attention` and :func:`pagedattn.write_kv` take; the builder passes the
  device tensors through and plans from the host copies (``query_start_loc_cpu`` and
  ``seq_lens_cpu_upper_bound``, or ``max_seq_len`` for every sequence), so building never
  synchronizes. Host lengths only steer the plan's heuristics: the kernels read the device
  lengths, and an upper bound never leaves a key uncovered.
* The per-layer KV cache is vLLM's logical ``[num_blocks, num_kv_heads, block_size,
  2 * head_size]`` view (K then V in the last dimension) in whichever physical layout vLLM
  resolved; ``kv_cache.transpose(1, 2)`` split at ``head_size`` gives pagedattn's
  ``[num_blocks, block_size, num_kv_heads, head_size]`` K and V as strided views of the same
  memory (no copy), and the kernels take all three strides. fp8 caches arrive as uint8 and are
  viewed as float8_e4m3fn.
* Plans: :func:`pagedattn.plan_attention` once per step in ``build()``; the plan object is
  shared by every layer of the KV-cache group. With full CUDA graphs the builder keeps one
  persistent plan sized for the largest capture size, and every step a captured graph could
  replay goes through it, re-planned in place by ``plan.update``: the captured kernels read
  the new work list from the same device buffers.
* Multimodal bidirectional ranges (``mm_req_doc_ranges``, inclusive ends) become pagedattn's
  half-open ``prefix_ranges``; a tensor ``causal`` (per-request flags) becomes one range over
  every position of each non-causal request.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import ClassVar

import torch

import pagedattn
from pagedattn.ops.common.launching import capturing, compile_ahead
from pagedattn.ops.common.offsets import needs_int64_offsets
from pagedattn.ops.prefill_gluon.launch import GLUON_MIN_QUERY_TOKENS
from pagedattn.plan import AttentionPlan, plan_for_graphs
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec

from pagedattn.integrations.vllm.compat import KvCacheShape, max_decode_query_len

__all__ = [
    "PagedAttnBackend",
    "PagedAttnImpl",
    "PagedAttnMetadata",
    "PagedAttnMetadataBuilder",
    "SUPPORTED_HEAD_SIZES",
    "SUPPORTED_KV_CACHE_DTYPES",
]

# The kernels' contract (SPEC): multiples of 8 from 8 to 256, padded to a power of two inside.
SUPPORTED_HEAD_SIZES = tuple(range(8, 257, 8))
# fp8 means e4m3 here (vLLM's "fp8" on CUDA); e5m2 and the per-token-head / fp4 formats have no
# kernel in pagedattn.
SUPPORTED_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
# The page size the backend asks vLLM for where vLLM lets the backend choose (vLLM's own default
# block size): the decode kernels' 64-key tiles span 4 such pages; 1-token pages cost 1.35x.
PREFERRED_PAGE = 16
_UNQUANTIZED_KV_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER, AttentionType.ENCODER_ONLY,
               AttentionType.ENCODER_DECODER)
_NO_CACHE_TYPES = (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)
# Steps ``(query_len, seq_len)`` per request that the builder runs once through each distinct layer
# of its group on a scratch cache (``warm_up``): together they launch every prefill-kernel tile
# choice and the unified kernel beside it, which vLLM's own warm-up never reaches.
WARMUP_STEPS = (
    ((512, 512),),  # a prompt alone: the short-prefill tiles
    ((GLUON_MIN_QUERY_TOKENS, GLUON_MIN_QUERY_TOKENS),),  # a prompt the Gluon prefill kernel takes on sm90
    ((128, 2048),),  # an extend over a longer context: the 128-row tiles
    ((1, 300), (300, 300)),  # a decode beside a prompt: the prefill kernel and a unified launch for the rest
    # a prompt's tail of a few tokens (chunked prefill cuts prompts at the token budget) beside a
    # prompt: the rest's rows per block follow its longest query (2-8 tokens x the heads per KV
    # head, 16 to 64 rows), so these reach each row count at any head ratio up to 16
    ((2, 300), (300, 300)),
    ((4, 300), (300, 300)),
    ((8, 300), (300, 300)),
    ((1, 100), (64, 200)),  # a decode beside a short chunk: the unified kernel's extend tiles
)
# Pure decode steps, added to the warm-up where no full CUDA graph replays them (eager or
# piecewise graphs: vLLM then runs attention outside the graphs): the split-KV kernel and its merge
# (a short batch of long decodes) and the persistent kernel (many long decodes: 32 x 2048 takes it
# on the H200's 132 SMs). Captured full graphs compile the decode kernels they replay.
EAGER_DECODE_WARMUP_STEPS = (
    ((1, 640),),
    ((1, 2048),) * 32,
)


def full_graph_limits(vllm_config, batch_invariant: bool) -> tuple[int, int]:
    """``(tokens, query length)`` of the largest step a full CUDA graph may replay: the largest
    capture size and the widest uniform decode query; ``(0, 0)`` without full graphs (none
    captured, or batch-invariant mode, whose split positions a graph cannot follow)."""
    compilation = vllm_config.compilation_config
    mode, sizes = compilation.cudagraph_mode, compilation.cudagraph_capture_sizes or []
    if batch_invariant or mode is None or not mode.has_full_cudagraphs() or not sizes:
        return 0, 0
    return max(sizes), max_decode_query_len(vllm_config)


def warm_up_wanted(device: torch.device) -> bool:
    """Whether a builder warms its kernels up when vLLM makes it: on a GPU, unless
    ``PAGEDATTN_VLLM_WARMUP=0``."""
    return device.type == "cuda" and os.environ.get("PAGEDATTN_VLLM_WARMUP", "1") != "0"


def layer_views(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int, fp8: bool):
    """(k_cache, v_cache) ``[num_blocks, block_size, num_kv_heads, head_size]``: views of vLLM's
    ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` per-layer cache (fp8: as e4m3)."""
    if kv_cache.dim() != 4 or kv_cache.shape[1] != num_kv_heads or kv_cache.shape[3] != 2 * head_size:
        raise ValueError(
            f"kv_cache must be vLLM's [num_blocks, num_kv_heads={num_kv_heads}, block_size, "
            f"2 * head_size={2 * head_size}] layer view, got shape {list(kv_cache.shape)}")
    if kv_cache.stride(3) != 1:
        raise ValueError(f"kv_cache must be contiguous in its last dimension (stride {kv_cache.stride(3)})")
    nhd = (fp8_view(kv_cache) if fp8 else kv_cache).transpose(1, 2)
    return nhd[..., :head_size], nhd[..., head_size:]


def sized_cache_blocks(vllm_config) -> int | None:
    """The blocks of each layer's cache view once vLLM has sized the cache (the worker sets
    ``cache_config.num_gpu_blocks`` before it makes the builders), else None. Layers whose KV
    groups share one pool (hybrid models) each view the whole pool."""
    blocks = getattr(vllm_config.cache_config, "num_gpu_blocks", None)
    return int(blocks) if blocks else None


def warm_up_jobs() -> int:
    """Threads the warm-up compiles in: ``PAGEDATTN_VLLM_WARMUP_JOBS`` (default 1, one kernel at a
    time as the calls reach it)."""
    value = os.environ.get("PAGEDATTN_VLLM_WARMUP_JOBS", "1")
    try:
        jobs = int(value)
    except ValueError:
        raise ValueError(f"PAGEDATTN_VLLM_WARMUP_JOBS must be a positive integer, got {value!r}") from None
    if jobs < 1:
        raise ValueError(f"PAGEDATTN_VLLM_WARMUP_JOBS must be a positive integer, got {value!r}")
    return jobs


def warm_up_calls(calls, large_cache: bool, jobs: int = 1) -> int:
    """Run each of ``calls`` once on the scratch tensors (Triton compiles what they launch);
    returns how many ran. Where the real cache needs 64-bit offsets (``large_cache``), each call's
    launches are first captured and compiled with ``LARGE_CACHE=True``: variants that the scratch
    cache cannot reach. With ``jobs`` > 1 every launch of every call is captured first and
    compiled in that many threads, both variants, before the calls run on the compiled kernels."""
    if jobs > 1:
        with capturing() as launched:
            for call in calls:
                call()
        compile_ahead(launched, jobs=jobs)
        if large_cache:
            compile_ahead(launched, jobs=jobs, LARGE_CACHE=True)
    for call in calls:
        if large_cache and jobs == 1:
            with capturing() as launched:
                call()
            compile_ahead(launched, LARGE_CACHE=True)
        call()
    return len(calls)


def fp8_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """An fp8 layer's cache as float8_e4m3fn (vLLM allocates it as uint8)."""
    if kv_cache.dtype == torch.float8_e4m3fn:
        return kv_cache
    if kv_cache.element_size() != 1:
        raise TypeError(f"kv_cache of an fp8 layer must hold 1-byte elements, got {kv_cache.dtype}")
    return kv_cache.view(torch.float8_e4m3fn)


def _batch_invariant() -> bool:
    import vllm.envs as envs

    return bool(envs.VLLM_BATCH_INVARIANT)


class PagedAttnBackend(KvCacheShape, AttentionBackend):
    """pagedattn's kernels behind vLLM's attention-backend interface (``CUSTOM``)."""

    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(SUPPORTED_KV_CACHE_DTYPES)
    # vLLM calls do_kv_cache_update (write_kv) before forward
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[PagedAttnImpl]:
        return PagedAttnImpl

    @staticmethod
    def get_builder_cls() -> type[PagedAttnMetadataBuilder]:
        return PagedAttnMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # The kernels index pages by block_table and take any page size (MultipleOf(1)); the
        # listed PREFERRED_PAGE is for vLLM 0.26, which gives sliding-window layers the smallest
        # int a backend lists (else the smallest MultipleOf base) whatever the cache's block
        # size: with MultipleOf(1) alone, a model whose layers all have a window (Mistral-7B)
        # got 1-token pages, and the decode kernel read them at 107 us a layer against 79 on
        # 16-token pages (H200, 16 x 4096). Under 0.26 a model mixing window and global layers
        # then needs a cache block size that 16 divides or that divides 16 (vLLM scales the
        # smaller page up to the larger; with 24, say, it stops at start-up).
        return [PREFERRED_PAGE, MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return True

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type in _ATTN_TYPES

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # plans (Q blocks of the work list, the prefill kernel's sequence range) come from the
        # host query lengths
        return False

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                             use_mm_prefix, device_capability) -> str | None:
        cache_dtype = _UNQUANTIZED_KV_DTYPES.get(kv_cache_dtype)
        if cache_dtype is not None and cache_dtype != dtype:
            return (f"kv_cache_dtype {kv_cache_dtype} differs from the model dtype {dtype}: the kernels read a "
                    "cache in the query's dtype or fp8 e4m3")
        return None


@dataclass
class PagedAttnMetadata:
    """Per-step metadata of one KV-cache group, built once and read by every layer."""

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, new tokens included
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padding
    causal: bool
    plan: AttentionPlan | None  # None for attention without a cache (encoders)
    prefix_ranges: torch.Tensor | None = None  # [num_reqs, R, 2] int32, half-open


class PagedAttnMetadataBuilder(AttentionMetadataBuilder[PagedAttnMetadata]):
    """Builds :class:`PagedAttnMetadata` and the step's plan.

    CUDA graphs: ``UNIFORM_BATCH`` (uniform decode batches, speculative decoding's 1 + k
    included, replay full graphs; mixed batches run piecewise, attention eager with a fresh
    plan and the large-tile prefill kernel). ``NEVER`` in batch-invariant mode, whose split
    positions depend on the step's longest sequence.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if _batch_invariant():
            return AttentionCGSupport.NEVER
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_size = kv_cache_spec.head_size
        head_size_v = getattr(kv_cache_spec, "head_size_v", None) or self.head_size
        if head_size_v != self.head_size:
            raise ValueError(f"kv_cache_spec: head_size_v {head_size_v} differs from head_size {self.head_size}; "
                             "pagedattn's paged cache holds K and V of one head size")
        self.block_size = kv_cache_spec.block_size
        self.cache_dtype = kv_cache_spec.dtype
        self.sliding_window = getattr(kv_cache_spec, "sliding_window", None)
        self.has_cache = not isinstance(kv_cache_spec, EncoderOnlyAttentionSpec)
        model_config = vllm_config.model_config
        self.num_q_heads = _num_q_heads(vllm_config, layer_names) or model_config.get_num_attention_heads(
            vllm_config.parallel_config)
        self.dtype = model_config.dtype
        self.batch_invariant = _batch_invariant()

        # full CUDA graphs: one persistent plan for every step a captured graph could replay
        self.persistent_plan: AttentionPlan | None = None
        self.graph_max_tokens, self.graph_max_query_len = (
            full_graph_limits(vllm_config, self.batch_invariant) if self.has_cache else (0, 0))
        if self.graph_max_tokens:
            self.persistent_plan = plan_for_graphs(
                self.graph_max_tokens, self.graph_max_query_len, model_config.max_model_len,
                num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                device=self.device, sliding_window=self.sliding_window, dtype=self.dtype)
        context = vllm_config.compilation_config.static_forward_context
        self.layers = [layer for name in layer_names
                       if (layer := context.get(name)) is not None and hasattr(layer, "impl")]
        if self.has_cache and warm_up_wanted(self.device):
            self.warm_up()

    def warm_up(self, steps=None) -> int:
        """Run ``steps`` (default: WARMUP_STEPS, and EAGER_DECODE_WARMUP_STEPS where no full CUDA
        graph serves the decodes) through each distinct layer of the group on a scratch cache;
        returns the number of forwards run.

        vLLM's warm-up runs no prefill through attention (its profiling forward passes no
        metadata, its captured graphs are decodes), so without this the first request with a
        prompt would wait while Triton compiles the prefill kernel (vLLM logs "Triton kernel JIT
        compilation during inference"). Layers that differ only in their weights share
        compiled kernels; one per distinct feature set runs. ``PAGEDATTN_VLLM_WARMUP=0`` skips it.
        """
        if steps is None:
            steps = WARMUP_STEPS if self.graph_max_tokens else WARMUP_STEPS + EAGER_DECODE_WARMUP_STEPS
        distinct = {}
        for layer in self.layers:
            impl = layer.impl
            key = (impl.sliding_window, impl.logits_soft_cap, impl.alibi_slopes is None, impl.use_alibi_sqrt,
                   impl.sinks is None, impl.kv_cache_dtype, impl.attn_type)
            distinct.setdefault(key, layer)
        if not distinct:
            return 0
        page = self.block_size
        num_blocks = _scratch_blocks(steps, page)
        # vLLM's default (NHD) memory order: [num_blocks, block_size, num_kv_heads, 2 * head_size]
        cache = torch.zeros(num_blocks, page, self.num_kv_heads, 2 * self.head_size, dtype=self.cache_dtype,
                            device=self.device).transpose(1, 2)
        table_width = worker_block_table_width(self.kv_cache_spec, self.vllm_config)
        calls = []
        for step in steps:
            common = _scratch_step(step, page, self.device, table_width)
            n = common.num_actual_tokens
            q = torch.zeros(n, self.num_q_heads, self.head_size, dtype=self.dtype, device=self.device)
            kv = torch.zeros(n, self.num_kv_heads, self.head_size, dtype=self.dtype, device=self.device)
            out = torch.empty_like(q)
            for layer in distinct.values():
                # each call builds its step's metadata: the persistent plan is one, re-planned per step
                calls.append(lambda common=common, layer=layer, q=q, kv=kv, out=out: layer.impl.forward(
                    layer, q, kv, kv, cache, self.build(0, common), out))
        return warm_up_calls(calls, self.real_cache_is_large(), warm_up_jobs())

    def real_cache_is_large(self) -> bool:
        """Whether the cache vLLM sized for this group gives its layers K/V views of 2**31
        elements or more, which the kernels address with 64-bit offsets (Gemma-3-12B's hybrid
        cache on the H200: about 83,600 blocks, 5.5e9 elements per view). Known from the block
        count (:func:`sized_cache_blocks`), without the cache: its shape on the meta device."""
        blocks = sized_cache_blocks(self.vllm_config)
        if blocks is None:
            return False
        meta = torch.empty(blocks, self.block_size, self.num_kv_heads, 2 * self.head_size, dtype=self.cache_dtype,
                           device="meta").transpose(1, 2)
        return needs_int64_offsets(*layer_views(meta, self.num_kv_heads, self.head_size, False))

    def graph_eligible(self, m: CommonAttentionMetadata) -> bool:
        """Whether a full CUDA graph could replay this step (then its plan is the persistent one)."""
        return (self.persistent_plan is not None and m.num_actual_tokens <= self.graph_max_tokens
                and m.max_query_len <= self.graph_max_query_len and m.num_reqs <= self.graph_max_tokens)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PagedAttnMetadata:
        m = common_attn_metadata
        num_reqs = m.num_reqs
        qsl = m.query_start_loc_cpu[: num_reqs + 1].tolist()
        if m.seq_lens_cpu_upper_bound is not None:
            lens = m.seq_lens_cpu_upper_bound[:num_reqs].tolist()
        else:
            lens = [int(m.max_seq_len)] * num_reqs  # an upper bound too
        graph = self.graph_eligible(m)
        ranges = _mm_ranges_host(m.mm_req_doc_ranges, num_reqs)
        causal = m.causal
        per_request_causal = None
        if isinstance(causal, torch.Tensor):
            if graph:
                raise ValueError("per-request causal flags (a causal tensor) cannot be served in a batch that a full "
                                 "CUDA graph may replay; run with --compilation-config '{\"cudagraph_mode\": "
                                 "\"PIECEWISE\"}'")
            if self.sliding_window:
                raise ValueError("per-request causal flags with a sliding window are not supported: a non-causal "
                                 "request is served as one bidirectional prefix range, which overrides the window")
            per_request_causal, causal = causal[:num_reqs], True

        plan = None
        prefix_ranges = None
        if not self.has_cache:
            causal = False
        elif graph:
            if ranges is not None and _ranges_meet_queries(ranges, qsl, lens):
                raise ValueError("mm_req_doc_ranges: a bidirectional range lies among the new tokens of a batch that a "
                                 "full CUDA graph may replay; the captured graphs have no prefix ranges")
            ranges = None  # no query of the step is in a range with a later key: ranges change nothing
            self.persistent_plan.update(qsl, lens)
            plan = self.persistent_plan
        else:
            plan = pagedattn.plan_attention(
                qsl, lens, num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                device=self.device, batch_invariant=self.batch_invariant, max_num_tokens=m.num_actual_tokens,
                sliding_window=self.sliding_window, dtype=self.dtype,
            )
        if ranges is not None:
            prefix_ranges = _ranges_tensor(ranges, self.device)
        if per_request_causal is not None:
            whole = torch.where(per_request_causal.to(torch.bool), torch.zeros_like(m.seq_lens[:num_reqs]),
                                m.seq_lens[:num_reqs]).to(torch.int32)
            bidirectional = torch.stack([torch.zeros_like(whole), whole], dim=-1).unsqueeze(1)  # [num_reqs, 1, 2]
            prefix_ranges = bidirectional if prefix_ranges is None else torch.cat([prefix_ranges, bidirectional], 1)
        return PagedAttnMetadata(
            num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len, max_seq_len=m.max_seq_len,
            query_start_loc=m.query_start_loc, seq_lens=m.seq_lens, block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping, causal=bool(causal), plan=plan, prefix_ranges=prefix_ranges,
        )


def worker_block_table_width(kv_cache_spec, vllm_config) -> int:
    """The row length of the block table vLLM's model runner keeps for this KV-cache group (0.26
    through 0.33): the spec's blocks per request at ``max_model_len``, rounded up to a multiple of
    128 tokens' blocks (``MultiGroupBlockTable``). A step's ``block_table_tensor`` is a slice of
    its rows, so this is the stride the kernels see."""
    blocks = kv_cache_spec.max_num_blocks_per_req(vllm_config, vllm_config.model_config.max_model_len)
    align = 128 // math.gcd(128, kv_cache_spec.block_size)
    return -(-blocks // align) * align


def _scratch_blocks(steps, block_size: int) -> int:
    """Blocks of the scratch cache that ``_scratch_step`` lays ``steps`` on: its longest
    sequence's (every sequence starts at page 0)."""
    return max((-(-kv // block_size) for step in steps for _, kv in step), default=1)


def _scratch_step(step, block_size: int, device, width: int = 0) -> CommonAttentionMetadata:
    """vLLM's metadata of one step ``((query_len, seq_len), ...)`` over a scratch cache, each
    sequence on pages 0, 1, ... (they share pages: a warm-up reads them, nothing checks what),
    its block table ``width`` entries a row (at least the step's longest).

    Triton specializes a kernel on its block table's row stride (whether it is a multiple of 16),
    so a warm-up whose rows are only as long as its steps' compiles variants that vLLM's table
    (``worker_block_table_width``) does not take, and the first real step of the other kind
    compiles during inference: on the H200 a traffic run of unequal prompts compiled the unified
    kernel at its first step beside a prefill launch, after a warm-up with 13- and 19-entry rows
    where vLLM's had 512."""
    qsl, lens, rows = [0], [], []
    for q_len, kv in step:
        qsl.append(qsl[-1] + q_len)
        lens.append(kv)
        rows.append(list(range(-(-kv // block_size))))
    width = max(width, max(len(r) for r in rows))
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    slots = [rows[s][p // block_size] * block_size + p % block_size
             for s, (q_len, kv) in enumerate(step) for p in range(kv - q_len, kv)]
    qsl_host = torch.tensor(qsl, dtype=torch.int32)
    lens_host = torch.tensor(lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl_host.to(device), query_start_loc_cpu=qsl_host, seq_lens=lens_host.to(device),
        num_reqs=len(step), num_actual_tokens=qsl[-1], max_query_len=max(q for q, _ in step), max_seq_len=max(lens),
        block_table_tensor=table.to(device), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        seq_lens_cpu_upper_bound=lens_host)


def _num_q_heads(vllm_config, layer_names) -> int | None:
    """Query heads per worker shared by the group's layers (None when no layer is registered)."""
    context = vllm_config.compilation_config.static_forward_context
    heads = {layer.impl.num_heads for name in layer_names
             if (layer := context.get(name)) is not None and hasattr(layer, "impl")}
    if len(heads) > 1:
        raise ValueError(f"layers {layer_names} of one KV-cache group have different query head counts {heads}; "
                         "one plan serves the whole group")
    return heads.pop() if heads else None


def _mm_ranges_host(mm_ranges, num_reqs: int) -> list[list[tuple[int, int]]] | None:
    """vLLM's inclusive ``(start, end)`` ranges per request as half-open ones (start < end only)."""
    if not mm_ranges:
        return None
    rows = [[(int(s), int(e) + 1) for s, e in mm_ranges.get(r, ()) if s < e] for r in range(num_reqs)]
    return rows if any(rows) else None


def _ranges_tensor(rows, device) -> torch.Tensor:
    width = max(len(r) for r in rows)
    padded = [r + [(0, 0)] * (width - len(r)) for r in rows]
    host = torch.tensor(padded, dtype=torch.int32).view(len(rows), width, 2)
    return host.to(device, non_blocking=True)


def _ranges_meet_queries(rows, qsl: list[int], lens: list[int]) -> bool:
    """Whether some range holds a query of the step with a later position of its sequence.

    Only then does a range change anything: a query sees every earlier key already. Host lengths
    may overstate a sequence by its query length (optimistic speculative drafts), so the query
    positions are widened by it."""
    for r, row in enumerate(rows):
        q_len = qsl[r + 1] - qsl[r]
        if q_len <= 1:
            continue
        lo, hi = lens[r] - 2 * q_len, lens[r]
        if any(s < hi and lo < e - 1 for s, e in row):
            return True
    return False


class PagedAttnImpl(AttentionImpl[PagedAttnMetadata]):
    """One attention layer: ``do_kv_cache_update`` (write_kv), then ``forward``."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        use_alibi_sqrt: bool = False,
    ) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if head_size not in SUPPORTED_HEAD_SIZES:
            raise ValueError(f"head_size {head_size} is not supported; use a multiple of 8 from 8 to 256")
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; use one of "
                             f"{SUPPORTED_KV_CACHE_DTYPES}")
        if attn_type not in _ATTN_TYPES:
            raise ValueError(f"attn_type {attn_type!r} is not supported")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if logits_soft_cap is not None and logits_soft_cap < 0:
            raise ValueError(f"logits_soft_cap must be >= 0 or None, got {logits_soft_cap}")
        if alibi_slopes is not None and len(alibi_slopes) != num_heads:
            raise ValueError(f"alibi_slopes has {len(alibi_slopes)} entries; expected num_heads = {num_heads}")
        if use_alibi_sqrt and alibi_slopes is None:
            raise ValueError("use_alibi_sqrt=True needs alibi_slopes")
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks must have shape [{num_heads}], got {list(sinks.shape)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.alibi_slopes = None if alibi_slopes is None else torch.tensor(alibi_slopes, dtype=torch.float32)
        self.use_alibi_sqrt = bool(use_alibi_sqrt)
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap or None
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        self._fp8 = kv_cache_dtype in FP8_KV_CACHE_DTYPES
        self._sinks32: torch.Tensor | None = None
        self._slopes_on: torch.Tensor | None = None
        self._views: tuple | None = None  # (kv_cache, k_cache, v_cache) of the last call

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        # the kernels take fp32 sinks; converted once here, not per step
        self._sinks32 = None
        if self.sinks is not None and self.sinks.dtype != torch.float32:
            self._sinks32 = self.sinks.float()

    def _sinks(self) -> torch.Tensor | None:
        if self.sinks is None or self.sinks.dtype == torch.float32:
            return self.sinks
        if self._sinks32 is None:
            self._sinks32 = self.sinks.float()
        return self._sinks32

    def _slopes(self, device: torch.device) -> torch.Tensor | None:
        if self.alibi_slopes is None:
            return None
        if self._slopes_on is None or self._slopes_on.device != device:
            self._slopes_on = self.alibi_slopes.to(device)
        return self._slopes_on

    def cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) ``[num_blocks, block_size, num_kv_heads, head_size]``: views of
        vLLM's ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` per-layer cache."""
        if self._views is not None and self._views[0] is kv_cache:
            return self._views[1], self._views[2]
        k_cache, v_cache = layer_views(kv_cache, self.num_kv_heads, self.head_size, self._fp8)
        self._views = (kv_cache, k_cache, v_cache)
        return k_cache, v_cache

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """Write the step's new K/V into the cache (slot -1: padding, skipped)."""
        if self.attn_type in _NO_CACHE_TYPES:
            return
        k_cache, v_cache = self.cache_views(kv_cache)
        n = slot_mapping.shape[0]
        pagedattn.write_kv(key[:n], value[:n], k_cache, v_cache, slot_mapping,
                           k_scale=layer._k_scale, v_scale=layer._v_scale)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: PagedAttnMetadata, output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the step's tokens into ``output`` ``[num_tokens, num_heads, head_size]``.

        ``attn_metadata`` None is vLLM's memory-profiling run: the output is zeroed."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("pagedattn does not fuse output quantization into attention")
        if attn_metadata is None:
            return output.fill_(0)
        md = attn_metadata
        n = md.num_actual_tokens
        features = dict(scale=self.scale, sliding_window=self.sliding_window, softcap=self.logits_soft_cap,
                        alibi_slopes=self._slopes(query.device), alibi_sqrt=self.use_alibi_sqrt, sinks=self._sinks())
        if self.attn_type in _NO_CACHE_TYPES:
            pagedattn.varlen_attention(query[:n], key[:n], value[:n], md.query_start_loc, md.query_start_loc,
                                       max_query_len=md.max_query_len, causal=False, out=output[:n], **features)
            return output
        if (md.prefix_ranges is not None and self.sliding_window
                and getattr(layer, "mm_prefix_clamp_sliding_window", False)):
            raise ValueError("mm_prefix_clamp_sliding_window: bidirectional ranges clamped by the sliding window are "
                             "not supported (pagedattn's prefix ranges override the window)")
        k_cache, v_cache = self.cache_views(kv_cache)
        pagedattn.paged_attention(
            query[:n], k_cache, v_cache, md.block_table, md.seq_lens, md.query_start_loc,
            max_query_len=md.max_query_len, max_seq_len=md.max_seq_len, causal=md.causal,
            prefix_ranges=md.prefix_ranges, k_scale=layer._k_scale, v_scale=layer._v_scale, out=output[:n],
            plan=md.plan, **features,
        )
        return output
