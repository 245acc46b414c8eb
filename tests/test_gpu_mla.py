"""MLA GPU suite (``pytest -m gpu``): bf16, 128 heads, 512 latent + 64 rope, long contexts, fp8.

Skipped without a GPU. Run from a plain checkout with ``PYTHONPATH=. pytest -m gpu tests/test_gpu_mla.py``.
"""

import pytest
import torch

from pagedattn import mla_decode, write_mla_kv
from pagedattn.bench.mla import sweep_configs
from pagedattn.mla import _mla_decode
from pagedattn.ops.mla.launch import MLAConfig
from pagedattn.reference import mla_decode_ref, write_mla_kv_ref
from pagedattn.testing import TOLERANCES, captured, make_mla_batch

pytestmark = pytest.mark.gpu

NUM_HEADS, LATENT, ROPE = 128, 512, 64
SCALE = 192 ** -0.5  # DeepSeek-V3: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)


def make_batch(cases, *, num_heads=NUM_HEADS, **kwargs):
    return make_mla_batch(cases, num_heads=num_heads, latent=LATENT, rope=ROPE, **kwargs)


def compare(batch, max_query_len, max_seq_len, *, kv_scale=None, num_splits=None, config=None):
    out = torch.full_like(batch["q_nope"], float("nan"))
    out, lse = _mla_decode(**batch, scale=SCALE, max_query_len=max_query_len, max_seq_len=max_seq_len,
                           kv_scale=kv_scale, num_splits=num_splits, out=out, return_lse=True, config=config)
    ref_out, ref_lse = mla_decode_ref(**batch, scale=SCALE, kv_scale=kv_scale)
    atol, rtol = TOLERANCES[batch["q_nope"].dtype]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=atol, rtol=rtol)


def batch_cases(num_seqs, max_len, spec, seed):
    g = torch.Generator().manual_seed(seed)
    cases = []
    for s in range(num_seqs):
        kv = max_len if s == 0 else int(torch.randint(1, max_len + 1, (1,), generator=g))
        q = int(torch.randint(0, 9, (1,), generator=g)) if spec else 1
        cases.append((min(q, kv), kv))
    return cases


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize(
    "num_seqs, max_len, spec, block_size",
    [
        pytest.param(1, 4096, False, 16, id="B1-L4096"),
        pytest.param(1, 32768, False, 16, id="B1-L32768"),
        pytest.param(1, 32768, True, 64, id="B1-L32768-spec-page64"),
        pytest.param(32, 4096, False, 32, id="B32-L4096-page32"),
        pytest.param(32, 32768, False, 16, id="B32-L32768"),
        pytest.param(32, 32768, True, 16, id="B32-L32768-spec"),
    ],
)
def test_mla_decode_gpu(num_seqs, max_len, spec, block_size, fp8):
    cases = batch_cases(num_seqs, max_len, spec, seed=num_seqs + max_len)
    if spec:
        cases[0] = (8, max_len)
    batch, mql, msl = make_batch(cases, block_size=block_size,
                                 cache_dtype=torch.float8_e4m3fn if fp8 else None, seed=num_seqs)
    compare(batch, mql, msl, kv_scale=0.8 if fp8 else None)


@pytest.mark.parametrize("num_splits", [1, 7, 200], ids=lambda n: f"splits{n}")
def test_mla_splits_gpu(num_splits):
    cases = [(1, 5000), (3, 17), (0, 9), (8, 1000), (1, 1), (2, 130)]
    batch, mql, msl = make_batch(cases, seed=num_splits)
    compare(batch, mql, msl, num_splits=num_splits)


@pytest.mark.parametrize("config", sweep_configs(), ids=lambda c: c.label)
def test_mla_sweep_configs_gpu(config):
    """Every config of the benchmark sweep, unsplit (bf16 out) and split (fp32 partials + merge)."""
    cases = [(1, 5000), (1, 17), (0, 9), (1, 1000), (1, 1), (1, 130), (1, 64)]
    batch, mql, msl = make_batch(cases, seed=config.block_h + config.value_split)
    compare(batch, mql, msl, num_splits=1, config=config)
    compare(batch, mql, msl, num_splits=5, config=config)


@pytest.mark.parametrize(
    "config, num_heads, block_size, fp8",
    [
        pytest.param(MLAConfig(64, 1, 32, 2, 4, 4), 128, 64, True, id="fp8-default-page64"),
        pytest.param(MLAConfig(64, 1, 64, 1, 8, 2), 128, 16, True, id="bf16-default-with-fp8"),
        pytest.param(MLAConfig(16, 4, 32, 2, 4, 4), 16, 16, False, id="h16q4-spec-wgmma"),
        pytest.param(MLAConfig(32, 2, 32, 2, 4, 4), 32, 32, False, id="h32q2-spec"),
        pytest.param(MLAConfig(64, 1, 32, 4, 4, 3), 96, 16, False, id="value4-masked-heads"),
    ],
)
def test_mla_configs_spec_gpu(config, num_heads, block_size, fp8):
    """Speculative rows (up to 8 tokens), pages 16-64, fp8 with a scale, heads not a multiple of the group."""
    cases = [(8, 3000), (4, 70), (1, 1), (3, 900), (0, 5), (2, 2)]
    batch, mql, msl = make_batch(cases, num_heads=num_heads, block_size=block_size,
                                 cache_dtype=torch.float8_e4m3fn if fp8 else None, seed=num_heads + block_size)
    for splits in (None, 3):
        compare(batch, mql, msl, kv_scale=0.8 if fp8 else None, num_splits=splits, config=config)


def test_mla_few_heads_gpu():
    # 16 heads: the 64-row block packs 4 query tokens of a sequence
    batch, mql, msl = make_batch([(8, 3000), (4, 70), (1, 1)], num_heads=16, seed=5)
    compare(batch, mql, msl)


def test_mla_cache_past_int32_offsets_gpu():
    # [num_blocks, 16, 576] bf16 past 2**31 elements (> 4 GiB); the batch uses the top blocks.
    num_blocks = 2**31 // (16 * (LATENT + ROPE)) + 64
    batch, mql, msl = make_batch([(1, 700), (4, 300), (1, 17)], num_blocks=num_blocks, seed=9)
    assert batch["kv_cache"].numel() > 2**31
    compare(batch, mql, msl)
    compare(batch, mql, msl, num_splits=5)


def test_mla_cuda_graph_gpu():
    """With max_query_len / max_seq_len given the call never syncs, so it can be captured and replayed."""
    batch, mql, msl = make_batch([(1, 4000), (1, 300)], seed=13)
    out = torch.empty_like(batch["q_nope"])
    lse = torch.empty(out.shape[:2], device="cuda")

    def step():
        o, l = mla_decode(**batch, scale=SCALE, max_query_len=mql, max_seq_len=msl, out=out, return_lse=True)
        lse.copy_(l)

    graph = captured(step)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse = mla_decode_ref(**batch, scale=SCALE)
    torch.testing.assert_close(out.double(), ref_out, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_write_mla_kv_gpu(cache_dtype):
    g = torch.Generator().manual_seed(12)
    n, bs, nb = 1000, 16, 100
    c_kv = (torch.randn(n, LATENT, generator=g) * 3).to("cuda", torch.bfloat16)
    k_pe = (torch.randn(n, ROPE, generator=g) * 3).to("cuda", torch.bfloat16)
    kv_cache = torch.randn(nb, bs, LATENT + ROPE, generator=g).to("cuda", cache_dtype)
    slots = torch.randperm(nb * bs, generator=g)[:n].to("cuda")
    slots[::7] = -1
    slots[5] = nb * bs + 3  # outside the cache: skipped
    ref = write_mla_kv_ref(c_kv, k_pe, kv_cache, slots, kv_scale=0.5)
    write_mla_kv(c_kv, k_pe, kv_cache, slots, kv_scale=0.5)
    assert torch.equal(kv_cache.view(torch.uint8), ref.view(torch.uint8))
