"""The prefill kernel's per-device tile choice (PAGEDATTN_AUTOTUNE=1): the fastest candidate by
a timer, failures skipped, choices remembered, no tuning while a CUDA graph is captured, and the
planner's table otherwise; end to end on the interpreter against the reference."""

import pytest
import torch
from triton.runtime.errors import OutOfResources

from pagedattn import paged_attention, plan_attention, varlen_attention
from pagedattn.ops.prefill import tuning
from pagedattn.plan import Tiles
from pagedattn.reference import paged_attention_ref, varlen_attention_ref
from pagedattn.testing import assert_matches_reference, make_paged_batch
from tests.conftest import DEVICE

A, B, C = Tiles(32, 32, 32, 1, 1), Tiles(16, 16, 16, 1, 1), Tiles(64, 64, 64, 1, 1)


@pytest.fixture(autouse=True)
def fresh_choices():
    tuning.forget_choices()
    yield
    tuning.forget_choices()


def fake_timer(times):
    """A timer that runs the call and reports ``times[tiles]`` seconds for the tiles it ran."""
    ran = []

    def timer(fn, device):
        fn()
        return times[ran[-1]]
    return timer, ran


def test_fastest_candidate_is_chosen_and_remembered(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_AUTOTUNE", "1")
    timer, ran = fake_timer({A: 3.0, B: 1.0, C: 2.0})
    got = tuning.choose_tiles("k", A, [A, B, C], ran.append, torch.device("cpu"), timer=timer)
    # a warm-up call of each, then the minimum number of rounds (the fake times are long), interleaved
    assert got == B and ran == [A, B, C] * (1 + tuning.TUNE_MIN_ROUNDS)
    # remembered: the next call of the key times nothing
    assert tuning.choose_tiles("k", A, [A, B, C], ran.append, torch.device("cpu"), timer=timer) == B
    assert len(ran) == 3 * (1 + tuning.TUNE_MIN_ROUNDS) and tuning.chosen_tiles() == {"k": B}


def test_interleaved_rounds_see_through_drift(monkeypatch):
    """The clock drifts upward with every call (heat): timed one option after another, the first
    option would look fastest; timed in interleaved rounds, the truly fastest (B) wins."""
    monkeypatch.setenv("PAGEDATTN_AUTOTUNE", "1")
    cost = {A: 1.00, B: 0.97, C: 1.02}
    calls = []

    def drifting_timer(fn, device):
        fn()
        calls.append(None)
        return cost[ran[-1]] + 0.02 * len(calls)
    ran = []
    assert tuning.choose_tiles("k", A, [A, B, C], ran.append, torch.device("cpu"), timer=drifting_timer) == B


def test_short_calls_get_more_rounds(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_AUTOTUNE", "1")
    timer, ran = fake_timer({A: 1e-5, B: 2e-5})
    tuning.choose_tiles("k", A, [A, B], ran.append, torch.device("cpu"), timer=timer)
    assert len(ran) == 2 * (1 + tuning.TUNE_MAX_ROUNDS)  # 25 rounds of 10 us stay under 20 ms


def test_candidates_that_do_not_fit_are_skipped_and_other_errors_raise(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_AUTOTUNE", "1")

    def run(tiles):
        if tiles != C:
            raise OutOfResources(240000, 232448, "shared memory")
    assert tuning.choose_tiles("k", A, [A, B, C], run, torch.device("cpu"), timer=lambda fn, d: fn() or 1.0) == C

    def broken(tiles):
        raise ValueError("a bug, not a misfit")
    with pytest.raises(ValueError, match="a bug"):
        tuning.choose_tiles("k2", A, [A, B], broken, torch.device("cpu"), timer=lambda fn, d: fn() or 1.0)


def test_off_or_capturing_keeps_the_fallback(monkeypatch):
    timer, ran = fake_timer({A: 3.0, B: 1.0})
    monkeypatch.setenv("PAGEDATTN_AUTOTUNE", "0")
    assert tuning.choose_tiles("k", A, [A, B], ran.append, torch.device("cpu"), timer=timer) == A
    monkeypatch.setenv("PAGEDATTN_AUTOTUNE", "1")
    monkeypatch.setattr(tuning, "capturing", lambda device: True)
    assert tuning.choose_tiles("k", A, [A, B], ran.append, torch.device("cpu"), timer=timer) == A
    assert ran == [] and tuning.chosen_tiles() == {}


def test_query_bucket():
    assert [tuning.query_bucket(n) for n in (1, 128, 129, 5000, 10**6)] == [128, 128, 256, 8192, 16384]


def test_varlen_and_paged_prefill_tuned_on_the_interpreter(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_AUTOTUNE", "1")
    # one timed round per candidate: the interpreter's times say nothing, the path is what is tested
    monkeypatch.setattr(tuning, "TUNE_MIN_ROUNDS", 1)
    monkeypatch.setattr(tuning, "TUNE_MAX_ROUNDS", 1)
    g = torch.Generator().manual_seed(3)
    cases = [(70, 70), (17, 40), (45, 45)]
    cu_q = torch.tensor([0] + [q for q, _ in cases]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [k for _, k in cases]).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), 4, 32, generator=g).to(DEVICE, torch.float16)
    k = torch.randn(int(cu_k[-1]), 2, 32, generator=g).to(DEVICE, torch.float16)
    v = torch.randn(int(cu_k[-1]), 2, 32, generator=g).to(DEVICE, torch.float16)
    for _ in range(2):  # the first call tunes, the second uses the choice
        out = torch.full_like(q, float("nan"))
        out, lse = varlen_attention(q, k, v, cu_q.to(DEVICE), cu_k.to(DEVICE), out=out, return_lse=True)
        assert_matches_reference(out, lse, *varlen_attention_ref(q, k, v, cu_q, cu_k))
    assert len(tuning.chosen_tiles()) == 1

    batch = make_paged_batch([(130, 130), (1, 40)], dtype=torch.float16, device=DEVICE, generator=g)
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=4, num_kv_heads=2, head_size=32,
                          device=DEVICE, dtype=torch.float16)
    out = torch.full_like(batch.q, float("nan"))
    out, lse = paged_attention(*batch.args(), out=out, return_lse=True, plan=plan)
    assert_matches_reference(out, lse, *paged_attention_ref(*batch.args()))
    chosen = tuning.chosen_tiles()
    assert len(chosen) == 2  # contiguous and paged are different keys
    assert set(chosen.values()) <= set(tuning.candidates(32, torch.float16, plan.prefill_tiles))
