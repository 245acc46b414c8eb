"""GPU suite (``pytest -m gpu``): bf16, realistic shapes, every feature, a cache past 2**31.

Skipped without a GPU. Run from a plain checkout with ``PYTHONPATH=. pytest -m gpu``.
"""

import pytest
import torch

from pagedattn import paged_attention, write_kv
from pagedattn.reference import paged_attention_ref, varlen_attention_ref, write_kv_ref
from pagedattn.testing import (
    FEATURES,
    GPU_SHAPES,
    TOLERANCES,
    assert_matches_reference,
    feature_kwargs,
    make_paged_batch,
)

pytestmark = pytest.mark.gpu

LLAMA = dict(num_q_heads=32, num_kv_heads=8, head_size=128, block_size=16)
BF16_TOL = dict(zip(("atol", "rtol"), TOLERANCES[torch.bfloat16]))  # the tolerance table's bf16 row
MIXED = [(1, 1328), (5, 18), (129, 463), (0, 7), (1, 1), (300, 2000), (8, 4096), (1, 32768)]


def compare(batch, kwargs, dtype, plan=None):
    """paged_attention (with ``plan`` if given) into a NaN-poisoned output, against float64."""
    out = torch.full_like(batch.q, float("nan"))
    out, lse = paged_attention(
        *batch.args(), max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
        out=out, return_lse=True, plan=plan, **kwargs,
    )
    assert out.dtype == dtype
    assert_matches_reference(out, lse, *paged_attention_ref(*batch.args(), **kwargs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("feature", FEATURES + ["fp8"])
def test_features_gpu(feature, dtype):
    g = torch.Generator().manual_seed(len(feature))
    cases = MIXED + ([(40, 9)] if "noncausal" in feature else [])
    cache_dtype = torch.float8_e4m3fn if feature == "fp8" else None
    batch = make_paged_batch(cases, dtype=dtype, cache_dtype=cache_dtype, device="cuda", generator=g, **LLAMA)
    if feature == "fp8":
        kwargs = {"k_scale": 0.6, "v_scale": torch.tensor(1.4, device="cuda")}
    else:
        kwargs = feature_kwargs(feature, 32, len(cases), device="cuda", generator=g)
    compare(batch, kwargs, dtype)


@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_size, block_size",
                         [pytest.param(*shape, id=name) for name, shape in GPU_SHAPES.items()])
def test_shapes_gpu(num_q_heads, num_kv_heads, head_size, block_size):
    g = torch.Generator().manual_seed(head_size)
    batch = make_paged_batch(
        [(1, 700), (37, 37), (0, 3), (9, 4000)], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_size=head_size, block_size=block_size, dtype=torch.bfloat16, device="cuda", generator=g,
    )
    compare(batch, {"sliding_window": 333, "softcap": 30.0}, torch.bfloat16)


@pytest.mark.parametrize("path", ["unified", "split_kv", "persistent", "prefill"])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_size, block_size",
                         [pytest.param(*shape, id=name) for name, shape in GPU_SHAPES.items()])
def test_keys_past_one_table_chunk_gpu(num_q_heads, num_kv_heads, head_size, block_size, path):
    # The kernels read a sequence's block ids a chunk at a time (256 ids at 16-token pages) and
    # gather each tile's ids from the chunk; the loop pipeliner issues the gathers of the tiles
    # after a chunk's last one too. Full attention over more keys than one chunk, through each
    # path: at head 256 those gathers once read past the kernel's shared memory (vLLM, Gemma-3).
    from pagedattn import plan_attention

    g = torch.Generator().manual_seed(head_size + block_size)
    cases = [(1, 4064), (1, 4097), (3, 9000), (1, 130), (200, 4300)]
    batch = make_paged_batch(cases, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                             block_size=block_size, dtype=torch.bfloat16, device="cuda", generator=g)
    plan = plan_attention(batch.query_start_loc.cpu(), batch.seq_lens.cpu(), num_q_heads=num_q_heads,
                          num_kv_heads=num_kv_heads, head_size=head_size, device="cuda", path=path,
                          dtype=torch.bfloat16)
    compare(batch, {}, torch.bfloat16, plan=plan)


def test_cache_past_int32_offsets_gpu():
    # [num_blocks, 16, 8, 128] bf16 past 2**31 elements (> 4 GiB); the batch uses the top blocks.
    # The 300-query sequence runs the large-tile prefill kernel, the others the unified kernel.
    num_blocks = 2**31 // (16 * 8 * 128) + 512
    g = torch.Generator().manual_seed(11)
    batch = make_paged_batch(
        [(1, 1500), (64, 2000), (1, 17), (300, 1800)], num_blocks=num_blocks, dtype=torch.bfloat16, device="cuda",
        generator=g, **LLAMA,
    )
    assert batch.k_cache.numel() > 2**31
    compare(batch, {}, torch.bfloat16)


def test_compile_ahead_leaves_a_large_cache_nothing_to_compile_gpu():
    # vLLM's builder warms the kernels up on a small scratch cache (their 32-bit-offset variants)
    # and, where vLLM sized a cache past 2**31 elements, compiles the same launches ahead with
    # LARGE_CACHE=True. The call over such a cache then compiles nothing and matches the reference.
    # (A shape no other GPU test compiles, so the kernels' cache starts without these variants.)
    from triton import knobs

    from pagedattn.ops.common.launching import capturing, compile_ahead

    shape = dict(num_q_heads=6, num_kv_heads=2, head_size=72, block_size=16)
    cases = [(1, 1500), (300, 1800), (1, 17)]
    g = torch.Generator().manual_seed(15)
    small = make_paged_batch(cases, dtype=torch.bfloat16, device="cuda", generator=g, **shape)
    with capturing() as launched:  # the same call as compare()'s below (out= and the LSE select the variant)
        paged_attention(*small.args(), max_query_len=small.max_query_len, max_seq_len=small.max_seq_len,
                        out=torch.empty_like(small.q), return_lse=True)
    assert compile_ahead(launched, LARGE_CACHE=True) >= 1
    num_blocks = 2**31 // (16 * 2 * 72) + 64
    large = make_paged_batch(cases, num_blocks=num_blocks, dtype=torch.bfloat16, device="cuda", generator=g, **shape)
    assert large.k_cache.numel() > 2**31
    compiled = []
    hook = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(getattr(kw.get("fn"), "name", "?"))
    try:
        compare(large, {}, torch.bfloat16)  # the reference is torch code: the hook sees only Triton's compiles
    finally:
        knobs.runtime.jit_post_compile_hook = hook
    assert compiled == []


@pytest.mark.parametrize("window", [1024, None], ids=["window", "full"])
@pytest.mark.parametrize("planned", [False, True], ids=["no-plan", "plan"])
def test_wide_heads_cache_past_int32_offsets_gpu(planned, window):
    # Gemma-3's attention (16 / 8 heads of 256, a 1024-key window) over a cache laid out as vLLM
    # keeps it, K and V interleaved in one [num_blocks, 16, 8, 2 * 256] tensor whose K and V views
    # span past 2**31 elements (vLLM's hybrid cache gives Gemma-3's layers views of that size);
    # the batch uses the top blocks: two 4096-token prompts beside two decodes, with Gemma-3's
    # local (1024-key window) and global (full) attention.
    # New tokens are written with write_kv first, as an engine step does.
    import dataclasses

    from pagedattn import plan_attention

    g = torch.Generator().manual_seed(14)
    shape = dict(num_q_heads=16, num_kv_heads=8, head_size=256, block_size=16)
    cases = [(4096, 4096), (1, 4100), (4096, 4096), (1, 700)]
    num_blocks = 2**31 // (16 * 8 * 512) + 64
    batch = make_paged_batch(cases, num_blocks=num_blocks, dtype=torch.bfloat16, device="cuda", generator=g, **shape)
    kv = torch.empty(num_blocks, 16, 8, 512, dtype=torch.bfloat16, device="cuda")
    k_cache, v_cache = kv[..., :256], kv[..., 256:]
    k_cache.copy_(batch.k_cache)
    v_cache.copy_(batch.v_cache)
    batch = dataclasses.replace(batch, k_cache=k_cache, v_cache=v_cache)
    assert k_cache.stride(0) * (num_blocks - 1) + 1 > 2**31
    # the step's new tokens into their slots (the last query_len positions of each sequence)
    slots = []
    for s, (ql, kvl) in enumerate(cases):
        pos = torch.arange(kvl - ql, kvl)
        slots.append(batch.block_table[s].cpu()[pos // 16].long() * 16 + pos % 16)
    slots = torch.cat(slots).to("cuda")
    key = torch.randn(slots.shape[0], 8, 256, generator=g).to("cuda", torch.bfloat16)
    value = torch.randn(slots.shape[0], 8, 256, generator=g).to("cuda", torch.bfloat16)
    write_kv(key, value, k_cache, v_cache, slots)
    torch.cuda.synchronize()
    plan = None
    if planned:
        plan = plan_attention(batch.query_start_loc.cpu(), batch.seq_lens.cpu(), num_q_heads=16, num_kv_heads=8,
                              head_size=256, device="cuda", sliding_window=window, dtype=torch.bfloat16)
    compare(batch, {"sliding_window": window}, torch.bfloat16, plan=plan)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_write_kv_gpu(cache_dtype):
    g = torch.Generator().manual_seed(12)
    n, h, d, bs, nb = 1000, 8, 128, 16, 200
    key = (torch.randn(n, h, d, generator=g) * 3).to("cuda", torch.bfloat16)
    value = (torch.randn(n, h, d, generator=g) * 3).to("cuda", torch.bfloat16)
    k_cache = torch.randn(nb, bs, h, d, generator=g).to("cuda", cache_dtype)
    v_cache = torch.randn(nb, bs, h, d, generator=g).to("cuda", cache_dtype)
    slots = torch.randperm(nb * bs, generator=g)[:n].to("cuda")
    slots[::7] = -1
    ref_k, ref_v = write_kv_ref(key, value, k_cache, v_cache, slots, k_scale=0.5, v_scale=2.0)
    write_kv(key, value, k_cache, v_cache, slots, k_scale=0.5, v_scale=2.0)
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))


SPEC_DECODE = [(1, 1328), (8, 4096), (3, 18), (0, 7), (1, 1), (2, 32768), (1, 777)]


def split_plan(batch, **kw):
    from pagedattn import plan_attention

    return plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=batch.q.shape[1],
                          num_kv_heads=batch.k_cache.shape[2], head_size=batch.q.shape[2], device="cuda",
                          path="split_kv", **kw)


@pytest.mark.parametrize("num_splits", [None, 13], ids=["auto-splits", "13-splits"])
@pytest.mark.parametrize("feature", FEATURES + ["fp8"])
def test_split_kv_gpu(feature, num_splits):
    g = torch.Generator().manual_seed(len(feature) + 100)
    cases = SPEC_DECODE + ([(40, 9)] if "noncausal" in feature else [])
    cache_dtype = torch.float8_e4m3fn if feature == "fp8" else None
    batch = make_paged_batch(cases, dtype=torch.bfloat16, cache_dtype=cache_dtype, device="cuda", generator=g, **LLAMA)
    if feature == "fp8":
        kwargs = {"k_scale": 0.6, "v_scale": 1.4}
    else:
        kwargs = feature_kwargs(feature, 32, len(cases), device="cuda", generator=g)
    plan = split_plan(batch, num_splits=num_splits)
    plan.partial_out.fill_(float("nan"))
    plan.partial_lse.fill_(float("nan"))
    out = torch.full_like(batch.q, float("nan"))
    out, lse = paged_attention(*batch.args(), out=out, return_lse=True, plan=plan, **kwargs)
    assert out.dtype == torch.bfloat16
    assert_matches_reference(out, lse, *paged_attention_ref(*batch.args(), **kwargs))


def test_batch_invariant_gpu():
    """One sequence alone, in a batch of 7 and in a batch of 100: bitwise identical output."""
    g = torch.Generator().manual_seed(77)
    target = (1, 3000)
    others = [(int(torch.randint(0, 6, (1,), generator=g)), int(torch.randint(10, 6000, (1,), generator=g)))
              for _ in range(99)]
    src = make_paged_batch([target], dtype=torch.bfloat16, device="cuda", generator=torch.Generator().manual_seed(1), **LLAMA)
    n_pages = -(-target[1] // 16)
    results = []
    for cases in ([target], others[:3] + [target] + others[3:6], others[:40] + [target] + others[40:]):
        batch = make_paged_batch(cases, dtype=torch.bfloat16, device="cuda", generator=torch.Generator().manual_seed(2), **LLAMA)
        idx = cases.index(target)
        dst = batch.block_table[idx, :n_pages].long()
        batch.k_cache[dst] = src.k_cache[src.block_table[0, :n_pages].long()]
        batch.v_cache[dst] = src.v_cache[src.block_table[0, :n_pages].long()]
        t0 = int(batch.query_start_loc[idx])
        batch.q[t0:t0 + 1] = src.q
        plan = split_plan(batch, batch_invariant=True)
        out, lse = paged_attention(*batch.args(), return_lse=True, plan=plan, sinks=torch.linspace(-2, 2, 32, device="cuda"))
        results.append((out[t0:t0 + 1].clone(), lse[t0:t0 + 1].clone()))
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    ref_out, _ = paged_attention_ref(*src.args(), sinks=torch.linspace(-2, 2, 32, device="cuda"))
    torch.testing.assert_close(results[0][0].double(), ref_out, **BF16_TOL)


def test_merge_gpu():
    from pagedattn import merge_attention_states

    g = torch.Generator().manual_seed(3)
    out_a, out_b = (torch.randn(500, 32, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    lse_a, lse_b = (torch.randn(500, 32, generator=g).to("cuda") for _ in range(2))
    lse_a[:7] = float("-inf")
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    w = torch.softmax(torch.stack([lse_a, lse_b]).double(), 0)
    ref = w[0, ..., None] * out_a.double() + w[1, ..., None] * out_b.double()
    torch.testing.assert_close(out.double(), ref, **BF16_TOL)
    torch.testing.assert_close(lse.double(), torch.logaddexp(lse_a.double(), lse_b.double()))


@pytest.mark.parametrize("schedule", ["static", "atomic"])
@pytest.mark.parametrize("feature", ["causal", "sinks", "softcap", "alibi", "prefix", "fp8"])
def test_persistent_gpu(feature, schedule):
    from pagedattn import plan_attention

    g = torch.Generator().manual_seed(len(feature) + 7)
    cases = SPEC_DECODE + [(129, 463), (1, 9000)]
    cache_dtype = torch.float8_e4m3fn if feature == "fp8" else None
    batch = make_paged_batch(cases, dtype=torch.bfloat16, cache_dtype=cache_dtype, device="cuda", generator=g, **LLAMA)
    kwargs = {"k_scale": 0.6, "v_scale": 1.4} if feature == "fp8" else feature_kwargs(feature, 32, len(cases), device="cuda", generator=g)
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=32, num_kv_heads=8, head_size=128,
                          device="cuda", path="persistent", schedule=schedule)
    out = torch.full_like(batch.q, float("nan"))
    out, lse = paged_attention(*batch.args(), out=out, return_lse=True, plan=plan, **kwargs)
    assert_matches_reference(out, lse, *paged_attention_ref(*batch.args(), **kwargs))


def test_graph_capture_once_replay_many_gpu():
    """Capture at the maximum shape once; replay for changing batches via plan.update."""
    from pagedattn import plan_attention

    max_seqs, max_ctx = 32, 4096
    big = make_paged_batch([(1, max_ctx)] * max_seqs, dtype=torch.bfloat16, device="cuda",
                           generator=torch.Generator().manual_seed(0), **LLAMA)
    q, kc, vc, bt = big.q, big.k_cache, big.v_cache, big.block_table
    sl, qsl = big.seq_lens.clone(), big.query_start_loc.clone()
    out = torch.empty_like(q)
    plan = plan_attention(qsl.cpu(), sl.cpu(), num_q_heads=32, num_kv_heads=8, head_size=128, device="cuda",
                          path="persistent", max_num_seqs=max_seqs, max_num_tokens=max_seqs, max_context_len=max_ctx)

    def step():
        paged_attention(q, kc, vc, bt, sl, qsl, plan=plan, out=out, max_query_len=1, max_seq_len=max_ctx)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    g = torch.Generator().manual_seed(1)
    for b in (1, 5, 32, 17):
        lens = torch.randint(1, max_ctx + 1, (b,), generator=g, dtype=torch.int32)
        starts = torch.arange(b + 1, dtype=torch.int32)
        sl[:b].copy_(lens)
        sl[b:].zero_()
        qsl.copy_(torch.arange(max_seqs + 1, dtype=torch.int32).clamp(max=b))
        q[:b].copy_(torch.randn(b, 32, 128, generator=g).to("cuda", torch.bfloat16))
        plan.update(starts, lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = paged_attention_ref(q[:b], kc, vc, bt[:b], sl[:b], qsl[: b + 1])
        torch.testing.assert_close(out[:b].double(), ref, **BF16_TOL)


def _check_varlen(cases, num_q_heads, num_kv_heads, head_size, head_size_v, feature, seed):
    """varlen_attention in bf16 on random contiguous K/V against the float64 reference."""
    from pagedattn import varlen_attention
    from pagedattn.reference import varlen_attention_ref

    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0] + [q for q, _ in cases]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [k for _, k in cases]).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), num_q_heads, head_size, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(int(cu_k[-1]), num_kv_heads, head_size, generator=g).to("cuda", torch.bfloat16)
    v = torch.randn(int(cu_k[-1]), num_kv_heads, head_size_v, generator=g).to("cuda", torch.bfloat16)
    kwargs = feature_kwargs(feature, num_q_heads, len(cases), device="cuda", generator=g)
    out = torch.full((q.shape[0], num_q_heads, head_size_v), float("nan"), dtype=torch.bfloat16, device="cuda")
    out, lse = varlen_attention(q, k, v, cu_q.cuda(), cu_k.cuda(), out=out, return_lse=True, **kwargs)
    assert_matches_reference(out, lse, *varlen_attention_ref(q, k, v, cu_q, cu_k, **kwargs))


@pytest.mark.parametrize("loads", ["pointer", "tma"])
@pytest.mark.parametrize("feature", FEATURES)
def test_varlen_gpu(feature, loads, monkeypatch):
    """Both K/V load paths: tensor descriptors (the default on sm90+) and pointer loads (other GPUs,
    head sizes that are not powers of 2, PAGEDATTN_TMA=0)."""
    monkeypatch.setenv("PAGEDATTN_TMA", "1" if loads == "tma" else "0")
    cases = [(1500, 1500), (300, 2100), (1, 999), (129, 129)] + ([(40, 9)] if "noncausal" in feature else [])
    _check_varlen(cases, 32, 8, 128, 128, feature, seed=len(feature) + 50)


@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("feature", ["causal", "noncausal", "window", "prefix", "sinks"])
def test_varlen_tma_gpu(feature, head_size, monkeypatch):
    """The tensor-descriptor K/V loads (sm90+) at heads 64, 128 and 256."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need sm90+")
    monkeypatch.setenv("PAGEDATTN_TMA", "1")
    cases = [(1500, 1500), (300, 2100), (1, 999), (129, 129)] + ([(40, 9)] if "noncausal" in feature else [])
    _check_varlen(cases, 32, 8, head_size, head_size, feature, seed=len(feature) + head_size)


@pytest.mark.parametrize("feature", ["causal", "window"])
def test_varlen_value_head_size_differs_gpu(feature):
    """MLA prefill after decompression: q/k heads of 192, v heads of 128."""
    _check_varlen([(1200, 1200), (300, 900), (1, 77)], 16, 16, 192, 128, feature, seed=len(feature) + 70)


def test_paged_prefill_block_id_outside_cache_gpu():
    """A block id outside the cache in the mask-free middle of a long prefill: that chunk runs
    the checked tile loop and drops the page's keys; the clean chunk after it and the other
    sequence are exact, and nothing reads NaN from the poisoned blocks around the cache."""
    from pagedattn import plan_attention

    g = torch.Generator().manual_seed(11)
    cases = [(600, 9000), (512, 600)]
    batch = make_paged_batch(cases, dtype=torch.bfloat16, device="cuda", generator=g, **LLAMA)
    ref_out, _ = paged_attention_ref(*batch.args())
    pages0 = batch.block_table[0, :-(-9000 // 16)].long()
    seq0_kv = [c[pages0].reshape(-1, 8, 128)[:9000] for c in (batch.k_cache, batch.v_cache)]
    cache_blocks = batch.k_cache.shape[0]
    for name in ("k_cache", "v_cache"):  # the cache as the middle of a buffer with NaN blocks around it
        c = getattr(batch, name)
        buf = torch.full((cache_blocks + 4, *c.shape[1:]), float("nan"), dtype=c.dtype, device="cuda")
        buf[2:-2] = c
        setattr(batch, name, buf[2:-2])
    batch.block_table[0, 3] = cache_blocks + 1  # keys 48..63 of sequence 0: a NaN block if read
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=32, num_kv_heads=8, head_size=128,
                          device="cuda")
    assert plan.path == "prefill"
    out = torch.full_like(batch.q, float("nan"))
    out = paged_attention(*batch.args(), out=out, plan=plan)
    assert_matches_reference(out[600:], None, ref_out[600:], None)
    # sequence 0 against its keys without 48..63: every query (positions 8400..8999) sees all
    # earlier keys, so dropping the page shifts no visibility
    keep = torch.cat([torch.arange(48), torch.arange(64, 9000)]).to("cuda")
    k0, v0 = (kv[keep] for kv in seq0_kv)
    cu_q = torch.tensor([0, 600], dtype=torch.int32)
    cu_k = torch.tensor([0, keep.numel()], dtype=torch.int32)
    ref0, _ = varlen_attention_ref(batch.q[:600], k0, v0, cu_q, cu_k)
    assert_matches_reference(out[:600], None, ref0, None)


@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("feature", ["causal", "fp8", "softcap", "sinks"])
def test_paged_prefill_gpu(feature, head_size):
    from pagedattn import plan_attention

    g = torch.Generator().manual_seed(head_size + len(feature))
    # (300, 9000): five block-table chunks (1920 keys each at 16-token pages and 128-key tiles)
    cases = [(2048, 2048), (1, 2049), (512, 4608), (3, 70), (129, 129), (300, 9000)]
    cache_dtype = torch.float8_e4m3fn if feature == "fp8" else None
    shape = dict(LLAMA, head_size=head_size)
    batch = make_paged_batch(cases, dtype=torch.bfloat16, cache_dtype=cache_dtype, device="cuda", generator=g, **shape)
    kwargs = {"k_scale": 0.6, "v_scale": 1.4} if feature == "fp8" else feature_kwargs(feature, 32, len(cases), device="cuda", generator=g)
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=32, num_kv_heads=8,
                          head_size=head_size, device="cuda")
    assert plan.path == "prefill"
    out = torch.full_like(batch.q, float("nan"))
    out, lse = paged_attention(*batch.args(), out=out, return_lse=True, plan=plan, **kwargs)
    assert_matches_reference(out, lse, *paged_attention_ref(*batch.args(), **kwargs))


SHORT = [(768, 768), (300, 300), (129, 129), (1, 50)]  # a causal prefill of a few waves: 64-row tiles


@pytest.mark.parametrize("head_size", [96, 128])
@pytest.mark.parametrize("feature", FEATURES + ["fp8"])
def test_short_prefill_gpu(feature, head_size):
    """The short-prefill tiles (64 x 64) on every feature, paged (eager, and a plan) and varlen."""
    from pagedattn import plan_attention
    from pagedattn.plan import num_sms, short_prefill

    g = torch.Generator().manual_seed(head_size + len(feature))
    cases = SHORT + ([(40, 9)] if "noncausal" in feature else [])
    assert short_prefill(768, len(cases), 32, num_sms("cuda"), diagonal=True)  # the eager call's test
    cache_dtype = torch.float8_e4m3fn if feature == "fp8" else None
    batch = make_paged_batch(cases, dtype=torch.bfloat16, cache_dtype=cache_dtype, device="cuda", generator=g,
                             **dict(LLAMA, head_size=head_size))
    kwargs = {"k_scale": 0.6, "v_scale": 1.4} if feature == "fp8" else feature_kwargs(feature, 32, len(cases), device="cuda", generator=g)
    ref = paged_attention_ref(*batch.args(), **kwargs)
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=32, num_kv_heads=8,
                          head_size=head_size, device="cuda")
    assert plan.prefill_tiles.block_m == 64
    for p in (None, plan):
        out = torch.full_like(batch.q, float("nan"))
        out, lse = paged_attention(*batch.args(), out=out, return_lse=True, plan=p, max_query_len=768,
                                   max_seq_len=768, **kwargs)
        assert_matches_reference(out, lse, *ref)
    if feature != "fp8":
        _check_varlen(cases, 32, 8, head_size, head_size, feature, seed=head_size)


@pytest.mark.parametrize("planned", [True, False], ids=["plan", "eager"])
@pytest.mark.parametrize("overlap", ["1", "0"])
def test_prefill_and_rest_streams_gpu(overlap, planned, monkeypatch):
    """Prefills among decodes (the unified launch on a second stream unless PAGEDATTN_OVERLAP=0),
    through a plan and eagerly: right when called on a caller's own stream with both streams
    delayed (a missing fork or join leaves NaN rows), and captured in a CUDA graph and replayed
    after new inputs are copied in."""
    import pagedattn.api as api
    from pagedattn import plan_attention

    monkeypatch.setenv("PAGEDATTN_OVERLAP", overlap)
    g = torch.Generator().manual_seed(7)
    cases = [(1, 700), (1500, 1500), (1, 2000), (3, 90), (600, 600)] + [(1, 1501)] * 20
    batch = make_paged_batch(cases, dtype=torch.bfloat16, device="cuda", generator=g, **LLAMA)
    plan = None
    if planned:
        plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=32, num_kv_heads=8, head_size=128,
                              device="cuda")
        assert plan.path == "prefill" and plan.rest_max_query_len == 3
    out = torch.full_like(batch.q, float("nan"))
    lse = torch.full((batch.q.shape[0], 32), float("nan"), device="cuda")

    def call():  # host maxima given: no sync, so the eager call can be captured too
        paged_attention(*batch.args(), out=out, lse_out=lse, return_lse=True, plan=plan,
                        max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len)

    real_unified = api.launch_unified

    def slow_unified(*args, **kwargs):  # ~25 ms of spinning on the stream the decodes launch on
        torch.cuda._sleep(50_000_000)
        real_unified(*args, **kwargs)
    monkeypatch.setattr(api, "launch_unified", slow_unified)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # the poison lands ~50 ms in: a side stream that did not wait for the caller would write
        # its rows before it; a caller that did not wait for the side stream would copy NaN rows
        torch.cuda._sleep(100_000_000)
        out.fill_(float("nan"))
        call()
        result = out.clone()  # ordered after the call on the caller's stream
    torch.cuda.current_stream().wait_stream(stream)
    assert_matches_reference(result, None, paged_attention_ref(*batch.args())[0], None)
    monkeypatch.setattr(api, "launch_unified", real_unified)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    batch.q.copy_(torch.randn(batch.q.shape, generator=g).to("cuda", torch.bfloat16))
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(out, lse, *paged_attention_ref(*batch.args()))


@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_prefill_autotune_gpu(head_size, monkeypatch):
    """PAGEDATTN_AUTOTUNE=1: the first call times the candidates (those that do not fit are
    skipped) and is right; a call captured in a CUDA graph for a new key does not tune, and its
    replay is right."""
    from pagedattn import plan_attention, varlen_attention
    from pagedattn.ops.prefill import tuning

    monkeypatch.setenv("PAGEDATTN_AUTOTUNE", "1")
    tuning.forget_choices()
    try:
        g = torch.Generator().manual_seed(head_size)
        cases = [(1500, 1500), (300, 2100), (129, 129)]
        cu_q = torch.tensor([0] + [q for q, _ in cases]).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + [k for _, k in cases]).cumsum(0).to(torch.int32)
        q = torch.randn(int(cu_q[-1]), 32, head_size, generator=g).to("cuda", torch.bfloat16)
        k = torch.randn(int(cu_k[-1]), 8, head_size, generator=g).to("cuda", torch.bfloat16)
        v = torch.randn(int(cu_k[-1]), 8, head_size, generator=g).to("cuda", torch.bfloat16)
        out = torch.full_like(q, float("nan"))
        out, lse = varlen_attention(q, k, v, cu_q.cuda(), cu_k.cuda(), out=out, return_lse=True)
        assert_matches_reference(out, lse, *varlen_attention_ref(q, k, v, cu_q, cu_k))
        assert len(tuning.chosen_tiles()) == 1

        batch = make_paged_batch([(600, 900), (1, 300)], dtype=torch.bfloat16, device="cuda", generator=g,
                                 **dict(LLAMA, head_size=head_size))
        plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=32, num_kv_heads=8,
                              head_size=head_size, device="cuda")
        out = torch.full_like(batch.q, float("nan"))
        monkeypatch.setenv("PAGEDATTN_AUTOTUNE", "0")
        paged_attention(*batch.args(), out=out, plan=plan)  # compiles the fallback tiles outside the capture
        torch.cuda.synchronize()
        monkeypatch.setenv("PAGEDATTN_AUTOTUNE", "1")
        out.fill_(float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            paged_attention(*batch.args(), out=out, plan=plan)
        assert len(tuning.chosen_tiles()) == 1  # nothing tuned inside the capture
        graph.replay()
        torch.cuda.synchronize()
        ref_out, _ = paged_attention_ref(*batch.args())
        assert_matches_reference(out, None, ref_out, None)
    finally:
        tuning.forget_choices()


@pytest.fixture
def replays(monkeypatch):
    """The results of every tape replay during the test (True: the recorded launches ran)."""
    from pagedattn.ops.common import launching

    results = []
    real = launching.Tapes.replay
    monkeypatch.setattr(launching.Tapes, "replay",
                        lambda self, key, b: results.append(real(self, key, b)) or results[-1])
    return results


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_write_kv_replays_with_new_tensors_gpu(cache_dtype, replays):
    """write_kv's thin path: new tokens, caches and scales of a seen layout are written exactly."""
    for seed in range(3):
        g = torch.Generator().manual_seed(400 + seed)
        key = torch.randn(37, 8, 128, generator=g).to("cuda", torch.bfloat16)
        value = torch.randn(37, 8, 128, generator=g).to("cuda", torch.bfloat16)
        k_cache = torch.randn(20, 16, 8, 128, generator=g).to("cuda", cache_dtype or torch.bfloat16)
        v_cache = torch.randn(20, 16, 8, 128, generator=g).to("cuda", cache_dtype or torch.bfloat16)
        slots = torch.randperm(320, generator=g)[:37].to("cuda")
        scales = {}
        if cache_dtype is not None:  # a tensor scale (bound per call) and a float one (in the key)
            scales = dict(k_scale=torch.tensor([0.5 + seed], device="cuda"), v_scale=2.0)
        ref_k, ref_v = write_kv_ref(key, value, k_cache, v_cache, slots, **scales)
        write_kv(key, value, k_cache, v_cache, slots, **scales)
        assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
        assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))
    assert replays.count(True) >= 2


@pytest.mark.parametrize("how", ["plan", "no-plan", "varlen"])
def test_thin_path_replays_with_new_tensors_gpu(how, replays):
    """A call whose layout was seen replays the recorded launches with the new call's tensors
    (the varlen tape rebuilds its K/V tensor descriptors): right answers for new data in new
    buffers, and for a view whose address breaks the 16-byte alignment it was compiled for."""
    from pagedattn import plan_attention, varlen_attention

    cases = [(1, 1328), (5, 18), (129, 463), (1, 4099)]
    plan = None
    for seed in range(3):
        g = torch.Generator().manual_seed(200 + seed)
        if how == "varlen":
            lens = [(300, 300), (17, 900), (1, 77)]
            cu_q = torch.tensor([0] + [q for q, _ in lens]).cumsum(0).to(torch.int32)
            cu_k = torch.tensor([0] + [k for _, k in lens]).cumsum(0).to(torch.int32)
            q = torch.randn(int(cu_q[-1]), 32, 128, generator=g).to("cuda", torch.bfloat16)
            k = torch.randn(int(cu_k[-1]), 8, 128, generator=g).to("cuda", torch.bfloat16)
            v = torch.randn(int(cu_k[-1]), 8, 128, generator=g).to("cuda", torch.bfloat16)
            out = torch.full_like(q, float("nan"))
            out, lse = varlen_attention(q, k, v, cu_q.cuda(), cu_k.cuda(), max_query_len=300, out=out,
                                        return_lse=True)
            assert_matches_reference(out, lse, *varlen_attention_ref(q, k, v, cu_q, cu_k))
            continue
        batch = make_paged_batch(cases, **LLAMA, dtype=torch.bfloat16, device="cuda", generator=g)
        out = torch.full_like(batch.q, float("nan"))
        if how == "plan":
            plan = plan or plan_attention(batch.query_start_loc.tolist(), batch.seq_lens.tolist(),
                                          num_q_heads=32, num_kv_heads=8, head_size=128, device="cuda")
            out, lse = paged_attention(*batch.args(), plan=plan, out=out, return_lse=True)
        else:
            out, lse = paged_attention(*batch.args(), max_query_len=batch.max_query_len,
                                       max_seq_len=batch.max_seq_len, out=out, return_lse=True)
        assert_matches_reference(out, lse, *paged_attention_ref(*batch.args()))
    assert replays.count(True) >= 2  # recorded on the first call (or earlier), replayed on the next two
    if how == "plan":
        assert plan._tapes
    if how == "varlen":  # an unaligned view of q: not the compiled alignment, so a new recording
        g = torch.Generator().manual_seed(300)
        buf = torch.randn(300 * 32 * 128 + 8, generator=g).to("cuda", torch.bfloat16)
        q = buf[8:].view(300, 32, 128)  # 16 bytes past the start: aligned; shift by one element below
        q1 = buf[1:1 + 300 * 32 * 128].view(300, 32, 128)
        k = torch.randn(300, 8, 128, generator=g).to("cuda", torch.bfloat16)
        v = torch.randn(300, 8, 128, generator=g).to("cuda", torch.bfloat16)
        cu = torch.tensor([0, 300], dtype=torch.int32)
        cu_dev = cu.cuda()  # one tensor as both cu_seqlens (a self-attention prefill), then two
        for qq, cu_k in ((q, cu_dev), (q1, cu_dev), (q, cu_dev), (q, cu.cuda())):
            out = torch.full_like(qq, float("nan"))
            out = varlen_attention(qq, k, v, cu_dev, cu_k, max_query_len=300, out=out)
            ref, _ = varlen_attention_ref(qq, k, v, cu, cu)
            torch.testing.assert_close(out.double(), ref.to(out.device), **BF16_TOL)
