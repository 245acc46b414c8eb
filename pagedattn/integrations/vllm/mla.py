"""The vLLM MLA backend: latent attention (DeepSeek-V2/V3, Kimi K2) through pagedattn's kernels.

Imports vLLM (0.26.0 through 0.33.0). vLLM's ``MLAAttention`` layer does the projections; this
backend supplies the three attention steps it delegates:

* **decode** (``forward_mqa``, absorbed): queries already multiplied by ``W_UK`` attend over
  the shared 576-wide latent rows with :func:`pagedattn.mla_decode`. Sequences of 1 to 8
  query tokens (speculative decoding, mixed lengths in one batch) take this path; vLLM puts
  them first in the batch.
* **prefill and chunked context** (the prefill backend :class:`PagedAttnMLAPrefill`): vLLM
  decompresses the latent with ``kv_b_proj`` into 192-wide K and 128-wide V per head, and
  :func:`pagedattn.varlen_attention` attends: causally over the new tokens, without a mask over
  each context chunk, each returning the lse vLLM merges the parts with.
* **the cache write** (``do_kv_cache_update``): :func:`pagedattn.write_mla_kv`.

The cache is vLLM's ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` per layer,
pagedattn's own MLA layout; an fp8 cache arrives as uint8 and is viewed as float8_e4m3fn.

Split-KV under CUDA graphs: a decode batch that a full graph may replay is planned for
``max_model_len`` (the split count is fixed when the graph is captured, and the captured launch
must cover the longest sequence it may meet); other decode batches for their longest sequence,
rounded up to a power of two so that the launches recorded per layout stay few.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

import pagedattn
from pagedattn.mla import check_mla_dims
from pagedattn.ops.common.offsets import needs_int64_offsets
from pagedattn.ops.mla.launch import MLA_MAX_QUERY_LEN
from pagedattn.plan.prefill import SHORT_PREFILL_WAVES
from pagedattn.plan.tiles import num_sms
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, MultipleOf
from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend

from pagedattn.integrations.vllm.backend import (
    FP8_KV_CACHE_DTYPES,
    SUPPORTED_KV_CACHE_DTYPES,
    _batch_invariant,
    _scratch_blocks,
    _scratch_step,
    fp8_view,
    full_graph_limits,
    sized_cache_blocks,
    warm_up_calls,
    warm_up_jobs,
    warm_up_wanted,
    worker_block_table_width,
)

__all__ = [
    "PagedAttnMLABackend",
    "PagedAttnMLADecodeMetadata",
    "PagedAttnMLAImpl",
    "PagedAttnMLAMetadataBuilder",
    "PagedAttnMLAPrefill",
]

# What vLLM's selector is told. mla_decode takes a latent that is a multiple of 16 up to 512 and a
# rope part of 16 to 128 (576 = DeepSeek's 512 + 64, 320 = 256 + 64); a cache without a rope part
# (512 alone) has no kernel. The impl checks the two widths themselves.
SUPPORTED_HEAD_SIZES = (320, 576)
# What the builder runs once on a GPU (``warm_up``) so that no request waits for Triton to compile:
# decode steps ``((query_len, seq_len), ...)`` (one split, several splits, a speculative step), and
# prefill calls at PREFILL_WARMUP_TOKENS queries and at a count past the short-prefill rule (the
# 128-row tiles), each new-token prompt with and without lse, each context chunk unmasked over as
# many keys as queries and over CONTEXT_WARMUP_KEYS_PER_QUERY times as many (the 128-row tiles a
# long context takes at any query count).
DECODE_WARMUP_STEPS = (((1, 64),), ((1, 4096),), ((2, 300), (1, 50)))
PREFILL_WARMUP_TOKENS = 256
CONTEXT_WARMUP_KEYS_PER_QUERY = 3


@dataclass
class PagedAttnMLADecodeMetadata(MLACommonDecodeMetadata):
    """vLLM's decode metadata plus what :func:`pagedattn.mla_decode` takes from the host."""

    query_start_loc: torch.Tensor | None = None  # [num_decodes + 1] int32, device
    max_query_len: int = 1
    max_seq_len: int | None = None  # the length the split count is chosen for (see the module doc)
    num_splits: int | None = None  # 1 in batch-invariant mode, else chosen by mla_decode


@dataclass
class _PrefillStandIn:
    """The fields of vLLM's prefill metadata and context chunk that PagedAttnMLAPrefill reads."""

    query_start_loc: torch.Tensor
    max_query_len: int
    cu_seq_lens: torch.Tensor | None = None


class PagedAttnMLAPrefill(MLAPrefillBackend):
    """MLA prefill over decompressed heads (192-wide K, 128-wide V) with varlen_attention.

    Returns the lse as vLLM merges it, ``[num_heads, num_tokens]`` float32, natural log."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    def supports_out(self) -> bool:
        return True

    def _attend(self, q, k, v, cu_q, cu_k, max_query_len: int, *, causal: bool, return_lse: bool, out):
        lse = None
        if return_lse:
            lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        o = pagedattn.varlen_attention(q, k, v, cu_q, cu_k, max_query_len=max_query_len, scale=self.scale,
                                       causal=causal, out=out, lse_out=None if lse is None else lse.t())
        if return_lse:
            return o[0], lse
        return o

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse: bool, out=None, output_scale=None):
        if output_scale is not None:
            raise NotImplementedError("pagedattn does not fuse output quantization into MLA prefill")
        md = self._prefill_metadata
        return self._attend(q, k, v, md.query_start_loc, md.query_start_loc, md.max_query_len, causal=True,
                            return_lse=return_softmax_lse, out=out)

    def run_prefill_context_chunk(self, chunk=None, q=None, k=None, v=None, out=None, *, chunk_idx=None):
        """One chunk of cached context, unmasked. ``chunk`` is vLLM 0.33's ``ContextChunk`` (it
        carries its own query offsets) or 0.26's chunk index into the prefill metadata, which 0.26
        passes by keyword as ``chunk_idx`` (with ``q``, ``k``, ``v`` by keyword too)."""
        if chunk_idx is not None:
            chunk = chunk_idx
        if chunk is None or q is None or k is None or v is None:
            raise TypeError("run_prefill_context_chunk needs a chunk (or chunk_idx), q, k and v")
        if isinstance(chunk, int):
            md = self._prefill_metadata
            cu_q, cu_k, max_q = md.query_start_loc, md.chunked_context.cu_seq_lens[chunk], md.max_query_len
        else:
            cu_q, cu_k, max_q = chunk.query_start_loc, chunk.cu_seq_lens, chunk.max_query_len
        return self._attend(q, k, v, cu_q, cu_k, max_q, causal=False, return_lse=True, out=out)


class PagedAttnMLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    """vLLM's MLA metadata with pagedattn's decode fields and prefill backend.

    CUDA graphs: ``UNIFORM_BATCH`` (decode batches, speculative decoding included); ``NEVER``
    in batch-invariant mode. Unless ``--attention-config.mla_prefill_backend`` names another,
    prefill runs on :class:`PagedAttnMLAPrefill`.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.VARLEN  # 1..8 tokens a sequence, mixed

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if _batch_invariant():
            return AttentionCGSupport.NEVER
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if self.reorder_batch_threshold > MLA_MAX_QUERY_LEN:
            raise ValueError(
                f"speculative decoding asks for {self.reorder_batch_threshold} query tokens a decode step; "
                f"pagedattn's MLA decode takes at most {MLA_MAX_QUERY_LEN} (lower num_speculative_tokens)")
        self.batch_invariant = _batch_invariant()
        self.max_model_len = vllm_config.model_config.max_model_len
        self.graph_max_tokens, self.graph_max_query_len = full_graph_limits(vllm_config, self.batch_invariant)
        attention_config = getattr(vllm_config, "attention_config", None)
        if getattr(attention_config, "mla_prefill_backend", None) is None:
            self._prefill_backend = PagedAttnMLAPrefill(
                num_heads=self.num_heads, scale=self._prefill_backend.scale, kv_lora_rank=self.mla_dims.kv_lora_rank,
                qk_nope_head_dim=self.mla_dims.qk_nope_head_dim, qk_rope_head_dim=self.mla_dims.qk_rope_head_dim,
                v_head_dim=self.mla_dims.v_head_dim, vllm_config=vllm_config)
        self.layer = vllm_config.compilation_config.static_forward_context[layer_names[0]]
        if warm_up_wanted(self.device):
            self.warm_up()

    def warm_up(self, decode_steps=DECODE_WARMUP_STEPS, prefill_tokens: int = PREFILL_WARMUP_TOKENS,
                long_prefill_tokens: int | None = None) -> int:
        """Run decode steps and prefill calls on scratch tensors; returns the number of calls run.

        vLLM's own warm-up runs no attention without graphs, and no prefill at all (its profiling
        forward passes no metadata), so without this the first requests wait while Triton
        compiles the kernels. ``PAGEDATTN_VLLM_WARMUP=0`` skips it. ``long_prefill_tokens``
        (default: the fewest whole 128-row tiles past the short-prefill rule at this head count on
        this device) is the second prefill size.
        """
        impl, dims, device = self.layer.impl, self.mla_dims, self.device
        dtype = self.model_config.dtype
        page = self.page_size
        runs = 0
        if isinstance(impl, PagedAttnMLAImpl):
            num_blocks = _scratch_blocks(decode_steps, page)
            width = dims.kv_lora_rank + dims.qk_rope_head_dim
            cache = torch.zeros(num_blocks, page, width, dtype=self.kv_cache_spec.dtype, device=device)
            blocks = sized_cache_blocks(self.vllm_config)
            # the real cache's 64-bit-offset kernel variants, which the scratch cache cannot reach
            large = blocks is not None and needs_int64_offsets(torch.empty(blocks, page, width, device="meta"))
            table_width = worker_block_table_width(self.kv_cache_spec, self.vllm_config)
            calls = []
            for step in decode_steps:
                if max(q for q, _ in step) > self.reorder_batch_threshold:
                    continue  # a speculative step, without speculative decoding configured
                common = _scratch_step(step, page, device, table_width)
                n = common.num_actual_tokens
                q_nope = torch.zeros(n, self.num_heads, dims.kv_lora_rank, dtype=dtype, device=device)
                q_pe = torch.zeros(n, self.num_heads, dims.qk_rope_head_dim, dtype=dtype, device=device)
                calls.append(lambda common=common, q_nope=q_nope, q_pe=q_pe: impl.forward_mqa(
                    (q_nope, q_pe), cache, self.build(0, common), self.layer))
            runs += warm_up_calls(calls, large, warm_up_jobs())
        prefill = self._prefill_backend
        if isinstance(prefill, PagedAttnMLAPrefill) and prefill_tokens > 0:
            if long_prefill_tokens is None:
                long_prefill_tokens = 128 * (SHORT_PREFILL_WAVES * num_sms(device) // self.num_heads + 1)
            calls = self._prefill_warm_up_calls(prefill, prefill_tokens, long_prefill_tokens)
            runs += warm_up_calls(calls, self._prefill_is_large(), warm_up_jobs())
        return runs

    def _prefill_warm_up_calls(self, prefill: PagedAttnMLAPrefill, short_tokens: int, long_tokens: int) -> list:
        """The prefill calls of :meth:`warm_up` (see PREFILL_WARMUP_TOKENS), on zero scratch tensors."""
        dims, device, dtype = self.mla_dims, self.device, self.model_config.dtype
        qk = dims.qk_nope_head_dim + dims.qk_rope_head_dim
        calls = []
        for n in (short_tokens, long_tokens):
            cu_q = torch.tensor([0, n], dtype=torch.int32, device=device)
            q = torch.zeros(n, self.num_heads, qk, dtype=dtype, device=device)
            v = torch.zeros(n, self.num_heads, dims.v_head_dim, dtype=dtype, device=device)
            scratch = prefill.clone()
            scratch.prepare_metadata(_PrefillStandIn(query_start_loc=cu_q, max_query_len=n))
            calls += [lambda scratch=scratch, q=q, v=v, lse=lse: scratch.run_prefill_new_tokens(q, q, v, lse)
                      for lse in (False, True)]
            for per_query in (1, CONTEXT_WARMUP_KEYS_PER_QUERY) if n == short_tokens else (1,):
                keys = n * per_query
                k_ctx = torch.zeros(keys, self.num_heads, qk, dtype=dtype, device=device)
                v_ctx = torch.zeros(keys, self.num_heads, dims.v_head_dim, dtype=dtype, device=device)
                chunk = _PrefillStandIn(query_start_loc=cu_q, max_query_len=n,
                                        cu_seq_lens=torch.tensor([0, keys], dtype=torch.int32, device=device))
                calls.append(lambda scratch=scratch, chunk=chunk, q=q, k=k_ctx, v=v_ctx:
                             scratch.run_prefill_context_chunk(chunk, q, k, v))
        return calls

    def _prefill_is_large(self) -> bool:
        """Whether a prefill call's K or V can span 2**31 elements (the kernel's 64-bit offsets):
        new tokens up to ``max_num_batched_tokens``, a context chunk up to vLLM's chunked-prefill
        workspace, V read from the decompressed ``[tokens, heads, nope + v]`` rows."""
        dims = self.mla_dims
        tokens = max(self.vllm_config.scheduler_config.max_num_batched_tokens, self.chunked_prefill_workspace_size)
        width = max(dims.qk_nope_head_dim + dims.qk_rope_head_dim, dims.qk_nope_head_dim + dims.v_head_dim)
        return needs_int64_offsets(torch.empty(tokens, self.num_heads, width, device="meta"))

    def _build_decode(self, block_table_tensor, seq_lens_device, max_seq_len, query_start_loc_cpu,
                      query_start_loc_device, num_decode_tokens, dcp_tot_seq_lens_device=None,
                      **kwargs) -> PagedAttnMLADecodeMetadata:
        # 0.33 also passes max_query_len (in kwargs): min(the batch's, the decode threshold), an
        # upper bound; the decodes' own widest query is read from the host offsets instead
        qsl = query_start_loc_cpu.tolist()  # host copy: no synchronization
        widest = max((b - a for a, b in zip(qsl, qsl[1:])), default=1)
        num_splits = 1 if self.batch_invariant else None
        if num_decode_tokens <= self.graph_max_tokens and widest <= self.graph_max_query_len:
            planned_len = self.max_model_len
        else:
            planned_len = 1 << max(0, int(max_seq_len) - 1).bit_length()
        return PagedAttnMLADecodeMetadata(
            block_table=block_table_tensor, seq_lens=seq_lens_device, dcp_tot_seq_lens=dcp_tot_seq_lens_device,
            query_start_loc=query_start_loc_device, max_query_len=max(widest, 1), max_seq_len=planned_len,
            num_splits=num_splits)


class PagedAttnMLAImpl(MLACommonImpl[MLACommonMetadata]):
    """One MLA layer's decode attention and cache write (prefill: :class:`PagedAttnMLAPrefill`)."""

    can_return_lse_for_decode: bool = True

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None, attn_type: str, kv_sharing_target_layer_name: str | None,
                 **mla_args) -> None:
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap:
            raise NotImplementedError("pagedattn's MLA backend has no alibi_slopes, sliding_window or "
                                      "logits_soft_cap")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"attn_type {attn_type!r}: pagedattn's MLA backend serves decoder "
                                      "self-attention only")
        if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; use one of "
                             f"{SUPPORTED_KV_CACHE_DTYPES}")
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args)
        check_mla_dims("kv_lora_rank", self.kv_lora_rank, "qk_rope_head_dim", self.qk_rope_head_dim)
        self._fp8 = kv_cache_dtype in FP8_KV_CACHE_DTYPES
        if self._fp8:
            self.supports_quant_query_input = False  # the kernel takes bf16/fp16 queries over an fp8 cache

    def _cache(self, kv_cache: torch.Tensor) -> torch.Tensor:
        return fp8_view(kv_cache) if self._fp8 else kv_cache

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor,
                           skip_scale: bool = False) -> None:
        """Write the step's latents ``[c_kv | k_pe]`` into the cache (slot -1: padding, skipped)."""
        if kv_cache.numel() == 0:
            return
        n = slot_mapping.shape[0]
        pagedattn.write_mla_kv(kv_c_normed[:n], k_pe.reshape(k_pe.shape[0], -1)[:n], self._cache(kv_cache),
                               slot_mapping.flatten(), kv_scale=None if skip_scale else k_scale)

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: MLACommonMetadata,
                    layer) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Absorbed decode: ``q`` ``(ql_nope [B, H, kv_lora_rank], q_pe [B, H, rope])`` or the two
        concatenated; returns the latent output ``[B, H, kv_lora_rank]`` and, under decode
        context parallelism, the lse ``[B, H]`` vLLM combines the ranks with."""
        if isinstance(q, tuple):
            q_nope, q_pe = q
        else:
            q_nope, q_pe = q[..., : self.kv_lora_rank], q[..., self.kv_lora_rank:]
        md = attn_metadata.decode
        if not isinstance(md, PagedAttnMLADecodeMetadata):
            raise TypeError(f"attn_metadata.decode must come from PagedAttnMLAMetadataBuilder, got {type(md).__name__}")
        res = pagedattn.mla_decode(
            q_nope, q_pe, self._cache(kv_c_and_k_pe_cache), md.block_table, md.seq_lens, md.query_start_loc,
            scale=self.scale, max_query_len=md.max_query_len, max_seq_len=md.max_seq_len, num_splits=md.num_splits,
            kv_scale=layer._k_scale if self._fp8 else None, return_lse=self.dcp_world_size > 1)
        return res if isinstance(res, tuple) else (res, None)


class PagedAttnMLABackend(MLACommonBackend):
    """pagedattn's MLA backend, vLLM's ``CUSTOM`` for a model with latent attention."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(SUPPORTED_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[PagedAttnMLAImpl]:
        return PagedAttnMLAImpl

    @staticmethod
    def get_builder_cls() -> type[PagedAttnMLAMetadataBuilder]:
        return PagedAttnMLAMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return True  # Triton's targets; an unsupported GPU fails in Triton with its own message

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True
