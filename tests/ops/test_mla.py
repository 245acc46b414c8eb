"""MLA decode and the latent-cache write against the float64 reference, on the interpreter."""

import math
from dataclasses import dataclass

import pytest
import torch

import pagedattn.mla as mla
import pagedattn.ops.common.offsets as offsets
from pagedattn import mla_decode, write_mla_kv
from pagedattn.ops.mla.config import MLAConfig
from pagedattn.plan import choose_mla_splits, pick_mla_config
from pagedattn.reference import mla_decode_ref, write_mla_kv_ref
from pagedattn.testing import TOLERANCES, make_paged_batch
from tests.conftest import DEVICE
from tests.test_safety import CORRUPTIONS, GUARD

# (query_len, seq_len) per sequence
DECODE = [(1, 17), (1, 129), (1, 1), (1, 300)]
SPEC = [(8, 129), (3, 5), (1, 17), (0, 4), (2, 2), (5, 40), (1, 1), (7, 7)]  # speculative: up to 8 tokens
SPEC_SHORT = [(8, 70), (3, 5), (0, 4), (5, 40), (7, 7)]


@dataclass
class MLABatch:
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float

    def args(self):
        return (self.q_nope, self.q_pe, self.kv_cache, self.block_table, self.seq_lens, self.query_start_loc)


def make_mla_batch(cases, *, num_heads=8, latent_dim=32, rope_dim=16, block_size=16, dtype=torch.float16,
                   cache_dtype=None, seed=0):
    """Random latents in a shuffled paged cache; q_nope / q_pe are views of one [.., 576] query."""
    batch = make_paged_batch(
        cases, num_q_heads=num_heads, num_kv_heads=1, head_size=latent_dim + rope_dim, block_size=block_size,
        dtype=dtype, cache_dtype=cache_dtype, device=DEVICE, generator=torch.Generator().manual_seed(seed),
    )
    return MLABatch(
        q_nope=batch.q[..., :latent_dim], q_pe=batch.q[..., latent_dim:],
        kv_cache=batch.k_cache[:, :, 0].contiguous(), block_table=batch.block_table, seq_lens=batch.seq_lens,
        query_start_loc=batch.query_start_loc, scale=1.0 / math.sqrt(latent_dim + rope_dim),
    )


@pytest.fixture
def poisoned_workspace(monkeypatch):
    """Split-KV partials start as NaN, so an unwritten partial that is read fails; records the split counts."""
    calls = []
    split_partials = mla.split_partials

    def workspace(num_tokens, num_heads, num_splits, latent_dim, device):
        calls.append(num_splits)
        partials = split_partials(num_tokens, num_heads, num_splits, latent_dim, device)
        return tuple(t.fill_(float("nan")) for t in partials)

    monkeypatch.setattr(mla, "split_partials", workspace)
    return calls


def run_mla(b, *, kv_scale=None, num_splits=None, config=None, **kwargs):
    out = torch.full(b.q_nope.shape, float("nan"), dtype=b.q_nope.dtype, device=DEVICE)
    res = mla._mla_decode(*b.args(), scale=b.scale, kv_scale=kv_scale, num_splits=num_splits, out=out,
                          return_lse=True, config=config, **kwargs)
    assert res[0] is out
    return res


def assert_matches_reference(b, out, lse, kv_scale=None):
    ref_out, ref_lse = mla_decode_ref(*b.args(), scale=b.scale, kv_scale=kv_scale)
    atol, rtol = TOLERANCES[b.q_nope.dtype]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "cases, dtype, num_heads, block_size",
    [
        pytest.param(DECODE, torch.float16, 16, 16, id="decode-fp16-h16-page16"),
        pytest.param(DECODE, torch.float32, 4, 32, id="decode-fp32-h4-page32"),
        pytest.param(SPEC, torch.float16, 4, 16, id="spec-fp16-h4-page16"),
        pytest.param(SPEC, torch.float32, 12, 64, id="spec-fp32-h12-page64"),
        pytest.param(SPEC, torch.float16, 8, 32, id="spec-fp16-h8-page32"),
    ],
)
def test_mla_decode(poisoned_workspace, cases, dtype, num_heads, block_size):
    b = make_mla_batch(cases, num_heads=num_heads, block_size=block_size, dtype=dtype, seed=num_heads + block_size)
    out, lse = run_mla(b)
    assert_matches_reference(b, out, lse)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 12], ids=lambda n: f"splits{n}")
def test_mla_split_counts(poisoned_workspace, num_splits):
    # 12 splits over at most 129 keys in 32-key tiles: most segments are empty.
    b = make_mla_batch(SPEC, num_heads=8, dtype=torch.float32, seed=num_splits)
    out, lse = run_mla(b, num_splits=num_splits)
    assert_matches_reference(b, out, lse)
    assert poisoned_workspace == ([] if num_splits == 1 else [num_splits])


def test_mla_auto_splits(poisoned_workspace):
    # one sequence, one head group: the interpreter's 4 "SMs" hold 4 programs of the small
    # interpreter config each (16 by fill); 700 keys allow 6 segments of >= 128 keys
    b = make_mla_batch([(1, 700)], num_heads=16, dtype=torch.float16, seed=3)
    out, lse = run_mla(b)
    assert poisoned_workspace == [6]
    assert_matches_reference(b, out, lse)


# One case per config family: head groups (BLOCK_H), query tokens per block (BLOCK_Q), value
# parts (VALUE_SPLIT), tile widths below / across pages (TILE_N), split-KV, stages, warps.
CONFIGS = [
    pytest.param(MLAConfig(8, 2, 16, 1, 1, 1), 16, 3, torch.float32, id="h8q2-2-head-groups-tile16-3splits"),
    pytest.param(MLAConfig(4, 4, 64, 1, 1, 1), 4, 1, torch.float16, id="h4q4-tile64-across-pages"),
    pytest.param(MLAConfig(16, 1, 32, 2, 1, 1), 12, 2, torch.float32, id="h16-masked-heads-value2"),
    pytest.param(MLAConfig(2, 8, 16, 4, 1, 1), 6, 2, torch.float16, id="h2q8-3-head-groups-value4"),
    pytest.param(MLAConfig(8, 2, 16, 4, 2, 2), 12, 1, torch.float16, id="h8q2-masked-head-group-value4-tile16"),
    pytest.param(MLAConfig(4, 4, 32, 2, 1, 1, num_splits=4), 8, None, torch.float32, id="h4q4-value2-config-splits"),
]


@pytest.mark.parametrize("config, num_heads, num_splits, dtype", CONFIGS)
def test_mla_configs(poisoned_workspace, config, num_heads, num_splits, dtype):
    b = make_mla_batch(SPEC_SHORT, num_heads=num_heads, latent_dim=64, dtype=dtype, seed=config.block_h)
    out, lse = run_mla(b, config=config, num_splits=num_splits)
    assert_matches_reference(b, out, lse)
    expected = num_splits or config.num_splits
    assert poisoned_workspace == ([] if expected == 1 else [expected])


def test_mla_odd_dims():
    b = make_mla_batch([(2, 33), (1, 9)], num_heads=4, latent_dim=48, rope_dim=32, dtype=torch.float16, seed=5)
    out, lse = run_mla(b, num_splits=2)
    assert_matches_reference(b, out, lse)


@pytest.mark.parametrize(
    "dtype, cache_dtype, num_splits, config",
    [
        pytest.param(torch.float16, None, 1, None, id="fp16"),
        pytest.param(torch.float32, torch.float8_e4m3fn, 3, None, id="fp32-fp8cache-3splits"),
        pytest.param(torch.float16, None, 2, MLAConfig(16, 1, 16, 2, 1, 1), id="fp16-value2-2splits"),
        pytest.param(torch.float32, None, 1, MLAConfig(4, 4, 16, 4, 1, 1), id="fp32-value4-4tokens"),
    ],
)
def test_mla_real_widths(poisoned_workspace, dtype, cache_dtype, num_splits, config):
    """DeepSeek's 512 latent + 64 rope, few heads and short sequences."""
    b = make_mla_batch([(1, 17), (2, 40), (0, 3), (1, 1)], num_heads=4, latent_dim=512, rope_dim=64,
                       dtype=dtype, cache_dtype=cache_dtype, seed=7)
    b.scale = 1.0 / math.sqrt(192)
    kv_scale = 0.5 if cache_dtype is not None else None
    out, lse = run_mla(b, kv_scale=kv_scale, num_splits=num_splits, config=config)
    assert_matches_reference(b, out, lse, kv_scale=kv_scale)


@pytest.mark.parametrize("config", [None, MLAConfig(8, 2, 16, 2, 1, 1)], ids=["default", "value2"])
def test_mla_int64_offsets(poisoned_workspace, monkeypatch, config):
    """The int64 row-offset variant (caches of 2**31 elements or more), forced on a small cache."""
    monkeypatch.setattr(offsets, "INT32_OFFSET_LIMIT", 0)
    b = make_mla_batch([(1, 70), (3, 40), (2, 35)], num_heads=8, dtype=torch.float32, seed=37)
    out, lse = run_mla(b, num_splits=2, config=config)
    assert_matches_reference(b, out, lse)


@pytest.mark.parametrize("kv_scale", [0.7, "tensor"], ids=["float-scale", "tensor-scale"])
def test_mla_fp8(poisoned_workspace, kv_scale):
    b = make_mla_batch(SPEC, num_heads=8, dtype=torch.float16, cache_dtype=torch.float8_e4m3fn, seed=11)
    if kv_scale == "tensor":
        kv_scale = torch.tensor([1.3], device=DEVICE)
    out, lse = run_mla(b, kv_scale=kv_scale, num_splits=2)
    assert_matches_reference(b, out, lse, kv_scale=kv_scale)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_rows_without_keys(poisoned_workspace, num_splits):
    # (3, 2): the first query sits at position -1; (2, 0): no keys at all. Output 0, lse -inf.
    b = make_mla_batch([(1, 20), (3, 2), (2, 0)], num_heads=4, dtype=torch.float32, seed=13)
    out, lse = run_mla(b, num_splits=num_splits)
    assert_matches_reference(b, out, lse)
    assert torch.isneginf(lse[1]).all() and torch.isneginf(lse[4:]).all()
    assert (out[1] == 0).all() and (out[4:] == 0).all()


def test_mla_default_out_and_no_lse():
    b = make_mla_batch(DECODE, num_heads=4, dtype=torch.float16, seed=17)
    out = mla_decode(*b.args(), scale=b.scale, max_query_len=1, max_seq_len=300)
    assert isinstance(out, torch.Tensor) and out.shape == b.q_nope.shape and out.dtype == b.q_nope.dtype
    ref_out, _ = mla_decode_ref(*b.args(), scale=b.scale)
    torch.testing.assert_close(out.double(), ref_out, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_mla_corrupt_metadata_stays_in_the_cache(corruption):
    b = make_mla_batch([(1, 70), (3, 40), (2, 35), (1, 17)], num_heads=4, dtype=torch.float32, seed=19)
    buf = torch.full((b.kv_cache.shape[0] + 2 * GUARD, *b.kv_cache.shape[1:]), float("nan"), device=DEVICE)
    buf[GUARD:-GUARD] = b.kv_cache
    b.kv_cache = buf[GUARD:-GUARD]
    ref_out, _ = mla_decode_ref(*b.args(), scale=b.scale)
    CORRUPTIONS[corruption](b, b.kv_cache.shape[0])
    for splits in (1, 3):
        out, _ = run_mla(b, num_splits=splits)
        assert not torch.isnan(out).any(), "a guard block or an unwritten row reached the output"
        for s in (0, 3):  # the sequences the corruption did not touch are exact
            rows = slice(int(b.query_start_loc[s]), int(b.query_start_loc[s + 1]))
            torch.testing.assert_close(out[rows].double(), ref_out[rows], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize(
    "block_size, bad, config",
    [
        pytest.param(1, "past", None, id="page1-past-default"),
        pytest.param(3, "negative", None, id="page3-negative-default"),  # tiles start inside pages
        pytest.param(8, "past-guard", MLAConfig(4, 4, 16, 2, 1, 1), id="page8-past-guard-value2-tile16"),
        pytest.param(16, "negative", MLAConfig(16, 1, 32, 1, 1, 1), id="page16-negative-one-token-blocks"),
        pytest.param(16, "past", MLAConfig(2, 8, 32, 4, 1, 1), id="page16-past-value4"),
        pytest.param(64, "past", MLAConfig(16, 1, 32, 1, 1, 1), id="page64-past-one-token-blocks"),
    ],
)
def test_mla_bad_block_id_mid_sequence_several_chunks(monkeypatch, block_size, bad, config):
    """A bad block id in the middle of a long sequence, with several block-table chunks per program
    (a small CHUNK_TARGET_KEYS; the interpreter reads the module's constants at every call): the
    chunk holding it runs the checked tile loop, the chunks before and after it the unchecked one.
    The bad page's keys read zeros and stay in the softmax with score 0, as if the page held zeros
    (the reference gets a zero page there). NaN guard blocks around the cache turn a read of an id
    just past it into NaN; "past-guard" points past the whole buffer, where a read would show as a
    mismatch (or a fault) instead. The other sequences are exact."""
    from pagedattn.ops.mla import kernel

    monkeypatch.setattr(kernel, "CHUNK_TARGET_KEYS", 32, raising=False)
    cases = [(1, 300), (3, 210), (1, 17), (2, 150)]
    b = make_mla_batch(cases, num_heads=4, latent_dim=64, block_size=block_size, dtype=torch.float32,
                       seed=41 + block_size)
    n = b.kv_cache.shape[0]
    buf = torch.full((n + 2 * GUARD, *b.kv_cache.shape[1:]), float("nan"), device=DEVICE)
    buf[GUARD:-GUARD] = b.kv_cache
    cache = buf[GUARD:-GUARD]
    # the reference: the bad entries point at an extra all-zero page
    ref_cache = torch.cat([b.kv_cache, torch.zeros_like(b.kv_cache[:1])])
    ref_table = b.block_table.clone()
    bad_id = {"past": n, "past-guard": n + GUARD + 5, "negative": -1}[bad]
    for s, page in [(0, 150 // block_size), (1, 100 // block_size)]:  # mid-sequence pages
        b.block_table[s, page] = bad_id
        ref_table[s, page] = n
    b.kv_cache = cache
    ref_out, ref_lse = mla_decode_ref(b.q_nope, b.q_pe, ref_cache, ref_table, b.seq_lens, b.query_start_loc,
                                      scale=b.scale)
    atol, rtol = TOLERANCES[torch.float32]
    for splits in (1, 3):
        out, lse = run_mla(b, num_splits=splits, config=config)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "a guard block reached the output"
        torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
        torch.testing.assert_close(lse.double(), ref_lse, atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "dtype, cache_dtype, slot_dtype, latent_dim, rope_dim, block_size",
    [
        pytest.param(torch.float16, None, torch.int32, 32, 16, 16, id="fp16"),
        pytest.param(torch.float32, None, torch.int64, 48, 16, 32, id="fp32-odd-latent-int64-slots"),
        pytest.param(torch.float16, torch.float8_e4m3fn, torch.int64, 512, 64, 16, id="fp16-to-fp8-576"),
        pytest.param(torch.float32, torch.float8_e4m3fn, torch.int32, 32, 16, 64, id="fp32-to-fp8"),
    ],
)
def test_write_mla_kv(dtype, cache_dtype, slot_dtype, latent_dim, rope_dim, block_size):
    g = torch.Generator().manual_seed(latent_dim + block_size)
    num_tokens, num_blocks = 21, 5
    cache_dtype = cache_dtype or dtype
    c_kv = (torch.randn(num_tokens, latent_dim, generator=g) * 4).to(DEVICE, dtype)
    k_pe = (torch.randn(num_tokens, rope_dim, generator=g) * 4).to(DEVICE, dtype)
    c_kv[0, :3] = torch.tensor([1000.0, -1000.0, 1e-4])  # saturation and subnormals in fp8
    kv_cache = torch.randn(num_blocks, block_size, latent_dim + rope_dim, generator=g).to(DEVICE, cache_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[3] = -1  # padding
    slots[11] = num_blocks * block_size + 7  # outside the cache: skipped
    slot_mapping = slots.to(DEVICE, slot_dtype)
    kv_scale = torch.tensor([1.5], device=DEVICE) if block_size == 64 else 0.75
    ref = write_mla_kv_ref(c_kv, k_pe, kv_cache, slot_mapping, kv_scale=kv_scale)
    write_mla_kv(c_kv, k_pe, kv_cache, slot_mapping, kv_scale=kv_scale)
    assert torch.equal(kv_cache.view(torch.uint8), ref.view(torch.uint8))  # bitwise, fp8 rounding included


def test_write_then_decode():
    """write_mla_kv fills the pages a decode step then reads."""
    b = make_mla_batch([(2, 30), (1, 9)], num_heads=4, dtype=torch.float16, seed=23)
    pages = b.block_table.long()
    slots = torch.cat([pages[0, (torch.arange(30) // 16)] * 16 + torch.arange(30) % 16,
                       pages[1, (torch.arange(9) // 16)] * 16 + torch.arange(9) % 16])
    g = torch.Generator().manual_seed(1)
    c_kv = torch.randn(39, 32, generator=g).to(DEVICE, torch.float16)
    k_pe = torch.randn(39, 16, generator=g).to(DEVICE, torch.float16)
    b.kv_cache.fill_(float("nan"))
    write_mla_kv(c_kv, k_pe, b.kv_cache, slots.to(DEVICE))
    out, lse = run_mla(b, num_splits=1)
    assert_matches_reference(b, out, lse)


def test_choose_mla_splits():
    config = MLAConfig(64, 1, 64, 1, 8, 2)  # 128 heads: 2 head groups, 216 KB: 1 program per SM
    assert choose_mla_splits(1, 128, 1, 4096, config, 132) == 32  # by length (128 keys a split)
    assert choose_mla_splits(1, 128, 1, 32768, config, 132) == 64  # by the cap
    assert choose_mla_splits(32, 128, 1, 4096, config, 132) == 2  # 64 programs -> 128
    assert choose_mla_splits(128, 128, 1, 4096, config, 132) == 1  # the grid already fills the GPU
    assert choose_mla_splits(1, 128, 1, 100, config, 132) == 1  # too short to split
    value2 = MLAConfig(64, 1, 32, 2, 4, 4)  # 2 head groups x 2 value parts
    assert choose_mla_splits(1, 128, 1, 32768, value2, 132) == 33  # by fill: 132 // 4 programs
    assert choose_mla_splits(32, 128, 1, 4096, value2, 132) == 1  # 128 programs: one wave already
    small = MLAConfig(16, 1, 32, 1, 4, 1)  # 54 KB: 4 per SM
    assert choose_mla_splits(4, 16, 1, 32768, small, 132) == 64  # fill 4 * 132 // 4 = 132 -> cap


def test_pick_mla_config(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the GPU rule (no launch here)
    for heads, q_len in [(128, 1), (128, 8), (16, 1), (16, 4), (32, 1), (8, 1), (1, 1)]:
        for row_bytes, fp8 in [(1152, False), (1152, True), (2304, False)]:
            config = pick_mla_config(heads, q_len, row_bytes, fp8)
            assert config.block_m >= 16 and config.problems(row_bytes=row_bytes) == [], (heads, q_len, config)
    assert pick_mla_config(128, 1) == MLAConfig(64, 1, 64, 1, 8, 2)
    assert pick_mla_config(128, 1, fp8_cache=True) == MLAConfig(64, 1, 32, 2, 4, 4)
    assert pick_mla_config(16, 1).value_split == 1 and pick_mla_config(32, 1).value_split == 2
    # small batches (split keys) take the 4-warp value-split config; B=32 of 128 heads does not
    assert pick_mla_config(128, 1, num_seqs=1, sms=132) == MLAConfig(64, 1, 32, 2, 4, 4)
    assert pick_mla_config(128, 1, num_seqs=32, sms=132) == MLAConfig(64, 1, 64, 1, 8, 2)
    assert MLAConfig(64, 1, 64, 1, 4, 4).problems()  # 256 accumulator registers, 360 KB
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pick_mla_config(128, 1).block_m == 16


# --------------------------------------------------------------------------------------------
# bad input: ValueError / TypeError naming the argument, before any launch


@pytest.fixture
def no_launch(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a kernel was launched for bad input")

    monkeypatch.setattr(mla, "launch_mla_decode", boom)
    monkeypatch.setattr(mla, "launch_write_mla_kv", boom)


ARG_NAMES = ["q_nope", "q_pe", "kv_cache", "block_table", "seq_lens", "query_start_loc"]

BAD_DECODE_INPUTS = [
    pytest.param({"q_nope": lambda b: b.q_nope[0]}, ValueError, "q_nope", id="q-nope-ndim"),
    pytest.param({"q_nope": lambda b: b.q_nope.to(torch.int32)}, TypeError, "q_nope", id="q-nope-dtype"),
    pytest.param({"q_nope": lambda b: "not a tensor"}, TypeError, "q_nope", id="q-nope-not-tensor"),
    pytest.param({"q_pe": lambda b: b.q_pe.float()}, TypeError, "q_pe", id="q-pe-dtype"),
    pytest.param({"q_pe": lambda b: b.q_pe[:, :2]}, ValueError, "q_pe", id="q-pe-heads"),
    pytest.param({"q_pe": lambda b: b.q_pe.transpose(1, 2).contiguous().transpose(1, 2)}, ValueError, "q_pe",
                 id="q-pe-last-dim-strided"),
    pytest.param({"q_nope": lambda b: b.q_nope[..., :24]}, ValueError, "q_nope", id="latent-not-multiple-16"),
    pytest.param({"q_pe": lambda b: b.q_pe[..., :8]}, ValueError, "q_pe", id="rope-too-small"),
    pytest.param({"kv_cache": lambda b: b.kv_cache.float()}, TypeError, "kv_cache", id="cache-dtype"),
    pytest.param({"kv_cache": lambda b: b.kv_cache[..., :40]}, ValueError, "kv_cache", id="cache-width"),
    pytest.param({"kv_cache": lambda b: b.kv_cache[:, :, None]}, ValueError, "kv_cache", id="cache-ndim"),
    pytest.param({"block_table": lambda b: b.block_table.long()}, TypeError, "block_table", id="block-table-int64"),
    pytest.param({"block_table": lambda b: b.block_table[:1]}, ValueError, "block_table", id="block-table-rows"),
    pytest.param({"seq_lens": lambda b: b.seq_lens.long()}, TypeError, "seq_lens", id="seq-lens-int64"),
    pytest.param({"query_start_loc": lambda b: b.query_start_loc[:2]}, ValueError, "query_start_loc",
                 id="qsl-length"),
    pytest.param({"query_start_loc": lambda b: b.query_start_loc.float()}, TypeError, "query_start_loc",
                 id="qsl-dtype"),
    pytest.param({"scale": lambda b: None}, TypeError, "scale", id="scale-none"),
    pytest.param({"max_query_len": lambda b: 9}, ValueError, "max_query_len", id="query-too-long"),
    pytest.param({"max_query_len": lambda b: -1}, ValueError, "max_query_len", id="max-query-len-negative"),
    pytest.param({"max_seq_len": lambda b: 1.5}, TypeError, "max_seq_len", id="max-seq-len-float"),
    pytest.param({"num_splits": lambda b: 0}, ValueError, "num_splits", id="num-splits-zero"),
    pytest.param({"kv_scale": lambda b: torch.ones(2)}, ValueError, "kv_scale", id="kv-scale-shape"),
    pytest.param({"kv_scale": lambda b: torch.ones(1, dtype=torch.float16)}, TypeError, "kv_scale",
                 id="kv-scale-dtype"),
    pytest.param({"out": lambda b: torch.empty(1, 4, 32, dtype=b.q_nope.dtype)}, ValueError, "out", id="out-shape"),
    pytest.param({"out": lambda b: torch.empty(b.q_nope.shape)}, TypeError, "out", id="out-dtype"),
]


@pytest.mark.parametrize("changes, exc, word", BAD_DECODE_INPUTS)
def test_mla_decode_rejects(no_launch, changes, exc, word):
    b = make_mla_batch([(1, 20), (3, 9)], num_heads=4, seed=29)
    args = dict(zip(ARG_NAMES, b.args()))
    kwargs = {"scale": b.scale}
    for name, make in changes.items():
        (args if name in ARG_NAMES else kwargs)[name] = make(b)
    with pytest.raises(exc, match=word):
        mla_decode(*[args[n] for n in ARG_NAMES], **kwargs)


def test_mla_decode_rejects_long_queries_from_metadata(no_launch):
    b = make_mla_batch([(9, 20), (1, 9)], num_heads=4, seed=31)
    with pytest.raises(ValueError, match="query_start_loc"):
        mla_decode(*b.args(), scale=b.scale)


def test_write_mla_kv_rejects(no_launch):
    c_kv = torch.randn(3, 32).half()
    k_pe = torch.randn(3, 16).half()
    cache = torch.zeros(4, 16, 48).half()
    slots = torch.arange(3, dtype=torch.int32)
    cases = [
        (dict(c_kv=c_kv[0]), ValueError, "c_kv"),
        (dict(k_pe=k_pe.float()), TypeError, "k_pe"),
        (dict(k_pe=k_pe[:2]), ValueError, "k_pe"),
        (dict(kv_cache=cache[..., :40]), ValueError, "kv_cache"),
        (dict(kv_cache=cache.float()), TypeError, "kv_cache"),
        (dict(slot_mapping=slots.float()), TypeError, "slot_mapping"),
        (dict(slot_mapping=slots[:2]), ValueError, "slot_mapping"),
        (dict(kv_scale=torch.ones(3)), ValueError, "kv_scale"),
    ]
    for change, exc, word in cases:
        args = dict(c_kv=c_kv, k_pe=k_pe, kv_cache=cache, slot_mapping=slots)
        kwargs = {k: change.pop(k) for k in list(change) if k == "kv_scale"}
        args.update(change)
        with pytest.raises(exc, match=word):
            write_mla_kv(**args, **kwargs)
