"""The unified (2D) paged-attention kernel against the float64 reference, on the interpreter.

fp16 and fp32 only: the interpreter cannot do bf16 arithmetic (bf16 runs in test_gpu.py).
"""

import zlib

import pytest
import torch

from pagedattn import paged_attention, plan_attention
from pagedattn.ops.common.offsets import needs_int64_offsets
from pagedattn.reference import paged_attention_ref
from pagedattn.testing import (
    BATCHES,
    FEATURES,
    TOLERANCES,
    assert_matches_reference,
    feature_kwargs,
    make_paged_batch,
    max_errors,
)
from tests.conftest import DEVICE


def run_and_compare(batch, kwargs, *, dtype):
    out = torch.full_like(batch.q, float("nan"))
    got, lse = paged_attention(
        *batch.args(), max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
        out=out, return_lse=True, **kwargs,
    )
    assert got.data_ptr() == out.data_ptr()
    ref_out, ref_lse = paged_attention_ref(*batch.args(), **kwargs)
    assert got.dtype == dtype
    assert_matches_reference(got, lse, ref_out, ref_lse)
    return max_errors(got, lse, ref_out, ref_lse)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("batch_kind", list(BATCHES))
@pytest.mark.parametrize("feature", FEATURES)
def test_features(feature, batch_kind, dtype):
    g = torch.Generator().manual_seed(zlib.crc32(f"{feature}-{batch_kind}".encode()))
    cases = BATCHES[batch_kind]
    if feature in ("noncausal", "window_noncausal"):
        cases = cases + [(7, 3)]  # cross attention: more queries than keys
    batch = make_paged_batch(cases, dtype=dtype, device=DEVICE, generator=g)
    kwargs = feature_kwargs(feature, batch.q.shape[1], len(cases), device=DEVICE, generator=g)
    run_and_compare(batch, kwargs, dtype=dtype)


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_size, block_size",
    [
        pytest.param(4, 1, 32, 16, id="mqa"),
        pytest.param(3, 3, 32, 16, id="mha"),
        pytest.param(6, 2, 32, 32, id="gqa3-page32"),
        pytest.param(32, 1, 16, 16, id="gqa32"),
        pytest.param(2, 1, 8, 16, id="head8"),
        pytest.param(2, 1, 24, 64, id="head24-page64"),
        pytest.param(2, 1, 80, 128, id="head80-page128"),
        pytest.param(2, 2, 96, 16, id="head96"),
        pytest.param(2, 1, 112, 16, id="head112"),
        pytest.param(2, 1, 160, 16, id="head160"),
        pytest.param(2, 1, 192, 32, id="head192"),
        pytest.param(2, 1, 256, 16, id="head256"),
        pytest.param(2, 1, 32, 1, id="page1"),  # one tile per block-table chunk
        pytest.param(2, 1, 32, 3, id="page3"),  # chunks that start inside a page
    ],
)
def test_shapes(num_q_heads, num_kv_heads, head_size, block_size):
    g = torch.Generator().manual_seed(num_q_heads * 1000 + head_size)
    batch = make_paged_batch(
        [(1, 70), (9, 9), (0, 3), (3, 140)], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_size=head_size, block_size=block_size, dtype=torch.float16, device=DEVICE, generator=g,
    )
    run_and_compare(batch, {}, dtype=torch.float16)


def test_lse_out_buffer():
    """lse_out= receives the lse (return_lse implied): with out= and a plan the call allocates nothing."""
    g = torch.Generator().manual_seed(12)
    batch = make_paged_batch([(1, 50), (4, 30)], dtype=torch.float32, device=DEVICE, generator=g)
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=batch.q.shape[1],
                          num_kv_heads=batch.k_cache.shape[2], head_size=batch.q.shape[2], device=DEVICE)
    out = torch.full_like(batch.q, float("nan"))
    lse_buf = torch.full(batch.q.shape[:2], float("nan"), device=DEVICE)
    got, lse = paged_attention(*batch.args(), out=out, lse_out=lse_buf, plan=plan)
    assert lse.data_ptr() == lse_buf.data_ptr()
    assert_matches_reference(got, lse, *paged_attention_ref(*batch.args()))
    with pytest.raises(ValueError, match="lse_out"):
        paged_attention(*batch.args(), plan=plan, lse_out=torch.empty(3, 1, device=DEVICE))


def test_several_block_table_chunks():
    """Sequences longer than one chunk of block-table ids (1024 keys at 16-token pages)."""
    g = torch.Generator().manual_seed(11)
    batch = make_paged_batch([(1, 2100), (5, 1030), (1, 961)], num_q_heads=2, num_kv_heads=1, head_size=16,
                             block_size=16, dtype=torch.float32, device=DEVICE, generator=g)
    run_and_compare(batch, {"sliding_window": 1500}, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
def test_fp8_cache(dtype, scale_kind):
    g = torch.Generator().manual_seed(7)
    batch = make_paged_batch(
        BATCHES["mixed"], dtype=dtype, cache_dtype=torch.float8_e4m3fn, device=DEVICE, generator=g
    )
    if scale_kind == "float":
        k_scale, v_scale = 0.5, 1.25
    else:
        k_scale = torch.tensor(0.5, device=DEVICE)
        v_scale = torch.tensor([1.25], device=DEVICE)
    run_and_compare(batch, {"k_scale": k_scale, "v_scale": v_scale, "sliding_window": 50}, dtype=dtype)


def test_no_visible_key_gives_zero_and_neg_inf():
    # Window 1 with non-causal cross attention: queries past the keys see nothing.
    g = torch.Generator().manual_seed(3)
    batch = make_paged_batch([(6, 2)], dtype=torch.float32, device=DEVICE, generator=g)
    out, lse = paged_attention(*batch.args(), causal=False, sliding_window=1, return_lse=True)
    ref_out, ref_lse = paged_attention_ref(*batch.args(), causal=False, sliding_window=1)
    assert torch.isinf(ref_lse).any() and torch.isfinite(ref_lse).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert (out[torch.isinf(lse)] == 0).all()
    torch.testing.assert_close(out.double(), ref_out, **dict(zip(("atol", "rtol"), TOLERANCES[torch.float32])))


def test_without_host_maxima_and_default_out():
    g = torch.Generator().manual_seed(4)
    batch = make_paged_batch(BATCHES["mixed"], dtype=torch.float32, device=DEVICE, generator=g)
    out = paged_attention(*batch.args())
    ref_out, _ = paged_attention_ref(*batch.args())
    torch.testing.assert_close(out.double(), ref_out, **dict(zip(("atol", "rtol"), TOLERANCES[torch.float32])))


def test_strided_q_and_out():
    # q and out as views with padded head stride: last dim contiguous is all the kernel needs.
    g = torch.Generator().manual_seed(5)
    batch = make_paged_batch(BATCHES["mixed"], dtype=torch.float16, device=DEVICE, generator=g)
    q_wide = torch.randn(batch.q.shape[0], batch.q.shape[1], 48, generator=g).to(DEVICE, torch.float16)
    q_wide[..., :32] = batch.q
    out_wide = torch.full_like(q_wide, float("nan"))
    paged_attention(q_wide[..., :32], *batch.args()[1:], out=out_wide[..., :32])
    ref_out, _ = paged_attention_ref(*batch.args())
    torch.testing.assert_close(out_wide[..., :32].double(), ref_out, atol=5e-3, rtol=5e-3)
    assert torch.isnan(out_wide[..., 32:]).all(), "wrote outside the out view"


def test_reference_does_not_modify_inputs():
    g = torch.Generator().manual_seed(6)
    batch = make_paged_batch(BATCHES["mixed"], dtype=torch.float32, device=DEVICE, generator=g)
    before = [t.clone() for t in batch.args()]
    paged_attention_ref(*batch.args(), **feature_kwargs("prefix", 4, len(batch.cases), generator=g))
    for a, b in zip(before, batch.args()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path", ["unified", "split_kv", "persistent", "prefill"])
def test_cache_past_int32_offsets(path):
    # 2**31 + elements; torch.empty leaves the unused blocks untouched, and the batch lives in
    # the highest block ids, so any 32-bit offset arithmetic would read the wrong memory (the
    # kernels switch to 64-bit offsets for such a cache: needs_int64_offsets).
    num_blocks = 2**31 // (16 * 1 * 16) + 64
    g = torch.Generator().manual_seed(8)
    batch = make_paged_batch(
        [(1, 40), (3, 20)], num_q_heads=2, num_kv_heads=1, head_size=16, num_blocks=num_blocks,
        dtype=torch.float16, device=DEVICE, generator=g,
    )
    assert batch.k_cache.numel() > 2**31 and needs_int64_offsets(batch.k_cache)
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=2, num_kv_heads=1, head_size=16,
                          device=DEVICE, path=path, num_splits=3 if path in ("split_kv", "persistent") else None)
    out, lse = paged_attention(*batch.args(), plan=plan, out=torch.full_like(batch.q, float("nan")), return_lse=True)
    assert_matches_reference(out, lse, *paged_attention_ref(*batch.args()))


def test_more_sequences_than_one_search_block():
    """300 sequences: find_seq_idx counts sequence starts in two blocks of 256."""
    g = torch.Generator().manual_seed(12)
    cases = [(int(q), int(kv)) for q, kv in zip(torch.randint(0, 4, (300,), generator=g),
                                                torch.randint(4, 40, (300,), generator=g))]
    batch = make_paged_batch(cases, num_q_heads=2, num_kv_heads=1, head_size=16, dtype=torch.float32,
                             device=DEVICE, generator=g)
    run_and_compare(batch, {"sliding_window": 20}, dtype=torch.float32)


GUARD_ROWS = 3
SENTINEL = 1234.5  # a finite value no kernel computes here, so a stray write of any value shows


def guarded_outputs(q):
    """(out, lse, out_buf, lse_buf): out / lse are the first num_tokens rows of buffers whose
    GUARD_ROWS rows past num_tokens hold SENTINEL."""
    num_tokens, num_heads, head_size = q.shape
    out_buf = torch.full((num_tokens + GUARD_ROWS, num_heads, head_size), SENTINEL, dtype=q.dtype, device=q.device)
    lse_buf = torch.full((num_tokens + GUARD_ROWS, num_heads), SENTINEL, dtype=torch.float32, device=q.device)
    out_buf[:num_tokens] = float("nan")
    return out_buf[:num_tokens], lse_buf[:num_tokens], out_buf, lse_buf


def guard_rows_untouched(out_buf, lse_buf, num_tokens):
    return bool((out_buf[num_tokens:] == SENTINEL).all()) and bool((lse_buf[num_tokens:] == SENTINEL).all())


@pytest.mark.parametrize("path", ["unified", "split_kv", "prefill"])
def test_corrupt_query_start_loc_writes_no_row_past_num_tokens(path):
    """query_start_loc entries past num_tokens (and a decreasing one): the kernels write no row of
    out or lse at or past num_tokens, and the sequence before the corruption stays exact."""
    from pagedattn.ops.common.bundles import AttentionArgs
    from pagedattn.ops.common.tiles import Tiles
    from pagedattn.ops.prefill.launch import launch_prefill
    from pagedattn.ops.split_kv.launch import launch_split_kv
    from pagedattn.ops.unified.launch import launch_unified

    g = torch.Generator().manual_seed(31)
    cases = [(40, 70), (3, 40), (2, 35)] if path == "prefill" else [(1, 70), (3, 40), (2, 35)]
    batch = make_paged_batch(cases, dtype=torch.float32, device=DEVICE, generator=g)
    num_tokens, num_heads, head_size = batch.q.shape
    ref_out, _ = paged_attention_ref(*batch.args())
    qsl = batch.query_start_loc.clone()
    qsl[2] = num_tokens + 5  # sequence 1 claims rows past the batch
    qsl[3] = num_tokens + 40
    a = AttentionArgs(q=batch.q, k_cache=batch.k_cache, v_cache=batch.v_cache, block_table=batch.block_table,
                      seq_lens=batch.seq_lens, query_start_loc=qsl, scale=head_size ** -0.5, causal=True,
                      sliding_window=0, softcap=0.0, alibi_mode=0, alibi_slopes=None, sinks=None, prefix_ranges=None,
                      k_scale=None, v_scale=None)
    out, lse, out_buf, lse_buf = guarded_outputs(batch.q)
    if path == "unified":
        launch_unified(out, lse, a, Tiles(16, 8, 16, 1, 1))
    elif path == "split_kv":
        partial_out = torch.full((num_tokens, num_heads, 4, head_size), float("nan"), device=DEVICE)
        partial_lse = torch.full((num_tokens, num_heads, 4), float("nan"), device=DEVICE)
        launch_split_kv(out, lse, a, Tiles(16, 8, 16, 1, 1), num_splits=4, segment_size=0,
                        partial_out=partial_out, partial_lse=partial_lse)
    else:
        launch_prefill(out, lse, a, Tiles(16, 16, 16, 1, 1), max_query_len=num_tokens + 40)
    assert guard_rows_untouched(out_buf, lse_buf, num_tokens)
    rows = slice(0, int(qsl[1]))
    torch.testing.assert_close(out[rows].double(), ref_out[rows], atol=2e-4, rtol=2e-4)
