"""FlashInfer's paged wrappers (decode, prefill, MLA) on pagedattn's own cache tensors.

pagedattn's cache ``[num_blocks, block_size, num_kv_heads, head_size]`` is FlashInfer's "NHD"
paged layout; K and V go in as a tuple, so nothing is copied. The block table and KV lengths
become FlashInfer's page lists (``indptr`` / ``indices`` / ``last_page_len``, :func:`paged_csr`)
once per batch, and each wrapper is planned once per batch (:func:`plan_decode`,
:func:`plan_prefill`), as engines call them:

* single-token decodes: ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores for GQA groups of
  4 and more, as vLLM and SGLang choose);
* prefills and extends: ``BatchPrefillWithPagedKVCacheWrapper``, causal, bottom-right aligned;
* a mixed batch: the decode wrapper on the decodes plus the prefill wrapper on the rest
  (:func:`split_decodes`), the split vLLM's FlashInfer backend makes;
* MLA decode: ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` with the latent and rope parts
  as two views of pagedattn's ``[num_blocks, block_size, 576]`` latent cache (:func:`mla_call`).

Windows (``window_left = W - 1``: the W most recent keys, the query's own included), the
logit softcap and the query scale are plan arguments. FlashInfer compiles each kernel variant
with nvcc on first use (tens of seconds to minutes): the first plan and run of a shape pay it.
Users: the ``flashinfer`` backend (:mod:`pagedattn.backends.flashinfer`), the engine's
``attention="flashinfer"`` (:mod:`pagedattn.engine.flashinfer_backend`) and the benchmark's
providers (:mod:`pagedattn.bench.providers`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import torch

from pagedattn.adapters.common import NotApplicable, first_failure, gpu_status, module_status

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended float workspace (split-KV partials)
FA3_HEAD_SIZES = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)

_WORKSPACES: dict[tuple, torch.Tensor] = {}


def load():
    """The ``flashinfer`` module; NotApplicable (a ValueError) saying so when it does not import."""
    try:
        import flashinfer
    except ImportError as e:
        raise NotApplicable(f"flashinfer is not installed ({e})") from None
    return flashinfer


def jit_toolchain_status() -> tuple[bool, str]:
    """FlashInfer compiles each kernel variant with nvcc through ninja on first use."""
    if shutil.which("ninja") is None:
        return False, "ninja is not on PATH (FlashInfer builds its kernels with it on first use)"
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not cuda_home and shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"):
        return False, "no nvcc: set CUDA_HOME (FlashInfer compiles its kernels on first use)"
    return True, ""


def availability() -> tuple[bool, str]:
    """(can run here, why not): a CUDA GPU, the package, and the JIT toolchain."""
    return first_failure(gpu_status, lambda: module_status("flashinfer"), jit_toolchain_status)


def version() -> str:
    return getattr(load(), "__version__", "?")


def workspace(device: torch.device) -> torch.Tensor:
    """One float workspace per device, shared by every wrapper.

    The wrappers of a step execute one after another on one stream, so their split-KV partials
    never overlap in time (vLLM shares one buffer across its wrappers the same way). FlashInfer
    asks for zeros on first use.
    """
    device = torch.device(device)
    key = (device.type, device.index)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return ws


def check_dtypes(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    if q_dtype not in DTYPES:
        raise NotApplicable(f"FlashInfer's paged kernels take fp16/bf16, not {q_dtype}")
    if cache_dtype != q_dtype:
        raise NotApplicable(f"cache dtype {cache_dtype} differs from q's {q_dtype} (no fp8 scales wired)")


# ---------------------------------------------------------------------------------------------
# block_table + seq_lens -> page lists


@dataclass(frozen=True)
class PagedCSR:
    """One batch's pages in FlashInfer's CSR form (host int32 tensors).

    Sequence ``s`` owns pages ``indices[indptr[s]:indptr[s+1]]`` in order, and its last page
    holds ``last_page_len[s]`` keys (1 .. block_size).
    """

    indptr: torch.Tensor  # [num_seqs + 1]
    indices: torch.Tensor  # [indptr[-1]]
    last_page_len: torch.Tensor  # [num_seqs]
    seq_lens: torch.Tensor  # [num_seqs]

    def rows(self, start: int, end: int) -> "PagedCSR":
        """Sequences ``start .. end - 1`` alone (their indptr rebased to 0)."""
        a, b = int(self.indptr[start]), int(self.indptr[end])
        return PagedCSR(self.indptr[start:end + 1] - a, self.indices[a:b], self.last_page_len[start:end],
                        self.seq_lens[start:end])


def paged_csr(block_table: torch.Tensor, seq_lens, block_size: int) -> PagedCSR:
    """Convert pagedattn's ``[num_seqs, max_blocks]`` block table and KV lengths to CSR pages.

    Only the first ``ceil(seq_len / block_size)`` entries of each row are used; the rest of a
    row (padding) is ignored. A sequence without keys has no CSR form (FlashInfer's last page
    holds at least one key), so it is rejected.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    table = block_table.detach().cpu()
    lens = torch.as_tensor(seq_lens).detach().cpu().to(torch.int64)
    if table.dim() != 2 or lens.dim() != 1 or table.shape[0] != lens.shape[0]:
        raise ValueError(f"block_table {tuple(table.shape)} and seq_lens {tuple(lens.shape)} do not match")
    if lens.numel() and int(lens.min()) < 1:
        raise NotApplicable("a sequence with no keys has no page list (FlashInfer's last page holds >= 1 key)")
    pages = (lens + block_size - 1) // block_size
    if pages.numel() and int(pages.max()) > table.shape[1]:
        raise ValueError(f"block_table has {table.shape[1]} columns; a sequence needs {int(pages.max())} pages")
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    indptr[1:] = pages.cumsum(0)
    used = torch.arange(table.shape[1])[None, :] < pages[:, None]
    indices = table[used]  # row-major: each sequence's pages in order, sequences in order
    last = lens - (pages - 1) * block_size
    return PagedCSR(indptr.to(torch.int32), indices.to(torch.int32), last.to(torch.int32), lens.to(torch.int32))


# ---------------------------------------------------------------------------------------------
# decodes and the rest


def _consecutive(seqs: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(seqs[:-1], seqs[1:]))


@dataclass(frozen=True)
class DecodeSplit:
    """A batch cut into its single-token decodes and the rest (extends and prefills).

    ``order`` lists the sequences as the two wrapper calls see them: decodes first, then the
    rest, each in the caller's order (vLLM reorders its batch the same way once per step).
    When each part is already a consecutive run of sequences (``reorder`` False) both calls
    read and write views of the caller's q and out; otherwise the batch is permuted once
    through ``token_order``.
    """

    decode: list[int]
    rest: list[int]
    reorder: bool
    token_order: list[int]  # token indices of the caller's batch, in ``order``

    @property
    def order(self) -> list[int]:
        return self.decode + self.rest


def split_decodes(query_start_loc: list[int]) -> DecodeSplit:
    q_lens = [b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:])]
    decode = [s for s, n in enumerate(q_lens) if n == 1]
    rest = [s for s, n in enumerate(q_lens) if n != 1]
    reorder = not (_consecutive(decode) and _consecutive(rest))
    tokens = [t for s in decode + rest for t in range(query_start_loc[s], query_start_loc[s + 1])]
    return DecodeSplit(decode, rest, reorder, tokens)


def token_span(query_start_loc: list[int], seqs: list[int]) -> tuple[int, int]:
    """[start, end) of the tokens of a consecutive run of sequences."""
    if not seqs:
        return 0, 0
    if not _consecutive(seqs):
        raise ValueError(f"sequences {seqs} are not consecutive")
    return query_start_loc[seqs[0]], query_start_loc[seqs[-1] + 1]


def sub_query_start_loc(query_start_loc: list[int], seqs: list[int]) -> list[int]:
    """query_start_loc of the sequences ``seqs`` packed in that order, starting at 0."""
    out = [0]
    for s in seqs:
        out.append(out[-1] + query_start_loc[s + 1] - query_start_loc[s])
    return out


# ---------------------------------------------------------------------------------------------
# the wrappers


def window_left(sliding_window: int | None) -> int:
    """pagedattn's window W (a query sees its own key and the W - 1 before it) as FlashInfer's
    ``window_left`` (keys strictly left of the query that stay visible); -1: no window."""
    if not sliding_window:
        return -1
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    return int(sliding_window) - 1


def use_tensor_cores(num_q_heads: int, num_kv_heads: int) -> bool:
    """The decode wrapper's tensor-core kernel for GQA groups of 4 and more (vLLM's and SGLang's rule)."""
    return num_q_heads // num_kv_heads >= 4


def prefill_backend(device: torch.device, head_size: int) -> str:
    """``fa3`` on sm90 (Hopper) where FA3 instantiates the head size; elsewhere FlashInfer's
    ``auto`` (fa2 before Hopper)."""
    device = torch.device(device)
    if (device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
            and head_size in FA3_HEAD_SIZES):
        return "fa3"
    return "auto"


def decode_wrapper(ws: torch.Tensor, *, tensor_cores: bool, graph_size: int | None = None, graph_pages: int = 0):
    """A decode wrapper; with ``graph_size``, one for CUDA-graph replay with fixed buffers for
    ``graph_size`` sequences of up to ``graph_pages`` pages each."""
    fi = load()
    if graph_size is None:
        return fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
    device = ws.device
    buffers = dict(
        paged_kv_indptr_buffer=torch.zeros(graph_size + 1, dtype=torch.int32, device=device),
        paged_kv_indices_buffer=torch.zeros(graph_size * graph_pages, dtype=torch.int32, device=device),
        paged_kv_last_page_len_buffer=torch.zeros(graph_size, dtype=torch.int32, device=device),
    )
    return fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
                                                 **buffers)


def prefill_wrapper(ws: torch.Tensor, backend: str = "auto"):
    return load().BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)


def _plan_options(num_q_heads, num_kv_heads, head_size, block_size, dtype, scale, sliding_window, softcap):
    shape = (num_q_heads, num_kv_heads, head_size, block_size)
    options = dict(window_left=window_left(sliding_window), logits_soft_cap=float(softcap) if softcap else None,
                   sm_scale=None if scale is None else float(scale), q_data_type=dtype, kv_data_type=dtype)
    return shape, options


def plan_decode(wrapper, csr: PagedCSR, *, num_q_heads: int, num_kv_heads: int, head_size: int, block_size: int,
                dtype: torch.dtype, scale: float | None = None, sliding_window: int | None = None,
                softcap: float | None = None):
    """Plan ``wrapper`` for one batch of single-token queries over ``csr``'s pages; returns it.
    ``scale`` None: FlashInfer's default ``1 / sqrt(head_size)``."""
    shape, options = _plan_options(num_q_heads, num_kv_heads, head_size, block_size, dtype, scale,
                                   sliding_window, softcap)
    wrapper.plan(csr.indptr, csr.indices, csr.last_page_len, *shape, **options)
    return wrapper


def plan_prefill(wrapper, query_start_loc, csr: PagedCSR, *, num_q_heads: int, num_kv_heads: int, head_size: int,
                 block_size: int, dtype: torch.dtype, causal: bool = True, scale: float | None = None,
                 sliding_window: int | None = None, softcap: float | None = None):
    """Plan ``wrapper`` for a batch of any query lengths (``query_start_loc`` from 0, host) over
    ``csr``'s pages, queries at the end of their sequence; returns it."""
    shape, options = _plan_options(num_q_heads, num_kv_heads, head_size, block_size, dtype, scale,
                                   sliding_window, softcap)
    qo = torch.as_tensor(query_start_loc, dtype=torch.int32).cpu()
    wrapper.plan(qo, csr.indptr, csr.indices, csr.last_page_len, *shape, causal=causal, **options)
    return wrapper


def backend_name(wrapper, default: str = "?") -> str:
    """The kernel family a planned wrapper chose (``fa2``, ``fa3``, ...), for notes."""
    return getattr(wrapper, "_planned_backend_name", None) or getattr(wrapper, "_backend", default)


# ---------------------------------------------------------------------------------------------
# MLA


def mla_call(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
             query_start_loc: torch.Tensor, *, scale: float, latent_dim: int, out: torch.Tensor):
    """(zero-argument call, note): FlashInfer's MLA wrapper on pagedattn's latent cache.

    ``q`` is ``[num_tokens, num_heads, latent_dim + rope_dim]`` (absorbed query, then rope
    part); ``kv_cache`` is ``[num_blocks, block_size, latent_dim + rope_dim]``, passed as the
    two views FlashInfer's split layout takes: latent ``[..., :latent_dim]`` and rope
    ``[..., latent_dim:]`` (strided, no copy). The call writes ``out`` ``[num_tokens,
    num_heads, latent_dim]``. Queries of a sequence with more than one token are causal.
    FlashInfer 0.7's API (plan metadata, split layouts by name) and the one before it (0.6.14,
    which vLLM 0.26 ships: the indptrs and the four tensors as arguments) are both served.
    """
    load()
    import flashinfer.mla as fmla

    if q.dtype not in DTYPES:
        raise NotApplicable(f"FlashInfer's MLA wrapper takes fp16/bf16 queries, not {q.dtype}")
    if kv_cache.dtype != q.dtype:
        raise NotApplicable(f"latent cache dtype {kv_cache.dtype} differs from q's {q.dtype} (fp8 scales not wired)")
    device = q.device
    num_heads, rope_dim = q.shape[1], q.shape[2] - latent_dim
    block_size = kv_cache.shape[1]
    if kv_cache.shape[2] != latent_dim + rope_dim or rope_dim < 1:
        raise ValueError(f"kv_cache rows of {kv_cache.shape[2]} do not match q's {q.shape[2]} = {latent_dim} + rope")
    csr = paged_csr(block_table, seq_lens, block_size)
    qsl = query_start_loc.tolist()
    causal = max(b - a for a, b in zip(qsl[:-1], qsl[1:])) > 1
    indptrs = dict(qo_indptr=query_start_loc.to(device=device, dtype=torch.int32), kv_indptr=csr.indptr.to(device),
                   kv_indices=csr.indices.to(device), kv_len_arr=csr.seq_lens.to(device))
    dims = dict(num_heads=num_heads, head_dim_ckv=latent_dim, head_dim_kpe=rope_dim, page_size=block_size,
                causal=causal, sm_scale=float(scale), q_data_type=q.dtype, kv_data_type=kv_cache.dtype)
    wrapper = fmla.BatchMLAPagedAttentionWrapper(workspace(device), backend="auto")
    q_nope, q_pe = q[..., :latent_dim], q[..., latent_dim:]
    ckv, kpe = kv_cache[..., :latent_dim], kv_cache[..., latent_dim:]
    if hasattr(fmla, "MLAPlanMetadata"):  # 0.7: plan metadata and split layouts by name
        wrapper.plan(metadata=fmla.MLAPlanMetadata.csr(**indptrs), query_layout="split", kv_cache_layout="split",
                     **dims)

        def run():
            return wrapper.run(query=(q_nope, q_pe), kv_cache=(ckv, kpe), out=out)
    else:  # up to 0.6 (vLLM 0.26 ships 0.6.14): the indptrs and the four tensors as arguments
        wrapper.plan(**indptrs, **dims)

        def run():
            return wrapper.run(q_nope, q_pe, ckv, kpe, out=out)

    return run, f"MLA wrapper ({backend_name(wrapper)}, FlashInfer {version()})"
