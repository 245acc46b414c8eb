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
    # 3 programs: lengths about equal, so the unsplit items fill the grid; 64: an unequal batch
    # (463 keys beside 1-40), whose short queries are split
    cases = [(33, 129), (17, 140), (8, 130), (2, 135)] if num_programs == 3 else BATCHES["mixed"] + [(8, 300), (2, 2)]
    batch = make_paged_batch(cases, dtype=torch.float32, device=DEVICE, generator=g)
    kwargs = feature_kwargs(feature, 4, len(cases), device=DEVICE, generator=g)
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=4, num_kv_heads=2, head_size=32,
                          device=DEVICE, path="persistent", num_programs=num_programs, schedule=schedule)
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


def test_persistent_update_uploads_only_a_new_list(monkeypatch):
    """Steady decode steps (same batch, longer contexts, same splits) keep the list already on the
    device; a step whose batch or split counts differ uploads its own, and each step is right."""
    g = torch.Generator().manual_seed(3)
    plan = plan_attention([0, 1, 2, 3], [300] * 3, num_q_heads=4, num_kv_heads=2, head_size=32,
                          device=DEVICE, path="persistent", num_programs=4, max_num_tokens=8, max_context_len=2048)
    uploads = []
    real_upload = type(plan)._upload
    monkeypatch.setattr(type(plan), "_upload", lambda self, *a: (uploads.append(a[0].clone()), real_upload(self, *a)))
    # the plan was made for the first batch; unsplit decodes of one batch keep one list
    steps = [([(1, 300)] * 3, False), ([(1, 301)] * 3, False), ([(1, 302)] * 3, False),
             ([(1, 302)] * 2, True),  # fewer sequences
             ([(1, 1500), (1, 40), (1, 40)], True), ([(1, 1501), (1, 40), (1, 40)], None),  # unequal: the long one split
             ([(1, 303)] * 3, True)]
    for cases, uploaded in steps:
        batch = make_paged_batch(cases, dtype=torch.float32, device=DEVICE, generator=g)
        before = len(uploads)
        plan.update(batch.query_start_loc, batch.seq_lens)
        if uploaded is not None:
            assert (len(uploads) > before) == uploaded, cases
        plan.partial_out.fill_(float("nan"))
        check(batch, plan, {})
    assert any(int(items[:, 4].max()) > 1 for items in uploads)  # the unequal batch was cut


def test_decodes_of_unequal_lengths_are_listed_longest_first(monkeypatch):
    """A full grid of unsplit decodes whose lengths differ lists the longest sequences' items
    first (ties in sequence order); a step whose lengths reorder the batch uploads the new order,
    one that keeps it does not; a split list keeps the sequences' order; every step is right."""
    g = torch.Generator().manual_seed(5)
    plan = plan_attention([0, 1, 2, 3, 4], [300] * 4, num_q_heads=4, num_kv_heads=2, head_size=32, device=DEVICE,
                          path="persistent", num_programs=4, max_num_tokens=8, max_context_len=4096)
    uploads = []
    real_upload = type(plan)._upload
    monkeypatch.setattr(type(plan), "_upload", lambda self, *a: (uploads.append(a[0].clone()), real_upload(self, *a)))
    for lens, order, uploaded in (([500, 900, 700, 900], [1, 3, 2, 0], True),
                                  ([501, 901, 701, 901], [1, 3, 2, 0], False),  # same order: the same list
                                  ([950, 400, 600, 520], [0, 2, 3, 1], True),
                                  ([3000, 200, 150, 180], [0, 1, 2, 3], True)):  # unequal: the long one cut
        batch = make_paged_batch([(1, n) for n in lens], dtype=torch.float32, device=DEVICE, generator=g)
        before = len(uploads)
        plan.update(batch.query_start_loc, batch.seq_lens)
        assert (len(uploads) > before) == uploaded, lens
        items = plan.work_items[: int(plan.work_counts[0])].tolist()
        assert list(dict.fromkeys(s for s, *_ in items)) == order, items
        assert len({tuple(i[:4]) for i in items}) == len(items)  # each (sequence, block, head, split) once
        plan.partial_out.fill_(float("nan"))
        check(batch, plan, {})
    assert int(uploads[-1][:, 4].max()) > 1


def test_graph_plan_cuts_uniform_batches_for_its_residency():
    """A graph plan's kernel (the ISA's register limit, not the 168 cap) holds 2 programs per
    SM, not the 2D kernel's 3: a uniform batch's split items fill one wave of those, and the
    result is right."""
    from pagedattn.plan import PERSISTENT_MAX_REGISTERS, PERSISTENT_UNCAPPED_PROGRAMS_PER_SM, num_sms

    g = torch.Generator().manual_seed(4)
    # enough sequences that a wave's share stays under FILL_MAX_SPLITS a sequence: 2 on the
    # interpreter's 4 SMs, 9 on 132
    num_seqs = max(2, -(-num_sms(DEVICE) // 16))
    batch = make_paged_batch([(1, 1500)] * num_seqs, dtype=torch.float32, device=DEVICE, generator=g)
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=4, num_kv_heads=2, head_size=32,
                          device=DEVICE, path="persistent", max_num_tokens=max(8, num_seqs), max_context_len=2048)
    resident = PERSISTENT_UNCAPPED_PROGRAMS_PER_SM * num_sms(DEVICE)
    assert plan.max_registers == PERSISTENT_MAX_REGISTERS and plan.resident_programs == resident < plan.split_programs
    items = int(plan.work_counts[0])
    assert resident // 2 < items <= resident  # split, into at most one wave
    plan.partial_out.fill_(float("nan"))
    check(batch, plan, {})


def test_persistent_fp8_softcap():
    g = torch.Generator().manual_seed(2)
    batch = make_paged_batch(BATCHES["decode"], dtype=torch.float16, cache_dtype=torch.float8_e4m3fn,
                             device=DEVICE, generator=g)
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=4, num_kv_heads=2, head_size=32,
                          device=DEVICE, path="persistent", num_programs=2)
    check(batch, plan, {"k_scale": 0.5, "v_scale": 2.0, "softcap": 2.0})


def _work_list_loop(qsl, lens, *, tiles, num_kv_heads, num_programs, max_splits, sliding_window=None):
    """The work list spelled out as loops (the rule in persistent_work_list's docstring)."""
    from pagedattn.plan import (
        FILL_MAX_SPLITS, LONG_SEGMENT_TOKENS, MANY_WAVES_SEGMENT_TOKENS, MIN_SEGMENT_TOKENS,
        PERSISTENT_UNCAPPED_PROGRAMS_PER_SM, RESIDENT_PROGRAMS_PER_SM, SHORT_SEGMENT_TOKENS, SPLIT_COST_TOKENS,
        SPLIT_KV_MAX_QUERY_LEN, UNEQUAL_RATIO, UNEQUAL_WAVES,
    )

    blocks = []
    for s, (a, b) in enumerate(zip(qsl[:-1], qsl[1:])):
        visible = max(lens[s], 0)
        if sliding_window:
            visible = min(visible, sliding_window + (b - a) - 1)
        blocks += [(s, qb, visible, b - a) for qb in range(-(-(b - a) // tiles.block_q))]
    short = [v for _, _, v, q in blocks if q <= SPLIT_KV_MAX_QUERY_LEN]
    total = sum(short) * num_kv_heads
    unequal = max(short + [0]) > MIN_SEGMENT_TOKENS and max(short + [0]) * len(short) > UNEQUAL_RATIO * sum(short)
    # short contexts: the split rule's bound at the persistent kernel's 2 programs per SM
    # (num_programs is RESIDENT_PROGRAMS_PER_SM per SM)
    short_context = (len(short) * num_kv_heads * PERSISTENT_UNCAPPED_PROGRAMS_PER_SM * RESIDENT_PROGRAMS_PER_SM
                     * SPLIT_COST_TOKENS >= num_programs * (max(short + [0]) - SPLIT_COST_TOKENS))
    full = (len(blocks) * num_kv_heads >= num_programs or short_context) and not unequal
    target, cap = (UNEQUAL_WAVES * num_programs, max_splits) if unequal else (num_programs, FILL_MAX_SPLITS)
    # 64-key segments while the items cut that fine hold one program per SM of the wave
    sms = num_programs // RESIDENT_PROGRAMS_PER_SM
    fine = len(short) * num_kv_heads * -(-max(short + [0]) // SHORT_SEGMENT_TOKENS) <= sms
    segment = SHORT_SEGMENT_TOKENS if fine else MIN_SEGMENT_TOKENS

    def splits(visible):
        n = min(max(visible * target // max(total, 1), 1), cap)
        if -(-visible // n) > LONG_SEGMENT_TOKENS:
            n = -(-visible // MANY_WAVES_SEGMENT_TOKENS)
        return 1 if full else max(1, min(n, -(-visible // segment), max_splits))

    counts = [splits(visible) if q_len <= SPLIT_KV_MAX_QUERY_LEN else 1 for _, _, visible, q_len in blocks]
    rows = []
    for (s, qb, _, _), n in zip(blocks, counts):
        if n > 1:
            first = qsl[s] + qb * tiles.block_q
            rows += [(t, n) for t in range(first, min(first + tiles.block_q, qsl[s + 1]))]
    # every sequence one unsplit Q block (a full grid): the most visible keys first, ties in
    # sequence order
    order = list(range(len(blocks)))
    if full and len(blocks) == len(qsl) - 1 >= 2 and all(1 <= b - a <= tiles.block_q for a, b in zip(qsl[:-1], qsl[1:])):
        order.sort(key=lambda i: blocks[i][2], reverse=True)
    items = []
    for i in order:
        s, qb, _, _ = blocks[i]
        items += [(s, qb, h, k, counts[i]) for h in range(num_kv_heads) for k in range(counts[i])]
    return (torch.tensor(items, dtype=torch.int32).reshape(-1, 5), torch.tensor(rows, dtype=torch.int32).reshape(-1, 2))


def _random_batch(rng, kind):
    """(qsl, lens) of one kind of engine step: "decode" (up to 40 sequences of 1-8 queries,
    contexts up to 40k), "large" (40-300 such sequences), "mixed" (decodes beside extends and
    prefill chunks), "empty" (sequences with no queries, and lengths shorter than the queries or
    negative: the rule clamps them), "long" (contexts of 100k-600k keys: long segments, split
    counts capped by max_splits)."""
    num_seqs = rng.randint(40, 300) if kind == "large" else rng.randint(0, 40 if kind == "decode" else 12)
    if kind in ("decode", "large"):
        q_lens = [1 if rng.random() < 0.7 else rng.randint(1, 8) for _ in range(num_seqs)]
    elif kind == "mixed":
        q_lens = [rng.choice([0, 1, 1, 2, 5, 8, 9, 30, 130, 700]) for _ in range(num_seqs)]
    elif kind == "empty":
        q_lens = [rng.choice([0, 0, 0, 1, 3]) for _ in range(num_seqs)]
    else:
        q_lens = [rng.choice([1, 1, 4, 8, 20]) for _ in range(num_seqs)]
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    longest = {"decode": 40000, "large": 40000, "long": 600000}.get(kind, 3000)
    lens = [q + rng.randint(0 if q else -5, longest) for q in q_lens]
    if kind == "empty":
        lens = [rng.choice([v, rng.randint(-5, 2)]) for v in lens]
    return qsl, lens


def _work_list_kwargs(rng):
    from pagedattn.plan import Tiles

    return dict(tiles=Tiles(rng.choice([16, 64]), rng.choice([1, 2, 4, 16, 64]), 64, 4),
                num_kv_heads=rng.choice([1, 2, 8]), num_programs=rng.choice([3, 64, 396, 528]),
                max_splits=rng.choice([1, 4, 64]), sliding_window=rng.choice([None, 0, 128, 5000]))


@pytest.mark.parametrize("kind", ["decode", "large", "mixed", "empty", "long"])
def test_persistent_work_list_matches_loops(kind):
    """The work list (plain Python, built from per-block templates: it runs every engine step)
    equals the loop form exactly (items, reduce rows, dtypes, shapes) on random batches, and the
    batches reach every way of building it."""
    import random

    from pagedattn.plan import persistent_work_list

    rng = random.Random(kind)
    seen = dict(full=0, split=0, mixed_counts=0, multi_block_split=0, capped=0, longest_first=0)
    for _ in range(200):
        qsl, lens = _random_batch(rng, kind)
        kw = _work_list_kwargs(rng)
        items, rows = persistent_work_list(qsl, lens, **kw)
        want_items, want_rows = _work_list_loop(qsl, lens, **kw)
        assert items.dtype == rows.dtype == torch.int32 and items.is_contiguous() and rows.is_contiguous()
        assert torch.equal(items, want_items) and torch.equal(rows, want_rows), (qsl, lens, kw)
        splits = items[:, 4]
        seen["full"] += bool(len(items)) and int(splits.max()) == 1 and len(items) >= kw["num_programs"]
        seen["split"] += len(rows) > 0
        seen["mixed_counts"] += len(set(splits.tolist())) > 1
        seen["multi_block_split"] += bool(((items[:, 1] > 0) & (splits > 1)).any())
        seen["capped"] += kw["max_splits"] > 1 and bool((splits == kw["max_splits"]).any())
        seen["longest_first"] += bool((items[1:, 0] < items[:-1, 0]).any())  # a sequence listed before a lower one
    if kind == "empty":  # sequences without queries: rarely a full grid of one-block sequences
        seen.pop("longest_first")
    assert all(seen.values()), seen


def test_persistent_work_list_thresholds():
    """Visible lengths at the rule's boundaries (segments of MIN_SEGMENT_TOKENS and
    LONG_SEGMENT_TOKENS keys, the FILL_MAX_SPLITS cap) give the loop form's lists exactly."""
    from pagedattn.plan import FILL_MAX_SPLITS, LONG_SEGMENT_TOKENS, MIN_SEGMENT_TOKENS, Tiles, persistent_work_list

    kw = dict(tiles=Tiles(16, 4, 64, 4), num_kv_heads=8, num_programs=396, max_splits=64)
    edges = [MIN_SEGMENT_TOKENS, 2 * MIN_SEGMENT_TOKENS, LONG_SEGMENT_TOKENS, FILL_MAX_SPLITS * LONG_SEGMENT_TOKENS]
    for visible in [v + d for v in edges for d in (-1, 0, 1)]:
        for qsl, lens in (([0, 1], [visible]), ([0, 1, 3], [visible, visible // 2]), ([0, 4, 5], [visible, 1000])):
            got, want = persistent_work_list(qsl, lens, **kw), _work_list_loop(qsl, lens, **kw)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (qsl, lens)


def test_persistent_work_list_edges():
    """Zero-length batches, tensors in, the full-grid boundary, and results that own their memory."""
    from pagedattn.plan import Tiles, persistent_work_list

    kw = dict(tiles=Tiles(16, 4, 64, 4), num_kv_heads=8, num_programs=396, max_splits=64)
    for qsl, lens in (([], []), ([0], []), ([0, 0, 0], [7, 0])):
        items, rows = persistent_work_list(qsl, lens, **kw)
        assert items.shape == (0, 5) and rows.shape == (0, 2) and items.dtype == rows.dtype == torch.int32
    # 49 decodes x 8 heads = 392 items < 396 programs: split; 50 x 8 = 400: the full grid, one item each
    for num_seqs, full in ((49, False), (50, True)):
        qsl, lens = list(range(num_seqs + 1)), [30000] * num_seqs
        items, rows = persistent_work_list(qsl, lens, **kw)
        assert (len(items) == num_seqs * 8 and len(rows) == 0) == full
        assert torch.equal(items, _work_list_loop(qsl, lens, **kw)[0])
        tensor_items, tensor_rows = persistent_work_list(torch.tensor(qsl), torch.tensor(lens), **kw)
        assert torch.equal(tensor_items, items) and torch.equal(tensor_rows, rows)
        # writing into one result changes neither the next one nor the memoized templates
        items.fill_(-1)
        rows.fill_(-1)
        again = persistent_work_list(qsl, lens, **kw)
        want = _work_list_loop(qsl, lens, **kw)
        assert torch.equal(again[0], want[0]) and torch.equal(again[1], want[1])
    with pytest.raises(ValueError, match="sequence lengths"):
        persistent_work_list([0, 1, 2], [5], **kw)


def test_corrupt_work_list_writes_no_row_past_num_tokens():
    """Whatever the work list says (a sequence, KV head or split out of range, a reduce row past
    the batch or with too many splits), the persistent kernels write no row of out or lse at or
    past num_tokens, and the items left intact still give the reference."""
    from pagedattn.ops.common.bundles import AttentionArgs
    from pagedattn.ops.persistent.launch import launch_persistent
    from tests.ops.test_unified import guard_rows_untouched, guarded_outputs

    g = torch.Generator().manual_seed(41)
    cases = [(1, 600), (3, 40), (1, 60)]  # unequal lengths: the long sequence is split
    batch = make_paged_batch(cases, dtype=torch.float32, device=DEVICE, generator=g)
    num_tokens, num_heads, head_size = batch.q.shape
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=num_heads, num_kv_heads=2,
                          head_size=head_size, device=DEVICE, path="persistent", num_programs=64)
    num_items, num_rows = int(plan.work_counts[0]), int(plan.work_counts[1])
    items, rows = plan.work_items[:num_items], plan.reduce_rows[:num_rows]
    assert num_rows > 0 and bool((items[:, 4] > 1).any())
    last = int((items[:, 0] == 2).nonzero()[0])  # an item of the last sequence (the last token's rows)
    split_item = int((items[:, 4] > 1).nonzero()[-1])
    seq_of_token = torch.repeat_interleave(torch.arange(len(cases)), torch.tensor([q for q, _ in cases]))
    touched = {int(items[i, 0]) for i in (0, last, split_item)}
    touched |= {int(seq_of_token[int(rows[i, 0])]) for i in (0, -1)}
    items[last, 2] = 2  # a KV head past num_kv_heads: its query heads would address the next token's row
    items[split_item, 3] = plan.partial_out.shape[2] + 1  # a split past the partial buffers
    items[0, 0] = len(cases) + 3  # a sequence past the metadata
    rows[0, 0] = num_tokens  # a reduce row past the batch
    rows[-1, 1] = 10**6  # more splits than the buffers hold
    plan.partial_out.fill_(float("nan"))
    a = AttentionArgs(q=batch.q, k_cache=batch.k_cache, v_cache=batch.v_cache, block_table=batch.block_table,
                      seq_lens=batch.seq_lens, query_start_loc=batch.query_start_loc, scale=head_size ** -0.5,
                      causal=True, sliding_window=0, softcap=0.0, alibi_mode=0, alibi_slopes=None, sinks=None,
                      prefix_ranges=None, k_scale=None, v_scale=None)
    out, lse, out_buf, lse_buf = guarded_outputs(batch.q)
    launch_persistent(out, lse, a, plan)
    assert guard_rows_untouched(out_buf, lse_buf, num_tokens)
    # the sequences whose items and reduce rows were left intact are exact
    ref_out, _ = paged_attention_ref(*batch.args())
    assert len(touched) < len(cases)
    for s in set(range(len(cases))) - touched:
        r = slice(int(batch.query_start_loc[s]), int(batch.query_start_loc[s + 1]))
        torch.testing.assert_close(out[r].double(), ref_out[r], atol=2e-4, rtol=2e-4)


def test_long_uniform_decode_plan_runs_one_launch(monkeypatch):
    """A decode batch of long, about equal contexts under path="auto": the persistent kernel on
    one item per sequence and KV head, static striding and no reduce launch, also after update()
    (the plan's partials hold one split, so no batch can need a merge)."""
    from pagedattn.ops.persistent import launch as persistent_launch
    from pagedattn.plan import num_sms

    launched = []
    real = persistent_launch.launch
    monkeypatch.setattr(persistent_launch, "launch",
                        lambda kernel, grid, **kw: launched.append(kernel) or real(kernel, grid, **kw))
    g = torch.Generator().manual_seed(3)
    # 2 KV heads x 2 sequences an SM: 2 waves of the 2D kernel's 3 programs an SM, 4 programs an SM
    # either way, so the persistent kernel's 2 waves of 2 win (8 sequences on the interpreter's 4 SMs)
    num_seqs = 2 * num_sms(DEVICE)
    batch = make_paged_batch([(1, 2100 + 7 * (i % 8)) for i in range(num_seqs)], dtype=torch.float32, device=DEVICE,
                             generator=g)
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=4, num_kv_heads=2, head_size=32,
                          device=DEVICE)
    assert plan.path == "persistent" and plan.schedule == "static" and plan.partial_out.shape[2] == 1
    check(batch, plan, {})
    assert len(launched) == 1
    smaller = make_paged_batch([(1, 2300), (1, 40), (1, 2050)], dtype=torch.float32, device=DEVICE, generator=g)
    plan.update(smaller.query_start_loc, smaller.seq_lens)
    check(smaller, plan, {})
    assert len(launched) == 2


def test_graph_plans_state_the_register_limit_on_nvidia(monkeypatch):
    """Planned for the H200, a graph plan's persistent launch names its register budget (ptxas
    left to pick one may spill: ptxas 13.0 held the kernel at 168 registers), the automatic
    rule's plan for an unequal batch the 168 cap; AMD targets get no NVIDIA option."""
    from pagedattn.ops.common.launching import capturing
    from pagedattn.ops.common.target import props_for, targeting
    from pagedattn.ops.persistent.kernel import persistent_attention_kernel
    from pagedattn.plan import PERSISTENT_MAX_REGISTERS, UNEQUAL_MAX_REGISTERS, plan_for_graphs

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the GPU's tiles and launch options, not the interpreter's
    shape = dict(num_q_heads=32, num_kv_heads=8, head_size=128, device="cpu", dtype=torch.bfloat16)

    def budget(target, lens, graph):
        qsl, seq_lens = torch.arange(len(lens) + 1, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
        pages = -(-max(lens) // 16)
        q = torch.empty(len(lens), 32, 128, dtype=torch.bfloat16)
        cache = torch.empty(len(lens) * pages, 16, 8, 128, dtype=torch.bfloat16)
        table = torch.arange(cache.shape[0], dtype=torch.int32).reshape(len(lens), pages)
        with targeting(props_for(target)):
            if graph:
                plan = plan_for_graphs(128, 1, 16640, **shape)
                plan.update(qsl, seq_lens)
            else:
                plan = plan_attention(qsl, seq_lens, **shape)
            with capturing() as launched:
                paged_attention(q, cache, cache, table, seq_lens, qsl, plan=plan)
        (kwargs,) = [kw for kernel, _, kw in launched if kernel is persistent_attention_kernel]
        return kwargs.get("maxnreg")

    unequal = [16384] * 2 + [512] * 126
    assert budget("sm90", [2049] * 64, graph=True) == PERSISTENT_MAX_REGISTERS
    assert budget("sm90", unequal, graph=True) == PERSISTENT_MAX_REGISTERS
    assert budget("sm90", unequal, graph=False) == UNEQUAL_MAX_REGISTERS
    assert budget("gfx942", [2049] * 64, graph=True) is None
