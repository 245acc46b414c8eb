"""Fuzz (hypothesis, interpreter): random mixed batches, features, dtypes and paths against the
reference; random metadata corruptions give a clean error with validate=True and stay inside
the cache without it."""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pagedattn import paged_attention, plan_attention  # noqa: E402
from pagedattn.reference import paged_attention_ref  # noqa: E402
from pagedattn.testing import assert_matches_reference, make_paged_batch  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402
from tests.test_safety import guarded, guards_intact  # noqa: E402

FUZZ = settings(max_examples=50, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def batches(draw):
    num_seqs = draw(st.integers(1, 4))
    causal = draw(st.booleans())
    cases = []
    for _ in range(num_seqs):
        kv = draw(st.integers(1, 90))
        q = draw(st.integers(0, min(kv, 9) if causal else 9))
        cases.append((q, kv))
    group = draw(st.sampled_from([1, 2, 3]))
    return dict(
        cases=cases,
        causal=causal,
        num_kv_heads=draw(st.sampled_from([1, 2])),
        group=group,
        head_size=draw(st.sampled_from([16, 24, 32])),
        block_size=draw(st.sampled_from([1, 3, 16, 32])),  # 1: several block-table chunks per program
        dtype=draw(st.sampled_from([torch.float16, torch.float32])),
        window=draw(st.one_of(st.none(), st.integers(1, 40))),
        softcap=draw(st.one_of(st.none(), st.floats(0.5, 20.0))),
        sinks=draw(st.booleans()),
        alibi=draw(st.sampled_from([None, "linear", "sqrt"])),
        path=draw(st.sampled_from(["unified", "split_kv", "persistent", "prefill"])),
        splits=draw(st.integers(1, 9)),
        seed=draw(st.integers(0, 2**16)),
    )


@FUZZ
@given(batches())
def test_fuzz_against_reference(p):
    g = torch.Generator().manual_seed(p["seed"])
    num_q_heads = p["num_kv_heads"] * p["group"]
    batch = make_paged_batch(p["cases"], num_q_heads=num_q_heads, num_kv_heads=p["num_kv_heads"],
                             head_size=p["head_size"], block_size=p["block_size"], dtype=p["dtype"],
                             device=DEVICE, generator=g)
    kwargs = dict(causal=p["causal"], sliding_window=p["window"], softcap=p["softcap"])
    if p["sinks"]:
        kwargs["sinks"] = torch.randn(num_q_heads, generator=g).to(DEVICE)
    if p["alibi"]:
        kwargs["alibi_slopes"] = torch.rand(num_q_heads, generator=g).to(DEVICE)
        kwargs["alibi_sqrt"] = p["alibi"] == "sqrt"
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=num_q_heads,
                          num_kv_heads=p["num_kv_heads"], head_size=p["head_size"], device=DEVICE,
                          path=p["path"], num_splits=p["splits"] if p["path"] == "split_kv" else None)
    out = torch.full_like(batch.q, float("nan"))
    out, lse = paged_attention(*batch.args(), out=out, return_lse=True, plan=plan, validate=True, **kwargs)
    assert_matches_reference(out, lse, *paged_attention_ref(*batch.args(), **kwargs))


@st.composite
def corruptions(draw):
    kind = draw(st.sampled_from(["id-high", "id-negative", "len-past-table", "len-negative", "qsl-past-end"]))
    return kind, draw(st.integers(0, 3)), draw(st.integers(1, 3)), draw(st.sampled_from(["unified", "split_kv"]))


@FUZZ
@given(corruptions(), st.integers(0, 2**16))
def test_fuzz_corruptions(corruption, seed):
    kind, seq, amount, path = corruption
    g = torch.Generator().manual_seed(seed)
    batch = make_paged_batch([(1, 50), (2, 33), (1, 17), (3, 64)], dtype=torch.float32, device=DEVICE, generator=g)
    buffers = guarded(batch)
    num_blocks = batch.k_cache.shape[0]
    if kind == "id-high":
        batch.block_table[seq, 0] = num_blocks + amount - 1
    elif kind == "id-negative":
        batch.block_table[seq, 0] = -amount
    elif kind == "len-past-table":
        batch.seq_lens[seq] = batch.block_table.shape[1] * 16 + amount * 7
    elif kind == "len-negative":
        batch.seq_lens[seq] = -amount
    else:
        batch.query_start_loc[min(seq + 1, 4)] = int(batch.query_start_loc[-1]) + amount
    with pytest.raises(ValueError):
        paged_attention(*batch.args(), validate=True)
    plan = plan_attention([0, 0], [1], num_q_heads=4, num_kv_heads=2, head_size=32, device=DEVICE, path=path,
                          num_splits=3 if path == "split_kv" else None, max_num_tokens=batch.q.shape[0])
    out = torch.full_like(batch.q, float("nan"))
    paged_attention(*batch.args(), out=out, plan=plan, validate=False)  # the kernels mask what validate reports
    if kind not in ("len-negative", "qsl-past-end"):  # those leave rows of the sequence unwritten by design
        assert not torch.isnan(out).any(), "guard data or an unwritten row reached the output"
    assert guards_intact(buffers)
