"""Persistent path on the interpreter: a tiny fixed grid over mixed batches, both schedules,
and re-planning a captured-size plan in place for smaller batches."""

import pytest
import torch

from pagedattn import paged_attention, plan_attention
from pagedattn.reference import paged_attention_ref
from pagedattn.testing import BATCHES, assert_matches_reference, feature_kwargs, make_paged_batch
from tests.conftest import DEVICE


def check(batch, plan, kwargs):
    out = torch.full_like(batch.q, float("nan"))
    out, lse = paged_attention(*batch.args(), out=out, return_lse=True, plan=plan, **kwargs)
    assert_matches_reference(out, lse, *paged_attention_ref(*batch.args(), **kwargs))


@pytest.mark.parametrize("num_programs", [3, 64], ids=["3-programs", "64-programs-split"])
@pytest.mark.parametrize("schedule", ["static", "atomic"])
@pytest.mark.parametrize("feature", ["causal", "sinks", "window_noncausal", "alibi", "prefix"])
def test_persistent_fixed_grid(feature, schedule, num_programs):
    g = torch.Generator().manual_seed(len(feature))
    cases = BATCHES["mixed"] + [(8, 300), (2, 2)]
    batch = make_paged_batch(cases, dtype=torch.float32, device=DEVICE, generator=g)
    kwargs = feature_kwargs(feature, 4, len(cases), device=DEVICE, generator=g)
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=4, num_kv_heads=2, head_size=32,
                          device=DEVICE, path="persistent", num_programs=num_programs, schedule=schedule)
    # 3 programs: the unsplit items already fill the grid; 64: the short queries are split
    assert (int(plan.work_counts[1]) > 0) == (num_programs == 64)
    plan.partial_out.fill_(float("nan"))
    check(batch, plan, kwargs)


def test_persistent_update_in_place():
    """One plan at a maximum shape, re-planned for smaller and different batches (the graph recipe)."""
    g = torch.Generator().manual_seed(1)
    plan = plan_attention([0] + list(range(1, 9)), [500] * 8, num_q_heads=4, num_kv_heads=2, head_size=32,
                          device=DEVICE, path="persistent", num_programs=5, max_num_tokens=24)
    buffers = (plan.work_items.data_ptr(), plan.partial_out.data_ptr(), plan.work_counts.data_ptr())
    schedules = set()  # "auto": static striding for short work lists, the atomic counter for long ones
    for cases in ([(1, 450)], [(1, 10)], [(1, 17), (1, 300), (3, 9)], [(1, 1)] * 8, [(4, 400), (8, 100), (0, 5)]):
        batch = make_paged_batch(cases, dtype=torch.float16, device=DEVICE, generator=g)
        plan.update(batch.query_start_loc, batch.seq_lens)
        assert (plan.work_items.data_ptr(), plan.partial_out.data_ptr(), plan.work_counts.data_ptr()) == buffers
        schedules.add(int(plan.work_counts[2]))
        check(batch, plan, {"sliding_window": 200})
    assert schedules == {0, 1}
    with pytest.raises(ValueError, match="capacity"):
        plan.update([0] + list(range(1, 11)), [5] * 10)


def test_persistent_fp8_softcap():
    g = torch.Generator().manual_seed(2)
    batch = make_paged_batch(BATCHES["decode"], dtype=torch.float16, cache_dtype=torch.float8_e4m3fn,
                             device=DEVICE, generator=g)
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=4, num_kv_heads=2, head_size=32,
                          device=DEVICE, path="persistent", num_programs=2)
    check(batch, plan, {"k_scale": 0.5, "v_scale": 2.0, "softcap": 2.0})
