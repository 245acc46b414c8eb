"""The planner's choices that change what runs: unequal decode lengths cut at fixed positions
(balanced work), checked against the float64 reference."""

import pytest
import torch

from pagedattn import paged_attention, plan_attention
from pagedattn.plan import MIN_SEGMENT_TOKENS, balanced_segment, num_sms
from pagedattn.reference import paged_attention_ref
from pagedattn.testing import assert_matches_reference, make_paged_batch
from tests.conftest import DEVICE

H200 = dict(block_q=4, tile_n=64, num_kv_heads=8, sms=132, sliding_window=None)


def test_long_among_short_is_cut_at_fixed_positions():
    lens = [16384] * 2 + [512] * 126
    segment = balanced_segment([1] * 128, lens, splits=1, **H200)
    assert segment % 64 == 0 and segment >= MIN_SEGMENT_TOKENS
    assert 16384 / segment <= 16  # the long sequences in pieces near the even share
    assert segment < 4 * 512  # and no short sequence cut into many


@pytest.mark.parametrize("lens, splits", [([4096] * 32, 1), ([512] * 128, 1), ([32768], 32)],
                         ids=["uniform", "short", "single"])
def test_uniform_batches_keep_the_uniform_rule(lens, splits):
    """``splits``: what the uniform rule gives these batches on 132 SMs."""
    assert balanced_segment([1] * len(lens), lens, splits=splits, **H200) == 0


@pytest.mark.parametrize("batch", [8, 16, 24])
def test_short_uniform_decodes_are_not_cut(batch):
    """512-key decodes the split rule leaves unsplit (its short-context bound) are not taken for
    an unequal batch: the 2D kernel runs them (H200: 8 x 512 13.6 us, the cut list 14.8)."""
    assert balanced_segment([1] * batch, [512] * batch, splits=1, **H200) == 0
    assert balanced_segment([1] * batch, [512] * (batch - 1) + [4096], splits=1, **H200) > 0


@pytest.mark.parametrize("batch, seq_len, cut", [(1, 512, True), (8, 512, True), (16, 512, False), (24, 512, False),
                                                  (8, 256, False), (16, 256, False), (8, 1024, True)])
def test_persistent_list_leaves_short_contexts_whole(batch, seq_len, cut):
    """The persistent kernel's list (graph plans) at short contexts on 132 SMs: split where the
    cut list won on the H200, one item per sequence and KV head where it lost."""
    from pagedattn.plan import Tiles, persistent_work_list

    items, rows = persistent_work_list(list(range(batch + 1)), [seq_len] * batch, tiles=Tiles(16, 4, 64, 4),
                                       num_kv_heads=8, num_programs=396, max_splits=64)
    assert (len(items) > batch * 8) == cut and (len(rows) > 0) == cut


def test_window_bounds_the_work():
    lens = [16384] * 2 + [512] * 126
    assert balanced_segment([1] * 128, lens, splits=1, **dict(H200, sliding_window=512)) == 0


@pytest.mark.parametrize("path", ["auto", "split_kv"])
def test_balanced_plan_is_right(path):
    """A long context among short decodes, planned: under "auto" a compact work list of the
    persistent kernel (the long one split, the short ones whole), under "split_kv" segments at
    fixed positions; the right result either way. The long context grows with the device's SMs
    (700 keys against the interpreter's 4), so that the batch is unequal for its grid."""
    cases = [(1, 700 * max(1, num_sms(DEVICE) // 4))] + [(1, 20)] * 6 + [(2, 33)]
    b = make_paged_batch(cases, num_q_heads=4, num_kv_heads=2, head_size=32, device=DEVICE)
    plan = plan_attention(b.query_start_loc.tolist(), b.seq_lens.tolist(), num_q_heads=4, num_kv_heads=2,
                          head_size=32, device=DEVICE, path=path)
    if path == "auto":
        items = plan.work_items[: int(plan.work_counts[0])]
        assert plan.path == "persistent" and int(items[items[:, 0] == 0, 4].max()) > 1
        assert int(items[items[:, 0] != 0, 4].max()) == 1
        assert plan.partial_out.shape[2] == int(items[:, 4].max())  # partials for the splits used, no more
        first = items.clone()
        plan.update(b.query_start_loc.tolist(), b.seq_lens.tolist())  # the list the plan made is update()'s
        assert torch.equal(plan.work_items[: int(plan.work_counts[0])], first)
    else:
        assert plan.path == "split_kv" and plan.segment_size > 0 and plan.num_splits > 1
    out = torch.full_like(b.q, float("nan"))
    lse = torch.full(b.q.shape[:2], float("nan"), device=DEVICE)
    paged_attention(*b.args(), plan=plan, out=out, lse_out=lse)
    ref, ref_lse = paged_attention_ref(*b.args())
    assert_matches_reference(out, lse, ref, ref_lse)


@pytest.mark.parametrize("q_len, kv_len", [(130, 200), (5, 40), (1, 33)], ids=["prefill", "short", "decode"])
def test_one_sequence_without_a_plan_is_one_launch_and_right(q_len, kv_len, monkeypatch):
    """A call without a plan whose maxima say prefill, on one sequence: the large-tile kernel
    alone serves it, whatever its real length (the maxima are only bounds)."""
    import pagedattn.api as api
    import pagedattn.plan.planner as planner

    monkeypatch.setattr(planner, "_CALL_PLANS", {})
    unified = []
    real = api.launch_unified
    monkeypatch.setattr(api, "launch_unified", lambda *a, **k: unified.append(1) or real(*a, **k))
    b = make_paged_batch([(q_len, kv_len)], num_q_heads=4, num_kv_heads=2, head_size=32, dtype=torch.float16,
                         device=DEVICE)
    out = paged_attention(*b.args(), max_query_len=256, max_seq_len=512, out=torch.full_like(b.q, float("nan")))
    assert_matches_reference(out, None, paged_attention_ref(*b.args())[0], None)
    assert not unified


def test_prefill_among_decodes_runs_on_the_callers_metadata(monkeypatch):
    """A plan's prefill kernel covers only the sequences holding long queries, from an offset into
    the caller's metadata, not from views of it: a view's address (seq_lens[3:] is 12 bytes in)
    would change the kernel's pointer-alignment specialization, a new compile for many steps."""
    import pagedattn.ops.prefill.launch as prefill_launch

    seen = []
    real = prefill_launch.launch
    monkeypatch.setattr(prefill_launch, "launch", lambda kernel, grid, **kw: seen.append((grid, kw)) or real(
        kernel, grid, **kw))
    cases = [(1, 40), (1, 30), (1, 20), (140, 200), (1, 10)]
    b = make_paged_batch(cases, num_q_heads=4, num_kv_heads=2, head_size=32, dtype=torch.float16, device=DEVICE)
    plan = plan_attention(b.query_start_loc.tolist(), b.seq_lens.tolist(), num_q_heads=4, num_kv_heads=2,
                          head_size=32, device=DEVICE, dtype=torch.float16)
    assert plan.path == "prefill" and plan.prefill_seqs == (3, 4)
    out = paged_attention(*b.args(), plan=plan, out=torch.full_like(b.q, float("nan")))
    assert_matches_reference(out, None, paged_attention_ref(*b.args())[0], None)
    (grid, kw), = seen
    assert grid[1] == 1 and kw["first_seq"] == 3
    assert kw["queries"].query_start_loc.data_ptr() == b.query_start_loc.data_ptr()
    assert kw["queries"].seq_lens.data_ptr() == b.seq_lens.data_ptr()
    assert kw["kv"].block_table.data_ptr() == b.block_table.data_ptr()


def test_head_256_splits_for_the_two_programs_an_sm_holds():
    """Head 256's decode kernels hold 2 programs an SM (205 registers on sm90), head 128's 3: 32
    sequences x 4 KV heads (Gemma's shape) split for one wave of 2 x 132 slots, not 3 x 132."""
    from pagedattn.ops.common.tiles import Tiles
    from pagedattn.plan.rule import choose_path, resident_programs_per_sm

    assert [resident_programs_per_sm(h) for h in (64, 128, 256)] == [3, 3, 2]
    tiles = Tiles(block_m=16, block_q=8, tile_n=32, num_warps=4, num_stages=3, max_registers=None)
    for window in (None, 1024):
        picks = {h: choose_path("auto", None, max_query_len=1, max_seq_len=4096, num_kv_heads=4, tiles=tiles,
                                sms=132, sliding_window=window, num_seqs=32, head_size=h) for h in (128, 256)}
        assert (picks[128].path, picks[128].num_splits) == ("split_kv", 3)  # 384 programs, 396 slots
        assert (picks[256].path, picks[256].num_splits) == ("split_kv", 2)  # 256 programs, 264 slots


def test_plan_for_graphs_sizes_its_splits_and_serves_each_step():
    """The graphs' persistent plan: as many splits as the longest context needs at
    MIN_SEGMENT_TOKENS a segment, fewer when the workspace cap binds; then each step's batch,
    smaller than the capacity, through update(), with the right result."""
    from pagedattn.plan import plan_for_graphs

    shape = dict(num_q_heads=4, num_kv_heads=2, head_size=32, device=DEVICE)
    plan = plan_for_graphs(8, 1, 5 * MIN_SEGMENT_TOKENS, **shape)
    assert plan.path == "persistent" and plan.max_num_tokens == plan.max_num_seqs == 8
    assert plan.partial_out.shape[2] == 5
    per_split = 8 * 4 * 32 * 4  # tokens x query heads x head size x fp32
    assert plan_for_graphs(8, 1, 5 * MIN_SEGMENT_TOKENS, workspace_bytes=2 * per_split, **shape).partial_out.shape[2] == 2
    for cases in ([(1, 600), (1, 3), (1, 77)], [(1, 40)] * 6):
        b = make_paged_batch(cases, num_q_heads=4, num_kv_heads=2, head_size=32, device=DEVICE)
        plan.update(b.query_start_loc.tolist(), b.seq_lens.tolist())
        out = torch.full_like(b.q, float("nan"))
        paged_attention(*b.args(), plan=plan, out=out)
        assert_matches_reference(out, None, *paged_attention_ref(*b.args()))
    with pytest.raises(ValueError, match="capacity"):
        plan.update(list(range(10)), [5] * 9)


@pytest.mark.parametrize("batch, seq_len, want", [(1, 512, 8), (1, 1024, 16), (2, 512, 8), (1, 2048, 16), (4, 1024, 8)])
def test_latency_bound_decodes_take_one_tile_segments(batch, seq_len, want):
    """On 132 SMs with 8 KV heads a decode whose 64-key segments still fit one program per SM
    (batch 1 to 1024 keys, batch 2 at 512) is cut that fine, by the split-KV rule and by the
    persistent work list alike; past one program per SM the 128-key floor holds."""
    from pagedattn.plan import Tiles, choose_num_splits, persistent_work_list

    assert choose_num_splits(batch, 8, 1, seq_len, 132) == want
    items, _ = persistent_work_list(list(range(batch + 1)), [seq_len] * batch, tiles=Tiles(16, 4, 64, 4),
                                    num_kv_heads=8, num_programs=396, max_splits=64)
    assert int(items[:, 4].max()) == want and len(items) == batch * 8 * want
