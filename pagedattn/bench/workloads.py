"""Benchmark workloads (the reference workloads of BENCHMARKS.md): cases, their inputs and their work counts.

A case is a batch written as segments ``(count, query_len, seq_len)``: ``count`` consecutive
sequences with the same query and KV length. Decode B=8 L=4096 is ``[(8, 1, 4096)]``; the mixed
batch is ``[(1, 2048, 2048), (63, 1, 2049)]``.

Two mixes stand beside the reference ``mixed`` batch, each with prefill, extend and decode
sequences (this suite's choice):

* ``prefill-heavy``: 2 prefills of 4096 tokens, 2 extends of 512 tokens on 4096 cached, 16
  decodes at 4096 (compute-bound: ~97% of the FLOPs are prefill and extend);
* ``decode-heavy``: 1 prefill of 256, 1 extend of 512 on 3584 cached, 32 decodes at 8192
  (bandwidth-bound: the decodes read 1 GB of KV at bf16; their 2D grid, 32 x 8 programs,
  is below the split rule's threshold on an H200: a call of the decodes alone would be split-KV).

The heterogeneous suite (``--suite hetero``) holds batches whose sequences differ in length, where
balancing the work decides the time; each is reported beside its bytes floor (KV bytes read at
BYTES_FLOOR_TBPS):

* ``hetero``: a few long contexts among many short decodes, 2 x 16384 + 126 x 512 (floor 87 us
  at bf16) and 8 x 8192 + 56 x 256;
* ``specdecode``: speculative decode, 16 sequences x 6 new tokens at 8192 context.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

__all__ = [
    "WORKLOADS", "Case", "CaseInputs", "ContiguousGroup", "make_cases", "build_inputs", "work",
    "describe", "ALL_WORKLOADS", "SUITES", "HETERO_WORKLOADS", "MODEL_WORKLOADS", "BYTES_FLOOR_TBPS", "bytes_floor_us",
]

WORKLOADS = ("decode", "prefill", "extend", "mixed", "prefill-heavy", "decode-heavy", "gptoss", "gemma")
HETERO_WORKLOADS = ("hetero", "specdecode")
MODEL_WORKLOADS = ("gemma3", "llama3", "mistral")  # decode steps of a model's layers as vLLM runs them (docs/vllm.md)
ALL_WORKLOADS = WORKLOADS + HETERO_WORKLOADS + MODEL_WORKLOADS
# named sets of workloads: the reference workloads, the heterogeneous batches, model steps, or all
SUITES = {"reference": WORKLOADS, "hetero": HETERO_WORKLOADS, "models": MODEL_WORKLOADS, "all": ALL_WORKLOADS}

# Bandwidth of the bytes floor: the H200's decode read ceiling (cuDNN's paged decode reads at up
# to 4.6 TB/s on it, above a device copy's 4.25 TB/s of read + write).
BYTES_FLOOR_TBPS = 4.6

LLAMA = dict(num_q_heads=32, num_kv_heads=8, head_size=128)
GPTOSS = dict(num_q_heads=64, num_kv_heads=8, head_size=64, sliding_window=128, sinks=True)
GEMMA = dict(num_q_heads=8, num_kv_heads=4, head_size=256, sliding_window=1024, softcap=50.0)
# Gemma-3-12B: five local layers (1024-key window) to one global, heads of 256
GEMMA3 = dict(num_q_heads=16, num_kv_heads=8, head_size=256, sliding_window=1024)
# Mistral-7B: Llama-3.1-8B's heads (LLAMA) with a 4096-key window on every layer
MISTRAL_WINDOW = 4096
BLOCK_SIZE = 16
MAX_DECODE_TOKENS = 4 * 1024 * 1024  # skip decode cases with B * L above this
# Caches laid out as vLLM's engine lays them (``params["cache"]``): one allocation per layer,
# ENGINE_POOL_FACTOR times the blocks a case reads (vLLM sizes a layer's cache to the free memory:
# Llama-3.1-8B at 85% of an H200 gives each layer about 3 GB, 5.7x a 64 x 2048 batch), block 0
# left out (vLLM's null block) and each sequence's pages in order after the last one's, as a fresh
# engine's free-block queue hands them out. "engine": K and V in two planes of that allocation,
# ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (vLLM's FLASH_ATTN cache);
# "engine-interleaved": K and V side by side in each head's row,
# ``[num_blocks, block_size, num_kv_heads, 2 * head_size]`` (its cache for pagedattn's backend);
# "engine-scattered": that interleaved cache with the batch's pages drawn at random from the
# whole pool, as an engine's free-block queue hands them out after many requests have come and
# gone (the reads then span the 3 GB allocation rather than its first sixth).
# Inside vLLM on the H200 pagedattn's decode kernel ran 22% slower than in the shuffled bench
# cache and FA3's did not (docs/vllm.md, "Where the time goes, per kernel"); these cases time
# both kernels in the engine's layouts alone, at the first decode step's context (they did not
# reproduce it).
ENGINE_POOL_FACTOR = 6
CACHE_LAYOUTS = ("shuffled", "engine", "engine-interleaved", "engine-scattered")


@dataclass(frozen=True)
class Case:
    """One benchmark case; ``params`` is JSON-ready (heads, segments, features)."""

    name: str
    workload: str  # one of WORKLOADS
    kind: str  # decode | prefill | extend | mixed: which metric is the main one
    params: dict = field(default_factory=dict)

    @property
    def segments(self) -> list[tuple[int, int, int]]:
        return [tuple(s) for s in self.params["segments"]]

    @property
    def query_lens(self) -> list[int]:
        return [q for n, q, _ in self.segments for _ in range(n)]

    @property
    def seq_lens(self) -> list[int]:
        return [kv for n, _, kv in self.segments for _ in range(n)]

    @property
    def num_seqs(self) -> int:
        return sum(n for n, _, _ in self.segments)

    @property
    def num_tokens(self) -> int:
        return sum(n * q for n, q, _ in self.segments)

    @property
    def features(self) -> dict:
        """Attention options beyond the Llama baseline (window, softcap, sinks)."""
        p = self.params
        return {k: p[k] for k in ("sliding_window", "softcap", "sinks") if p.get(k)}


def _case(name, workload, kind, segments, shape, block_size=BLOCK_SIZE, cache: str = "shuffled") -> Case:
    if cache not in CACHE_LAYOUTS:
        raise ValueError(f"cache must be one of {CACHE_LAYOUTS}, got {cache!r}")
    params = dict(
        num_q_heads=shape["num_q_heads"],
        num_kv_heads=shape["num_kv_heads"],
        head_size=shape["head_size"],
        block_size=block_size,
        segments=[list(s) for s in segments],
        sliding_window=shape.get("sliding_window"),
        softcap=shape.get("softcap"),
        sinks=bool(shape.get("sinks", False)),
    )
    if cache != "shuffled":
        params["cache"] = cache
    return Case(name=name, workload=workload, kind=kind, params=params)


def _decode_cases(workload, prefix, shape, batches, contexts) -> list[Case]:
    cases = []
    for b in batches:
        for ctx in contexts:
            if b * ctx <= MAX_DECODE_TOKENS:
                cases.append(_case(f"{prefix}decode B={b} L={ctx}", workload, "decode", [(b, 1, ctx)], shape))
    return cases


def _prefill_cases(workload, prefix, shape, lengths) -> list[Case]:
    return [_case(f"{prefix}prefill S={s}", workload, "prefill", [(1, s, s)], shape) for s in lengths]


def _mix_name(segments) -> str:
    """``P2x4096 + E2x512@4608 + D16@4096``: prefill count x length, extend count x new tokens @ seq_len,
    decode count @ seq_len."""
    parts = []
    for n, q, kv in segments:
        if q == 1:
            parts.append(f"D{n}@{kv}")
        elif q < kv:
            parts.append(f"E{n}x{q}@{kv}")
        else:
            parts.append(f"P{n}x{q}")
    return " + ".join(parts)


def make_cases(workloads=WORKLOADS, *, quick: bool = False, tiny_heads: bool = False) -> list[Case]:
    """The cases of the named workloads, in a stable order.

    ``quick`` shrinks every length; ``tiny_heads`` (for the CPU interpreter) also shrinks the
    head counts while keeping each workload's head size and features.
    """
    llama, gptoss, gemma, gemma3 = dict(LLAMA), dict(GPTOSS), dict(GEMMA), dict(GEMMA3)
    if quick:
        gptoss["sliding_window"] = 16
        gemma["sliding_window"] = gemma3["sliding_window"] = 32
    if tiny_heads:
        llama.update(num_q_heads=4, num_kv_heads=2, head_size=32)
        gptoss.update(num_q_heads=4, num_kv_heads=2)
        gemma.update(num_q_heads=2, num_kv_heads=1)
        gemma3.update(num_q_heads=2, num_kv_heads=1)
    mistral = dict(llama, sliding_window=16 if quick else MISTRAL_WINDOW)

    if quick:
        decode_b, decode_l, prefill_s = (1, 2), (64, 200), (64,)
        extend = (2, 16, 64)  # sequences, new tokens, context
        mixed = (32, 3)  # prefill length, decodes
        heavy = {"prefill-heavy": [(1, 48, 48), (1, 16, 80), (2, 1, 64)],
                 "decode-heavy": [(1, 16, 16), (1, 8, 72), (4, 1, 128)]}
        feat_b, feat_l, feat_s = 2, 64, 64
        hetero = ([(2, 1, 256), (6, 1, 16)], [(2, 1, 128), (4, 1, 8)])
        specdecode = (4, 6, 128)  # sequences, new tokens, context
        gemma3_steps = ((2, 64),)  # (batch, context) of the model workloads' decode steps
        llama_steps = ((2, 64), (4, 32))
        traffic_step = (6, 8, 200)  # sequences, shortest and longest context
        chunk_step = (6, (48, 32, 40))  # decodes beside the chunk, its prompts' lengths
        mistral_steps = ((2, 40), (4, 16))
    else:
        decode_b, decode_l, prefill_s = (1, 8, 32, 128), (512, 4096, 32768), (512, 2048, 8192, 32768)
        extend = (4, 512, 4096)
        mixed = (2048, 63)
        heavy = {"prefill-heavy": [(2, 4096, 4096), (2, 512, 4608), (16, 1, 4096)],
                 "decode-heavy": [(1, 256, 256), (1, 512, 4096), (32, 1, 8192)]}
        feat_b, feat_l, feat_s = 32, 4096, 4096
        hetero = ([(2, 1, 16384), (126, 1, 512)], [(8, 1, 8192), (56, 1, 256)])
        specdecode = (16, 6, 8192)
        # batch 1 at the TPOT request's context (500 + 128 tokens), then the uniform points of
        # docs/vllm.md's Gemma-3 and Llama-3.1-8B grids
        gemma3_steps = ((1, 512), (16, 4096), (64, 2048))
        llama_steps = ((1, 512), (16, 4096), (64, 2048), (128, 1024))
        # a decode step of vLLM's traffic run (96 requests of 64-4096 prompt and 16-512 output
        # tokens): 64 sequences of about 90-4300 keys in no order (docs/vllm.md, "Where the time
        # goes, per kernel")
        traffic_step = (64, 90, 4300)
        # a step of that run that carries a prompt chunk: the 8192-token budget filled by 56
        # decodes (first, as vLLM orders them) and whole prompts (the last one cut off)
        chunk_step = (56, (3000, 2000, 3136))
        # the middle of the 256 timed steps at vLLM's 16 x 4096 point (the window bites), and 64 x
        # 2048 (it does not)
        mistral_steps = ((16, 4224), (64, 2048))

    cases: list[Case] = []
    for w in workloads:
        if w == "decode":
            cases += _decode_cases("decode", "", llama, decode_b, decode_l)
        elif w == "prefill":
            cases += _prefill_cases("prefill", "", llama, prefill_s)
        elif w == "extend":
            n, new, ctx = extend
            cases.append(_case(f"extend {n}x{new}@{ctx}", "extend", "extend", [(n, new, ctx + new)], llama))
        elif w == "mixed":
            s, d = mixed
            segs = [(1, s, s), (d, 1, s + 1)]
            cases.append(_case(f"mixed 1x{s}+{d}x1@{s + 1}", "mixed", "mixed", segs, llama))
        elif w in heavy:
            cases.append(_case(f"{w} {_mix_name(heavy[w])}", w, "mixed", heavy[w], llama))
        elif w in ("gptoss", "gemma"):
            shape = gptoss if w == "gptoss" else gemma
            cases += _decode_cases(w, f"{w} ", shape, (feat_b,), (feat_l,))
            cases += _prefill_cases(w, f"{w} ", shape, (feat_s,))
        elif w == "hetero":
            for segs in hetero:
                name = " + ".join(f"{n}x{kv}" for n, _, kv in segs)
                cases.append(_case(f"hetero {name}", "hetero", "decode", segs, llama))
        elif w == "specdecode":
            n, new, ctx = specdecode
            cases.append(_case(f"specdecode {n}x{new}@{ctx}", "specdecode", "decode", [(n, new, ctx)], llama))
        elif w == "gemma3":  # a local layer's and a global layer's decode at each point
            for b, ctx in gemma3_steps:
                cases += _decode_cases(w, "gemma3 local ", gemma3, (b,), (ctx,))
                cases += _decode_cases(w, "gemma3 global ", dict(gemma3, sliding_window=None), (b,), (ctx,))
        elif w == "llama3":  # Llama-3.1-8B's decode at the grid points (the reference decode's are others)
            for b, ctx in llama_steps:
                cases += _decode_cases(w, "llama3 ", llama, (b,), (ctx,))
            # the two points where FA3 led inside vLLM, at the first decode step's context (one
            # key past a page) in the engine's cache layouts
            for b, ctx in llama_steps[-3:-1]:
                for cache in CACHE_LAYOUTS[1:]:
                    cases.append(_case(f"llama3 {cache} cache decode B={b} L={ctx + 1}", w, "decode",
                                       [(b, 1, ctx + 1)], llama, cache=cache))
            n, shortest, longest = traffic_step
            lengths = random.Random(0).choices(range(shortest, longest + 1), k=n)
            cases.append(_case(f"llama3 traffic decode B={n} L={shortest}-{longest}", w, "decode",
                               [(1, 1, kv) for kv in lengths], llama))
            # the chunk step, and its decodes and its prompts alone: which part costs what
            decodes, prompts = chunk_step
            decode_segs = [(1, 1, kv) for kv in lengths[:decodes]]
            prompt_segs = [(1, p, p) for p in prompts]
            chunk = f"{decodes}x1+{'+'.join(str(p) for p in prompts)}"
            cases.append(_case(f"llama3 traffic chunk step {chunk}", w, "mixed", decode_segs + prompt_segs, llama))
            cases.append(_case(f"llama3 traffic chunk decodes {decodes}x1", w, "decode", decode_segs, llama))
            cases.append(_case(f"llama3 traffic chunk prompts {'+'.join(str(p) for p in prompts)}", w, "prefill",
                               prompt_segs, llama))
        elif w == "mistral":  # each step with and without the window: its cost at equal lengths
            for b, ctx in mistral_steps:
                cases += _decode_cases(w, "mistral ", mistral, (b,), (ctx,))
                cases += _decode_cases(w, "mistral no-window ", dict(mistral, sliding_window=None), (b,), (ctx,))
        else:
            raise ValueError(f"unknown workload {w!r}; choose from {', '.join(ALL_WORKLOADS)}")
    return cases


# ---------------------------------------------------------------------------------------------
# Work counts: what a call must read and compute, for GB/s, TFLOP/s and the floor time.


def _visible_keys(q_len: int, kv_len: int, window: int | None) -> tuple[float, int]:
    """(query-key pairs a causal call computes, keys it must read) for one sequence.

    Without a window the pairs follow the usual convention ``q*(kv-q) + q*q/2`` (S*S/2 for a
    prefill); with one they are counted exactly.
    """
    first = kv_len - q_len  # position of the first query
    if not window:
        return q_len * first + q_len * q_len / 2, kv_len
    # query at position p sees min(p + 1, W) keys; x = p + 1 runs over first+1 .. kv_len
    lo, hi = first + 1, kv_len
    below = max(0, min(hi, window) - lo + 1)  # x <= W: sum of x
    below_sum = (lo + lo + below - 1) * below // 2 if below else 0
    above = (hi - lo + 1) - below
    keys_read = kv_len - max(0, first - window + 1)
    return below_sum + above * window, keys_read


def work(case: Case, dtype: torch.dtype) -> dict:
    """``{"flops", "kv_bytes"}`` of one call; kv_bytes counts K and V of every key it must read."""
    p = case.params
    elt = torch.empty((), dtype=dtype).element_size()
    flops, keys = 0.0, 0
    for n, q, kv in case.segments:
        pairs, read = _visible_keys(q, kv, p.get("sliding_window"))
        flops += n * 4.0 * p["num_q_heads"] * p["head_size"] * pairs
        keys += n * read
    return {"flops": flops, "kv_bytes": float(keys * p["num_kv_heads"] * p["head_size"] * 2 * elt)}


def bytes_floor_us(kv_bytes: float, tbps: float = BYTES_FLOOR_TBPS) -> float:
    """Time to read ``kv_bytes`` at ``tbps`` TB/s, in microseconds: a decode call's lower bound."""
    return kv_bytes / (tbps * 1e12) * 1e6


# ---------------------------------------------------------------------------------------------
# Inputs


@dataclass
class ContiguousGroup:
    """Sequences ``first .. first+count-1`` of one segment, in SDPA layout (heads before length)."""

    first: int
    count: int
    query_len: int
    seq_len: int
    q: torch.Tensor  # [count, num_q_heads, query_len, head_size]
    k: torch.Tensor  # [count, num_kv_heads, seq_len, head_size]
    v: torch.Tensor  # [count, num_kv_heads, seq_len, head_size]


@dataclass
class CaseInputs:
    """Everything one call of ``paged_attention`` needs, on one device."""

    case: Case
    q: torch.Tensor  # [num_tokens, num_q_heads, head_size]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    features: dict  # causal, sliding_window, softcap, sinks (tensor) as paged_attention kwargs
    _groups: list[ContiguousGroup] | None = None

    def paged_args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_table, self.seq_lens, self.query_start_loc)

    def paged_kwargs(self) -> dict:
        return dict(max_query_len=self.max_query_len, max_seq_len=self.max_seq_len, **self.features)

    def contiguous(self) -> list[ContiguousGroup]:
        """Contiguous K/V (and Q) per segment, gathered from the cache once and kept."""
        if self._groups is None:
            self._groups = []
            first, tok = 0, 0
            bs = self.k_cache.shape[1]
            for n, q_len, kv_len in self.case.segments:
                pages = self.block_table[first:first + n, : -(-kv_len // bs)].long()
                k = self.k_cache[pages].flatten(1, 2)[:, :kv_len].transpose(1, 2).contiguous()
                v = self.v_cache[pages].flatten(1, 2)[:, :kv_len].transpose(1, 2).contiguous()
                q = self.q[tok:tok + n * q_len].unflatten(0, (n, q_len)).transpose(1, 2).contiguous()
                self._groups.append(ContiguousGroup(first, n, q_len, kv_len, q, k, v))
                first += n
                tok += n * q_len
        return self._groups


def build_inputs(case: Case, device, dtype: torch.dtype, *, seed: int = 0) -> CaseInputs:
    """Random inputs for ``case``: unit-variance data, a random permutation of physical blocks
    (or, for the engine's cache layouts, ``params["cache"]``, pages in order in a larger pool, or
    drawn at random from all of it).

    Every sequence's K/V (its new tokens' included, as after ``write_kv``) already sits in the
    cache; no block is shared and none is left zero.
    """
    p = case.params
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hq, hk, d, bs = p["num_q_heads"], p["num_kv_heads"], p["head_size"], p["block_size"]
    seq_lens = case.seq_lens
    query_lens = case.query_lens
    pages_per_seq = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(pages_per_seq)
    max_pages = max(pages_per_seq)

    cache = p.get("cache", "shuffled")
    pool = ENGINE_POOL_FACTOR * num_blocks + 1  # the engine layouts' blocks, block 0 unused
    if cache == "shuffled":
        perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    elif cache == "engine-scattered":  # distinct pages from anywhere in the pool
        perm = (1 + torch.randperm(pool - 1, generator=gen)[:num_blocks]).to(torch.int32)
    else:  # pages in order from block 1, in a pool ENGINE_POOL_FACTOR times the batch's blocks
        perm = torch.arange(1, num_blocks + 1, dtype=torch.int32)
    block_table = torch.zeros(len(seq_lens), max_pages, dtype=torch.int32)
    start = 0
    for s, n in enumerate(pages_per_seq):
        block_table[s, :n] = perm[start:start + n]
        start += n

    def randn(*shape):
        # Generated on the device itself (fast for multi-GB caches), seeded per call.
        g = torch.Generator(device=device).manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    features = dict(causal=True)
    if p.get("sliding_window"):
        features["sliding_window"] = int(p["sliding_window"])
    if p.get("softcap"):
        features["softcap"] = float(p["softcap"])
    if p.get("sinks"):
        features["sinks"] = torch.randn(hq, generator=gen, dtype=torch.float32).to(device)

    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    if cache == "shuffled":
        k_cache, v_cache = randn(num_blocks, bs, hk, d), randn(num_blocks, bs, hk, d)
    elif cache == "engine":
        k_cache, v_cache = randn(2, pool, bs, hk, d).unbind(0)
    else:
        kv = randn(pool, bs, hk, 2 * d)
        k_cache, v_cache = kv[..., :d], kv[..., d:]
    return CaseInputs(
        case=case,
        q=randn(case.num_tokens, hq, d),
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        features=features,
    )


def describe(case: Case) -> dict:
    """Short JSON-ready description used by reports and plots."""
    p = case.params
    out = {k: p[k] for k in ("num_q_heads", "num_kv_heads", "head_size", "block_size")}
    out["segments"] = p["segments"]
    out.update({k: (True if k == "sinks" else v) for k, v in case.features.items()})
    if case.kind == "decode":
        out["batch"], out["context"] = case.num_seqs, case.seq_lens[0]
    elif case.kind == "prefill":
        out["seq_len"] = case.seq_lens[0]
    return out
