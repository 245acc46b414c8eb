"""Host-side helpers shared by the peer adapters: import gates and metadata conversion.

Everything here runs on the CPU and imports neither peer, so the conversions are tested
without a GPU (tests/test_providers.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass

import torch


class NotApplicable(ValueError):
    """The peer cannot compute this case as asked (a feature, dtype or shape it lacks).

    Raised by ``prepare`` before anything launches; the message says what is missing.
    """


def module_status(name: str) -> tuple[bool, str]:
    """(importable, why not) for an optional top-level package."""
    try:
        missing = importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # already in sys.modules without a spec
        missing = name not in sys.modules
    if missing:
        return False, f"{name} is not installed"
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any import failure makes the peer unavailable
        return False, f"{name} does not import ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    return True, ""


def gpu_status() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "needs a CUDA GPU"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False, "TRITON_INTERPRET=1 (CPU run)"
    return True, ""


def jit_toolchain_status() -> tuple[bool, str]:
    """FlashInfer compiles each kernel variant with nvcc through ninja on first use."""
    if shutil.which("ninja") is None:
        return False, "ninja is not on PATH (FlashInfer builds its kernels with it on first use)"
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not cuda_home and shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"):
        return False, "no nvcc: set CUDA_HOME (FlashInfer compiles its kernels on first use)"
    return True, ""


def sm_version(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


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


def paged_csr(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> PagedCSR:
    """Convert pagedattn's ``[num_seqs, max_blocks]`` block table and KV lengths to CSR pages.

    Only the first ``ceil(seq_len / block_size)`` entries of each row are used; the rest of a
    row (padding) is ignored. A sequence without keys has no CSR form (FlashInfer's last page
    holds at least one key), so it is rejected.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    table = block_table.detach().cpu()
    lens = seq_lens.detach().cpu().to(torch.int64)
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


def query_lens_of(query_start_loc: list[int]) -> list[int]:
    return [b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:])]


def _consecutive(seqs: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(seqs[:-1], seqs[1:]))


@dataclass(frozen=True)
class DecodeSplit:
    """A batch cut into its single-token decodes and the rest (extends and prefills).

    ``order`` lists the sequences as the two wrapper calls see them: decodes first, then the
    rest, each in the caller's order (vLLM reorders its batch the same way once per step).
    When each part is already a consecutive run of sequences (``reorder`` False) both calls
    read and write views of the caller's q and out; otherwise the batch is permuted once,
    outside the timing, through ``token_order``.
    """

    decode: list[int]
    rest: list[int]
    reorder: bool
    token_order: list[int]  # token indices of the caller's batch, in ``order``

    @property
    def order(self) -> list[int]:
        return self.decode + self.rest


def split_decodes(query_start_loc: list[int]) -> DecodeSplit:
    q_lens = query_lens_of(query_start_loc)
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


def window_left(sliding_window: int | None) -> int:
    """pagedattn's window W (a query sees its own key and the W - 1 before it) as FlashInfer's
    ``window_left`` (keys strictly left of the query that stay visible); -1: no window."""
    if not sliding_window:
        return -1
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    return int(sliding_window) - 1


def host_time_us(fn, calls: int = 50) -> float:
    """Host time of one call: ``calls`` back-to-back calls without synchronizing, wall / calls.

    One warm-up call and a synchronize come first; the device drains after the clock stops.
    """
    import time

    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    wall = time.perf_counter() - t0
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return wall / calls * 1e6
