"""Large-tile prefill kernel on the interpreter: varlen_attention over contiguous K/V and the
paged prefill path (forced, and the automatic split between prefill and Q-block kernels)."""

import zlib

import pytest
import torch

from pagedattn import paged_attention, plan_attention, varlen_attention
from pagedattn.reference import paged_attention_ref, varlen_attention_ref
from pagedattn.testing import FEATURES, assert_matches_reference, feature_kwargs, make_paged_batch
from tests.conftest import DEVICE

# (query_len, kv_len): prefill, extend, decode, empty and cross-attention-sized rows
VARLEN = [(70, 70), (17, 40), (1, 33), (0, 5), (45, 45)]


def _check_varlen_feature(feature, dtype, seed):
    """VARLEN (plus a cross-attention row for non-causal features) with one feature, against the reference."""
    g = torch.Generator().manual_seed(seed)
    cases = VARLEN + ([(9, 4)] if "noncausal" in feature else [])
    hq, hkv, d = 4, 2, 32
    cu_q = torch.tensor([0] + [q for q, _ in cases], dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [k for _, k in cases], dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(int(cu_k[-1]), hkv, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(int(cu_k[-1]), hkv, d, generator=g).to(DEVICE, dtype)
    kwargs = feature_kwargs(feature, hq, len(cases), device=DEVICE, generator=g)
    out = torch.full_like(q, float("nan"))
    out, lse = varlen_attention(q, k, v, cu_q.to(DEVICE), cu_k.to(DEVICE), out=out, return_lse=True, **kwargs)
    assert_matches_reference(out, lse, *varlen_attention_ref(q, k, v, cu_q, cu_k, **kwargs))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("feature", FEATURES)
def test_varlen_features(feature, dtype):
    _check_varlen_feature(feature, dtype, zlib.crc32(feature.encode()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("feature", ["causal", "noncausal", "window", "prefix", "sinks", "softcap"])
def test_varlen_tma(feature, dtype, monkeypatch):
    """The tensor-descriptor path (the sm90 default; PAGEDATTN_TMA=1 on the interpreter) against the reference: tiles that run
    past a sequence into the next one and past the end of K/V."""
    import pagedattn.ops.prefill.launch as prefill_launch

    monkeypatch.setenv("PAGEDATTN_TMA", "1")
    taken = []
    real = prefill_launch.tma_descriptors
    monkeypatch.setattr(prefill_launch, "tma_descriptors", lambda *a: taken.append(real(*a)) or taken[-1])
    _check_varlen_feature(feature, dtype, zlib.crc32(f"tma-{feature}".encode()))
    assert taken and taken[0][0] is not None  # the descriptors were used


@pytest.mark.parametrize("head_size", [8, 80, 256])
def test_varlen_head_sizes(head_size):
    g = torch.Generator().manual_seed(head_size)
    cu = torch.tensor([0, 40, 75], dtype=torch.int32)
    q = torch.randn(75, 2, head_size, generator=g).to(DEVICE, torch.float16)
    k = torch.randn(75, 1, head_size, generator=g).to(DEVICE, torch.float16)
    v = torch.randn(75, 1, head_size, generator=g).to(DEVICE, torch.float16)
    out, lse = varlen_attention(q, k, v, cu, cu, return_lse=True, softcap=4.0)
    ref_out, ref_lse = varlen_attention_ref(q, k, v, cu, cu, softcap=4.0)
    assert_matches_reference(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("head_size, head_size_v", [(48, 32), (24, 40)], ids=["v-narrower", "v-wider"])
def test_varlen_value_head_size_differs(head_size, head_size_v, dtype):
    # MLA prefill after decompression has q/k heads of 192 and v heads of 128 (scaled down here)
    g = torch.Generator().manual_seed(head_size * 100 + head_size_v)
    cases = VARLEN
    cu_q = torch.tensor([0] + [q for q, _ in cases], dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [k for _, k in cases], dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), 4, head_size, generator=g).to(DEVICE, dtype)
    k = torch.randn(int(cu_k[-1]), 2, head_size, generator=g).to(DEVICE, dtype)
    v = torch.randn(int(cu_k[-1]), 2, head_size_v, generator=g).to(DEVICE, dtype)
    out = torch.full((q.shape[0], 4, head_size_v), float("nan"), dtype=dtype, device=DEVICE)
    out, lse = varlen_attention(q, k, v, cu_q.to(DEVICE), cu_k.to(DEVICE), out=out, return_lse=True, softcap=8.0,
                                sliding_window=30)
    ref_out, ref_lse = varlen_attention_ref(q, k, v, cu_q, cu_k, softcap=8.0, sliding_window=30)
    assert out.shape == (q.shape[0], 4, head_size_v)
    assert_matches_reference(out, lse, ref_out, ref_lse)
    with pytest.raises(ValueError, match="out"):
        varlen_attention(q, k, v, cu_q.to(DEVICE), cu_k.to(DEVICE), out=torch.empty_like(q))


@pytest.mark.parametrize("path", ["prefill", "auto"])
@pytest.mark.parametrize("feature", ["causal", "window", "sinks", "prefix", "alibi_sqrt", "fp8"])
def test_paged_prefill_path(feature, path):
    # 130 and 140 queries reach the automatic prefill threshold (128); the rest stay on the Q-block kernel
    g = torch.Generator().manual_seed(zlib.crc32((feature + path).encode()))
    cases = [(130, 130), (1, 77), (5, 40), (140, 200), (0, 3)]
    cache_dtype = torch.float8_e4m3fn if feature == "fp8" else None
    batch = make_paged_batch(cases, dtype=torch.float16, cache_dtype=cache_dtype, device=DEVICE, generator=g)
    kwargs = {"k_scale": 0.5, "v_scale": 1.5} if feature == "fp8" else feature_kwargs(feature, 4, len(cases), device=DEVICE, generator=g)
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=4, num_kv_heads=2, head_size=32,
                          device=DEVICE, path=path, dtype=torch.float16)
    assert plan.path == "prefill"
    out = torch.full_like(batch.q, float("nan"))
    out, lse = paged_attention(*batch.args(), out=out, return_lse=True, plan=plan, **kwargs)
    ref_out, ref_lse = paged_attention_ref(*batch.args(), **kwargs)
    assert_matches_reference(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("feature", ["window", "prefix"])
@pytest.mark.parametrize("cases, rest, seqs", [
    ([(130, 130), (140, 200)], 0, (0, 2)),  # prefill only: no unified launch
    ([(1, 77), (130, 130), (1, 40)], 1, (1, 2)),  # prefill among decodes: the decodes on decode tiles
    ([(0, 5), (129, 300), (7, 50), (140, 200), (1, 9)], 7, (1, 4)),  # a short one between two long ones
], ids=["prefill-only", "decodes", "short-between"])
def test_prefill_plan_rest(cases, rest, seqs, feature):
    """A prefill plan sizes the unified launch for the sequences it leaves to the Q-block kernel,
    and runs the large-tile kernel on views of the metadata of the range that holds the long ones."""
    g = torch.Generator().manual_seed(len(cases) + rest + len(feature))
    batch = make_paged_batch(cases, dtype=torch.float32, device=DEVICE, generator=g)
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=4, num_kv_heads=2, head_size=32,
                          device=DEVICE, dtype=torch.float32)
    assert (plan.path, plan.rest_max_query_len, plan.prefill_seqs) == ("prefill", rest, seqs)
    kwargs = feature_kwargs(feature, 4, len(cases), device=DEVICE, generator=g)
    out = torch.full_like(batch.q, float("nan"))
    out, lse = paged_attention(*batch.args(), out=out, return_lse=True, plan=plan, **kwargs)
    assert_matches_reference(out, lse, *paged_attention_ref(*batch.args(), **kwargs))


@pytest.mark.parametrize("scale", [-0.3, 0.0, 0.7], ids=["negative", "zero", "positive"])
def test_prefill_scale_sign(scale):
    """A positive scale enters the softmax as a factor on the raw q.k (the kernel's RAW_SCORES: the
    row max on q.k, one multiply-add a weight); zero and negative scales form the scores first.
    Paged (masked and mask-free tiles, 130-320 queries) and contiguous K/V against the reference."""
    g = torch.Generator().manual_seed(int(scale * 10) + 50)
    batch = make_paged_batch([(130, 130), (1, 40), (320, 330)], num_q_heads=4, num_kv_heads=2, head_size=32,
                             dtype=torch.float16, device=DEVICE, generator=g)
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=4, num_kv_heads=2, head_size=32,
                          device=DEVICE, path="prefill", dtype=torch.float16)
    out = torch.full_like(batch.q, float("nan"))
    out, lse = paged_attention(*batch.args(), out=out, return_lse=True, plan=plan, scale=scale, sliding_window=200)
    assert_matches_reference(out, lse, *paged_attention_ref(*batch.args(), scale=scale, sliding_window=200))

    cu = torch.tensor([0, 70, 87, 132], dtype=torch.int32)
    q, k, v = (torch.randn(132, h, 32, generator=g).to(DEVICE, torch.float16) for h in (4, 2, 2))
    out = torch.full_like(q, float("nan"))
    out, lse = varlen_attention(q, k, v, cu.to(DEVICE), cu.to(DEVICE), out=out, return_lse=True, scale=scale)
    assert_matches_reference(out, lse, *varlen_attention_ref(q, k, v, cu, cu, scale=scale))


@pytest.mark.parametrize("block_size", [1, 3])
def test_paged_prefill_several_block_table_chunks(block_size, monkeypatch):
    # small chunks (the interpreter reads the module's constants at every call): the kernel reads the
    # block table in several chunks per program (one at 1-token pages holds a single tile), and at
    # 3-token pages chunks start inside a page
    from pagedattn.ops.prefill import kernel

    monkeypatch.setattr(kernel, "CHUNK_TARGET_KEYS", 32)  # one 32-key tile per chunk
    g = torch.Generator().manual_seed(block_size)
    batch = make_paged_batch([(300, 420), (129, 129)], num_q_heads=2, num_kv_heads=1, head_size=16,
                             block_size=block_size, dtype=torch.float32, device=DEVICE, generator=g)
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=2, num_kv_heads=1, head_size=16,
                          device=DEVICE, path="prefill", dtype=torch.float32)
    out = torch.full_like(batch.q, float("nan"))
    out, lse = paged_attention(*batch.args(), out=out, return_lse=True, plan=plan, sliding_window=350)
    ref_out, ref_lse = paged_attention_ref(*batch.args(), sliding_window=350)
    assert_matches_reference(out, lse, ref_out, ref_lse)


def test_varlen_rejects_bad_input():
    q = torch.randn(5, 4, 32).half()
    k = torch.randn(5, 2, 32).half()
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(TypeError, match="k"):
        varlen_attention(q, k.float(), k, cu, cu)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        varlen_attention(q, k, k, cu, torch.tensor([0, 2, 5], dtype=torch.int32))
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        varlen_attention(q, k, k, cu.long(), cu)


def test_short_prefill_rule():
    """64-row tiles for a causal prefill of a few waves whose keys are mostly its own queries."""
    from pagedattn.plan import short_prefill

    sms = 132
    assert short_prefill(2048, 1, 32, sms, diagonal=True)  # 512 programs: 3.9 waves
    assert short_prefill(512, 1, 32, sms, diagonal=True)
    assert not short_prefill(8192, 1, 32, sms, diagonal=True)  # 2048 programs: 15.5 waves
    assert not short_prefill(2048, 1, 32, sms, diagonal=False)  # an extend over a long context
    assert not short_prefill(4096, 2, 32, sms, diagonal=True)  # 2048 programs: 15.5 waves
    # the limit: 8 waves of 128-row programs at 4 SMs are 32 programs (8 Q tiles x 4 heads)
    assert short_prefill(8 * 128, 1, 4, 4, diagonal=True)
    assert not short_prefill(8 * 128 + 1, 1, 4, 4, diagonal=True)


def test_short_prefill_tiles(monkeypatch):
    """pick_prefill_tiles' GPU table: 64 x 64 tiles when short for heads of 65-128, else the large tiles."""
    from pagedattn.plan import pick_prefill_tiles

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    def shape(t):
        return t.block_m, t.tile_n

    assert shape(pick_prefill_tiles(128, torch.bfloat16, short=True)) == (64, 64)
    assert shape(pick_prefill_tiles(96, torch.bfloat16, short=True)) == (64, 64)
    assert pick_prefill_tiles(64, torch.bfloat16, short=True) == pick_prefill_tiles(64, torch.bfloat16)
    assert shape(pick_prefill_tiles(128, torch.bfloat16)) == (128, 128)
    assert pick_prefill_tiles(256, torch.bfloat16, short=True) == pick_prefill_tiles(256, torch.bfloat16)


@pytest.mark.parametrize("cases, short", [
    ([(2048, 2048)] + [(1, 2049)] * 63, True),  # the reference mixed batch: the prefill's grid is 3.9 waves
    ([(512, 4608)] * 4, False),  # the reference extend: long context, programs of equal work
    ([(8192, 8192)], False),  # 15.5 waves
])
def test_prefill_plan_short_tiles(cases, short, monkeypatch):
    """The prefill plan asks for short tiles from the sequences its large-tile grid covers."""
    import pagedattn.plan.prefill as prefill_plan

    asked = []
    monkeypatch.setattr(prefill_plan, "num_sms", lambda device: 132)
    monkeypatch.setattr(prefill_plan, "pick_prefill_tiles", lambda h, d, short=False: asked.append(short) or
                        prefill_plan.Tiles(32, 32, 32, 1, 1))
    qsl = [0]
    for q, _ in cases:
        qsl.append(qsl[-1] + q)
    plan = plan_attention(qsl, [n for _, n in cases], num_q_heads=32, num_kv_heads=8, head_size=128, device="cpu")
    assert plan.path == "prefill" and asked == [short]


@pytest.mark.parametrize("kv_len, short", [(130, True), (1000, False)])
def test_eager_short_tiles(kv_len, short, monkeypatch):
    """Eager paged and varlen calls apply the rule too (from host sizes, no sync), and stay correct."""
    import pagedattn.api as api
    import pagedattn.plan.planner as planner
    import pagedattn.plan.prefill as prefill_plan

    asked = []
    real = api.pick_prefill_tiles
    spy = lambda h, d, short=False: asked.append(short) or real(h, d, short=short)  # noqa: E731
    monkeypatch.setattr(api, "pick_prefill_tiles", spy)  # varlen_attention
    monkeypatch.setattr(prefill_plan, "pick_prefill_tiles", spy)  # the plan of a call without one
    monkeypatch.setattr(planner, "_CALL_PLANS", {})  # plan this call afresh
    g = torch.Generator().manual_seed(kv_len)
    batch = make_paged_batch([(130, kv_len)], dtype=torch.float16, device=DEVICE, generator=g)
    out = paged_attention(*batch.args(), max_query_len=130, max_seq_len=kv_len, out=torch.full_like(batch.q, float("nan")))
    assert_matches_reference(out, None, paged_attention_ref(*batch.args())[0], None)
    k = torch.randn(kv_len, 2, 32, generator=g).to(DEVICE, torch.float16)
    cu_q = torch.tensor([0, 130], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, kv_len], dtype=torch.int32, device=DEVICE)
    out = varlen_attention(batch.q, k, k, cu_q, cu_k, max_query_len=130, out=torch.full_like(batch.q, float("nan")))
    assert_matches_reference(out, None, varlen_attention_ref(batch.q, k, k, cu_q, cu_k)[0], None)
    assert asked == [short, short]


def test_prefill_grid_limits_are_checked_before_any_launch():
    """The prefill grid's y and z sizes (sequences, Q tiles) are capped at 65535 on CUDA: a call
    beyond them gets a ValueError naming the argument (here from host sizes alone), everywhere."""
    q = torch.randn(4, 2, 16).to(DEVICE, torch.float16)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="max_query_len"):
        varlen_attention(q, q, q, cu, cu, max_query_len=65536 * 128)
    batch = make_paged_batch([(130, 130)], num_q_heads=2, num_kv_heads=2, head_size=16, dtype=torch.float16,
                             device=DEVICE)
    with pytest.raises(ValueError, match="max_query_len"):
        paged_attention(*batch.args(), max_query_len=65536 * 128, max_seq_len=130)
    many = torch.arange(65537, dtype=torch.int32, device=DEVICE).clamp(max=4)
    with pytest.raises(ValueError, match="query_start_loc"):
        varlen_attention(q, q, q, many, many, max_query_len=1)
