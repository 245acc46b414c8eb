"""Split-KV path and batch invariance against the float64 reference, on the interpreter."""

import zlib

import pytest
import torch

from pagedattn import paged_attention, plan_attention
from pagedattn.plan import PERSISTENT_MAX_REGISTERS, choose_num_splits, persistent_takes_fewer_waves
from pagedattn.reference import paged_attention_ref
from pagedattn.testing import BATCHES, FEATURES, assert_matches_reference, feature_kwargs, make_paged_batch
from tests.conftest import DEVICE

SPEC_DECODE = [(8, 300), (3, 5), (1, 77), (0, 4), (2, 2), (1, 1)]  # speculative: up to 8 tokens


def run_split(batch, kwargs, *, num_splits=None, batch_invariant=False, segment_size=64):
    plan = plan_attention(
        batch.query_start_loc.cpu(), batch.seq_lens.cpu(), num_q_heads=batch.q.shape[1],
        num_kv_heads=batch.k_cache.shape[2], head_size=batch.q.shape[2], device=DEVICE,
        path="split_kv", num_splits=num_splits, batch_invariant=batch_invariant, segment_size=segment_size,
    )
    assert plan.path == "split_kv"
    plan.partial_out.fill_(float("nan"))  # an unwritten partial must not go unnoticed
    plan.partial_lse.fill_(float("nan"))
    out = torch.full_like(batch.q, float("nan"))
    return paged_attention(*batch.args(), out=out, return_lse=True, plan=plan, **kwargs)


def check_against_reference(batch, kwargs, out, lse):
    assert_matches_reference(out, lse, *paged_attention_ref(*batch.args(), **kwargs))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("feature", FEATURES)
def test_split_features(feature, dtype):
    g = torch.Generator().manual_seed(zlib.crc32(feature.encode()))
    cases = SPEC_DECODE + ([(7, 3)] if "noncausal" in feature else [])
    batch = make_paged_batch(cases, dtype=dtype, device=DEVICE, generator=g)
    kwargs = feature_kwargs(feature, batch.q.shape[1], len(cases), device=DEVICE, generator=g)
    out, lse = run_split(batch, kwargs, num_splits=3)
    check_against_reference(batch, kwargs, out, lse)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 17, 40], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("batch_kind", ["decode", "mixed"])
def test_split_counts(num_splits, batch_kind):
    # 17 and 40 splits over at most 463 keys in 64-key tiles: most segments are empty; 40 splits
    # take two blocks of the merge (merge_partials reads 32 partials at a time at head 32).
    g = torch.Generator().manual_seed(num_splits)
    batch = make_paged_batch(BATCHES[batch_kind], dtype=torch.float32, device=DEVICE, generator=g)
    kwargs = {"sinks": torch.randn(4, generator=g).to(DEVICE), "sliding_window": 150}
    out, lse = run_split(batch, kwargs, num_splits=num_splits)
    check_against_reference(batch, kwargs, out, lse)


def test_split_fp8_and_alibi():
    g = torch.Generator().manual_seed(21)
    batch = make_paged_batch(SPEC_DECODE, dtype=torch.float16, cache_dtype=torch.float8_e4m3fn, device=DEVICE, generator=g)
    kwargs = {"k_scale": 0.8, "v_scale": torch.tensor(1.2, device=DEVICE),
              "alibi_slopes": torch.rand(4, generator=g).to(DEVICE), "softcap": 3.0}
    out, lse = run_split(batch, kwargs, num_splits=5)
    check_against_reference(batch, kwargs, out, lse)


def test_batch_invariant_interpreter():
    """The same sequence alone, in a batch of 7 and in a batch of 100: identical bits."""
    g = torch.Generator().manual_seed(33)
    target = [(1, 300)]
    others = [(int(torch.randint(0, 3, (1,), generator=g)), int(torch.randint(5, 70, (1,), generator=g)))
              for _ in range(99)]
    results = []
    for cases in (target, others[:3] + target + others[3:6], others[:50] + target + others[50:]):
        cases = [(min(q, kv), kv) for q, kv in cases]
        batch = make_paged_batch(cases, num_q_heads=4, num_kv_heads=2, dtype=torch.float32, device=DEVICE,
                                 generator=torch.Generator().manual_seed(5))
        idx = cases.index(target[0])
        # Same data for the target sequence in every batch: copy it in from a fixed source.
        src = make_paged_batch(target, num_q_heads=4, num_kv_heads=2, dtype=torch.float32, device=DEVICE,
                               generator=torch.Generator().manual_seed(6))
        pages = src.block_table[0, :19].long()
        dst_pages = batch.block_table[idx, :19].long()
        batch.k_cache[dst_pages] = src.k_cache[pages]
        batch.v_cache[dst_pages] = src.v_cache[pages]
        t0 = int(batch.query_start_loc[idx])
        batch.q[t0:t0 + 1] = src.q
        out, lse = run_split(batch, {"sinks": torch.linspace(-1, 1, 4, device=DEVICE)},
                             batch_invariant=True, segment_size=64)
        results.append((out[t0:t0 + 1].clone(), lse[t0:t0 + 1].clone()))
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


def test_leading_empty_splits():
    """Fixed 64-key segments under a 100-key window: the first ~36 of 40 splits have no key, so
    the merge's first block of partials is all -inf and the keys arrive in its second block."""
    g = torch.Generator().manual_seed(34)
    batch = make_paged_batch([(1, 2500), (2, 700), (1, 30)], dtype=torch.float32, device=DEVICE, generator=g)
    kwargs = {"sliding_window": 100}  # no sink: it would give split 0 a finite lse
    out, lse = run_split(batch, kwargs, batch_invariant=True, segment_size=64)
    check_against_reference(batch, kwargs, out, lse)


def test_auto_rule():
    from pagedattn.plan import num_sms

    sms = num_sms(DEVICE)  # 4 on the interpreter
    decode = plan_attention([0, 1], [5000], num_q_heads=4, num_kv_heads=2, head_size=32, device=DEVICE)
    assert decode.path == "split_kv" and decode.num_splits > 1
    assert decode.partial_out.shape == (1, 4, decode.num_splits, 32)
    wide = plan_attention(list(range(0, 4 * sms + 1)), [1000] * (4 * sms), num_q_heads=4, num_kv_heads=2,
                          head_size=32, device=DEVICE)
    assert wide.path == "unified"  # 2 KV heads x 4 sequences an SM: 8 programs an SM >= one resident wave (3)
    # the same grid of programs of >= LONG_DECODE_TOKENS keys: the persistent kernel on the same
    # 32 items, without the register cap; a window keeps the programs short
    long_wide = plan_attention(list(range(0, 4 * sms + 1)), [5000] * (4 * sms), num_q_heads=4, num_kv_heads=2,
                               head_size=32, device=DEVICE)
    assert long_wide.path == "persistent" and long_wide.max_registers == PERSISTENT_MAX_REGISTERS and long_wide.num_splits == 1
    assert int(long_wide.work_counts[0]) == 4 * sms * 2
    # 3 programs an SM: one wave of 3 per SM, two of 2 per SM: the 2D kernel stays
    seqs = 3 * sms // 2
    one_wave = plan_attention(list(range(0, seqs + 1)), [5000] * seqs, num_q_heads=4, num_kv_heads=2, head_size=32,
                              device=DEVICE)
    assert one_wave.path == "unified"
    windowed = plan_attention(list(range(0, 4 * sms + 1)), [5000] * (4 * sms), num_q_heads=4, num_kv_heads=2,
                              head_size=32, device=DEVICE, sliding_window=1000)
    assert windowed.path == "unified"
    prefill = plan_attention([0, 100], [5000], num_q_heads=4, num_kv_heads=2, head_size=32, device=DEVICE)
    assert prefill.path == "unified"
    short = plan_attention([0, 1], [100], num_q_heads=4, num_kv_heads=2, head_size=32, device=DEVICE)
    assert short.path == "unified"


@pytest.mark.parametrize("batch, seq_len, splits", [
    (1, 256, False), (16, 256, False),  # 256 keys: the merge costs what splitting saves
    (1, 512, True), (4, 512, True), (8, 512, False), (24, 512, False),
    (8, 1024, True), (16, 1024, True), (32, 1024, False),  # 32 x 8 programs: one wave of 3 per SM
    (16, 2048, True),
])
def test_short_contexts_split_only_when_most_sms_idle(batch, seq_len, splits):
    """The split rule on the H200's 132 SMs (8 KV heads: 8 programs a sequence), fitted to a
    sweep of B=1-32 at 256-2048 keys: splitting won where it is taken and lost where it is not."""
    n = choose_num_splits(batch, 8, 1, seq_len, 132)
    assert (n > 1) == splits, n


@pytest.mark.parametrize("batch, seq_len, splits", [
    (8, 32768, 6), (16, 16384, 3), (4, 65536, 12), (16, 32768, 3), (24, 32768, 2),  # one wave, 0.97 full
    (8, 16384, 6),  # 2731-key segments: not long
    (10, 32768, 16), (32, 32768, 16), (48, 16384, 8),  # 0.81 and 0.65 of a wave, or one split: 2048 keys
])
def test_long_segments_kept_in_a_full_wave(batch, seq_len, splits):
    """The long-context split rule against the H200 sweep (132 SMs, 8 KV heads): a one-wave split
    count that fills the wave keeps its long segments; an under-filled wave or a single split
    takes 2048-key segments."""
    assert choose_num_splits(batch, 8, 1, seq_len, 132) == splits


def test_plan_mismatch_raises():
    g = torch.Generator().manual_seed(1)
    batch = make_paged_batch(BATCHES["decode"], dtype=torch.float16, device=DEVICE, generator=g)
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=8, num_kv_heads=2, head_size=32,
                          device=DEVICE)
    with pytest.raises(ValueError, match="plan"):
        paged_attention(*batch.args(), plan=plan)
    small = plan_attention([0, 1], [10], num_q_heads=4, num_kv_heads=2, head_size=32, device=DEVICE)
    with pytest.raises(ValueError, match="plan"):
        paged_attention(*batch.args(), plan=small)
    with pytest.raises(ValueError, match="path"):
        plan_attention([0, 1], [10], num_q_heads=4, num_kv_heads=2, head_size=32, path="bogus")


@pytest.mark.parametrize("programs, persistent", [(256, True), (384, False), (512, True), (768, False), (1024, True)])
def test_persistent_wave_rule_on_the_h200(programs, persistent):
    """The rule against the H200 sweep (132 SMs): where the persistent kernel's waves of 2 per SM
    beat the 2D kernel's of 3 (32/64/128 sequences x 8 KV heads at 2048-8192 keys) and where they
    lost (48 x 16384 keys: 384 programs; 96 x 4096: 768)."""
    assert persistent_takes_fewer_waves(programs, 132) is persistent
