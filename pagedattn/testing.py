"""Random paged batches and tolerances, shared by the tests, ``pagedattn check`` and the benchmarks."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch

# One tolerance table per dtype: (atol, rtol) of outputs and lse against the float64 reference,
# for unit-variance random inputs.
TOLERANCES = {
    torch.float32: (2e-4, 2e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


@dataclass
class PagedBatch:
    """Inputs of one ``paged_attention`` call; ``cases`` are (query_len, seq_len) per sequence."""

    cases: list
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    extra: dict = field(default_factory=dict)

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_table, self.seq_lens, self.query_start_loc)


def fill_block_table(block_table: torch.Tensor, pages, physical: torch.Tensor) -> torch.Tensor:
    """Write sequence s's ``pages[s]`` block ids, taken in order from ``physical``, into the start
    of its row of ``block_table`` (in place; returned)."""
    offset = 0
    for s, n in enumerate(pages):
        block_table[s, :n] = physical[offset:offset + n].to(torch.int32)
        offset += n
    return block_table


def query_start_loc_of(cases) -> torch.Tensor:
    """``[num_seqs + 1]`` int32 offsets of ``(query_len, seq_len)`` cases' queries."""
    qsl = torch.zeros(len(cases) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([q for q, _ in cases], dtype=torch.int64), 0).to(torch.int32)
    return qsl


def make_paged_batch(
    cases,
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float16,
    cache_dtype: torch.dtype | None = None,
    device="cpu",
    spare_blocks: int = 3,
    num_blocks: int | None = None,
    generator: torch.Generator | None = None,
) -> PagedBatch:
    """A batch with random data and a random block table (physical blocks in shuffled order).

    ``num_blocks`` larger than needed leaves the other blocks uninitialized (``torch.empty``),
    which lets a test build a cache past 2**31 elements without touching most of its memory;
    the batch then uses the highest block ids.
    """
    g = generator
    pages = [-(-kv // block_size) for _, kv in cases]
    needed = sum(pages)
    max_pages = max(pages + [1])
    if num_blocks is None:
        num_blocks = needed + spare_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        k_cache = torch.randn(shape, generator=g, dtype=torch.float32).to(device)
        v_cache = torch.randn(shape, generator=g, dtype=torch.float32).to(device)
        physical = torch.randperm(num_blocks, generator=g)[:needed]
    else:
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        k_cache = torch.empty(shape, dtype=cache_dtype or dtype, device=device)
        v_cache = torch.empty(shape, dtype=cache_dtype or dtype, device=device)
        physical = num_blocks - 1 - torch.randperm(needed, generator=g)
        used = physical.to(device)
        k_cache[used] = torch.randn(needed, *shape[1:], generator=g).to(device, k_cache.dtype)
        v_cache[used] = torch.randn(needed, *shape[1:], generator=g).to(device, v_cache.dtype)
    k_cache = k_cache.to(cache_dtype or dtype)
    v_cache = v_cache.to(cache_dtype or dtype)

    block_table = fill_block_table(
        torch.randint(0, num_blocks, (len(cases), max_pages), generator=g, dtype=torch.int32), pages, physical)
    query_start_loc = query_start_loc_of(cases)
    num_tokens = int(query_start_loc[-1])
    q = torch.randn(num_tokens, num_q_heads, head_size, generator=g, dtype=torch.float32).to(device, dtype)
    return PagedBatch(
        cases=list(cases),
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table.to(device),
        seq_lens=torch.tensor([kv for _, kv in cases], dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        max_query_len=max([ql for ql, _ in cases] + [0]),
        max_seq_len=max([kv for _, kv in cases] + [0]),
    )


def feature_kwargs(name: str, num_q_heads: int, num_seqs: int, device="cpu", generator=None) -> dict:
    """Keyword arguments that turn on one named feature (see ``FEATURES``)."""
    g = generator
    if name == "causal":
        return {}
    if name == "noncausal":
        return {"causal": False}
    if name == "window":
        return {"sliding_window": 7}
    if name == "window_noncausal":
        return {"sliding_window": 5, "causal": False}
    if name == "softcap":
        return {"softcap": 1.5, "scale": 0.5}
    if name == "alibi":
        return {"alibi_slopes": torch.rand(num_q_heads, generator=g).to(device) * 0.5}
    if name == "alibi_sqrt":
        return {"alibi_slopes": torch.rand(num_q_heads, generator=g).to(device) * 0.5, "alibi_sqrt": True}
    if name == "sinks":
        return {"sinks": (torch.randn(num_q_heads, generator=g) * 2).to(device), "sliding_window": 9}
    if name == "prefix":
        ranges = torch.zeros(num_seqs, 2, 2, dtype=torch.int32)
        for s in range(num_seqs):
            start = int(torch.randint(0, 12, (1,), generator=g))
            ranges[s, 0] = torch.tensor([start, start + 1 + int(torch.randint(1, 20, (1,), generator=g))])
            ranges[s, 1] = torch.tensor([5, 5])  # padding row
        return {"prefix_ranges": ranges.to(device), "sliding_window": 4}
    if name == "scale":
        return {"scale": 0.3}
    raise KeyError(name)


FEATURES = [
    "causal", "noncausal", "window", "window_noncausal", "softcap", "alibi", "alibi_sqrt",
    "sinks", "prefix", "scale",
]

# (query_len, seq_len) per sequence: decode-only, prefill-only, and mixed with odd lengths.
BATCHES = {
    "decode": [(1, 17), (1, 129), (1, 1), (1, 463)],
    "prefill": [(17, 17), (129, 129), (1, 1)],
    "mixed": [(1, 463), (5, 18), (0, 7), (33, 129), (1, 1), (17, 40)],
}

# (num_q_heads, num_kv_heads, head_size, block_size) of the GPU shape tests, by test id: model head
# layouts beside Llama's, head sizes that are not powers of two, pages from 16 to 128 tokens.
GPU_SHAPES = {
    "gptoss-like": (64, 8, 64, 16),
    "gemma-like": (8, 4, 256, 16),
    "mqa-head80": (16, 1, 80, 32),
    "mha-head96": (12, 12, 96, 64),
    "head192-page128": (8, 2, 192, 128),
    "head8": (4, 4, 8, 16),
}


def max_errors(out, lse, ref_out, ref_lse):
    """(max |out - ref|, max |lse - ref| over finite entries, lse -inf pattern matches)."""
    out_err = (out.double() - ref_out.to(out.device)).abs().max().item() if out.numel() else 0.0
    if lse is None:
        return out_err, 0.0, True
    ref_lse = ref_lse.to(lse.device)
    finite = torch.isfinite(ref_lse)
    same_inf = bool(torch.equal(finite, torch.isfinite(lse)))
    lse_err = (lse.double() - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
    return out_err, lse_err, same_inf


def within_tolerance(out, lse, ref_out, ref_lse) -> bool:
    atol, rtol = TOLERANCES[out.dtype]
    if torch.isnan(out).any() or (lse is not None and torch.isnan(lse).any()):
        return False
    ok = torch.allclose(out.double(), ref_out.to(out.device), atol=atol, rtol=rtol)
    if lse is not None:
        _, _, same_inf = max_errors(out, lse, ref_out, ref_lse)
        finite = torch.isfinite(ref_lse.to(lse.device))
        ok = ok and same_inf and torch.allclose(
            lse.double()[finite], ref_lse.to(lse.device)[finite], atol=atol, rtol=rtol
        )
    return bool(ok)


def assert_matches_reference(out, lse, ref_out, ref_lse) -> None:
    """Assert out (and lse, if given) match the reference within TOLERANCES[out.dtype]: no NaN,
    the same -inf pattern of lse, and close values where finite."""
    atol, rtol = TOLERANCES[out.dtype]
    assert not torch.isnan(out).any(), "unwritten or NaN output"
    torch.testing.assert_close(out.double(), ref_out.to(out.device), atol=atol, rtol=rtol)
    if lse is None:
        return
    ref_lse = ref_lse.to(lse.device)
    assert not torch.isnan(lse).any(), "NaN lse"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)), "lse -inf pattern differs"
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=atol, rtol=rtol)


def captured(step) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``step()``: run once on a side stream first (compiles the kernels and records
    the launches, which a capture must not do), then captured on the caller's device."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def make_mla_batch(cases, *, num_heads: int = 128, latent: int = 512, rope: int = 64, block_size: int = 16,
                   dtype=torch.bfloat16, cache_dtype=None, num_blocks: int | None = None, split_q: bool = True,
                   seed: int = 0, device="cuda"):
    """Inputs of one ``mla_decode`` call for ``(query_len, seq_len)`` cases: random latents in a
    paged cache under shuffled block ids, ``(kwargs, max_query_len, max_seq_len)``.

    Table entries past a sequence's pages hold -1 or ids past the cache (never to be read).
    ``num_blocks``: a cache that large, the batch in its top blocks (the rest left unwritten).
    ``split_q``: q_nope and q_pe as views of one ``[tokens, heads, latent + rope]`` tensor, as a
    fused projection gives them.
    """
    g = torch.Generator().manual_seed(seed)
    pages = [-(-kv // block_size) for _, kv in cases]
    needed = sum(pages)
    width = latent + rope
    cache_dtype = cache_dtype or dtype
    if num_blocks is None:
        num_blocks = needed + 3
        kv_cache = torch.randn(num_blocks, block_size, width, generator=g).to(device, cache_dtype)
        physical = torch.randperm(num_blocks, generator=g)[:needed]
    else:
        kv_cache = torch.empty(num_blocks, block_size, width, dtype=cache_dtype, device=device)
        physical = num_blocks - 1 - torch.randperm(needed, generator=g)
        kv_cache[physical.to(device)] = torch.randn(needed, block_size, width, generator=g).to(device, cache_dtype)
    block_table = torch.full((len(cases), max(pages + [1]) + 2), -1, dtype=torch.int32)
    block_table[1::2] = num_blocks + 1000
    fill_block_table(block_table, pages, physical)
    qsl = query_start_loc_of(cases)
    tokens = int(qsl[-1])
    if split_q:
        q = torch.randn(tokens, num_heads, width, generator=g).to(device, dtype)
        q_nope, q_pe = q[..., :latent], q[..., latent:]
    else:
        q_nope = torch.randn(tokens, num_heads, latent, generator=g).to(device, dtype)
        q_pe = torch.randn(tokens, num_heads, rope, generator=g).to(device, dtype)
    seq_lens = torch.tensor([kv for _, kv in cases], dtype=torch.int32)
    batch = dict(q_nope=q_nope, q_pe=q_pe, kv_cache=kv_cache, block_table=block_table.to(device),
                 seq_lens=seq_lens.to(device), query_start_loc=qsl.to(device))
    return batch, max(q for q, _ in cases), max(kv for _, kv in cases)


def use_scratch_allocator_when_instrumented() -> None:
    """Give Triton an allocator of global scratch memory when ``TRITON_INSTRUMENTATION_MODE`` is
    set on a CUDA GPU: ConSan (``=consan``) keeps its race-tracking state there and a launch
    fails without one. Nothing otherwise."""
    if os.environ.get("TRITON_INSTRUMENTATION_MODE") and torch.cuda.is_available():
        import triton

        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def runs_within(code: str, timeout: float, env: dict | None = None, fail_on: tuple[str, ...] = ()) -> str | None:
    """Run ``code`` in a fresh Python process: None when it exits 0 within ``timeout`` seconds,
    else what went wrong (its exit status and output's end, or that it was killed). A GPU kernel
    that never finishes (a barrier waiting forever) hangs its process, and a test that ran it
    in-process would hang the suite; from outside, the test fails instead. ``fail_on``: texts
    that fail the run wherever they appear in its output, whatever its exit status (a device-side
    checker's report)."""
    import os
    import subprocess
    import sys

    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return f"did not finish within {timeout:.0f} s (killed)"
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        return f"exit status {proc.returncode}: {output[-2000:]}"
    printed = [text for text in fail_on if text in output]
    if printed:
        return f"printed {printed}: {output[-2000:]}"
    return None


# what ConSan (triton 3.6) prints at a race it finds, before its device-side assert
CONSAN_REPORTS = ("pending access", "outstanding writes", "outstanding reads")


def runs_under_consan(code: str, cache_dir, env: dict | None = None, timeout: float = 400) -> str | None:
    """``runs_within`` under Triton's concurrency sanitizer (``TRITON_INSTRUMENTATION_MODE=consan``)
    with its own kernel cache in ``cache_dir`` (the cache key ignores the mode); a race report in
    the output fails the run even where the process exits 0."""
    env = {**(env or {}), "TRITON_INSTRUMENTATION_MODE": "consan", "TRITON_CACHE_DIR": str(cache_dir)}
    return runs_within(code, timeout, env=env, fail_on=CONSAN_REPORTS)


@contextlib.contextmanager
def environ_set(name: str, value: str):
    """``os.environ[name] = value`` inside the block, the old value (or none) after it."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
