"""NaN and inf in the inputs propagate the same way on every path and through the merge.

The contract (docs/contract.md): a NaN or inf in a query, or in a key or value that a query sees, makes
that row's output and lse NaN on every path, so no merge of states can hide it; keys a query
cannot see (masked, outside its window, other sequences, padding) never change its result; lse
-inf stays the mark of a row with no visible key (output 0). Outputs start at a finite sentinel
instead of NaN here: an unwritten row then fails both the NaN check and the reference check.
"""

import math

import pytest
import torch

from pagedattn import merge_attention_states, paged_attention, plan_attention, varlen_attention
from pagedattn.mla import _mla_decode
from pagedattn.reference import gather_kv_ref, mla_decode_ref, paged_attention_ref, varlen_attention_ref
from pagedattn.testing import TOLERANCES, make_paged_batch
from tests.conftest import DEVICE

NAN, INF = float("nan"), float("inf")
SENTINEL = 777.0
BLOCK = 16
# (query_len, seq_len): tokens 0 | none | 1, 2, 3 (positions 37-39) | 4; 300 keys are enough for the
# persistent plan to split token 0's keys
CASES = [(1, 300), (0, 20), (3, 40), (1, 33)]
HEADS, KV_HEADS = 4, 2  # q heads 2h and 2h + 1 read KV head h


def _slot(batch, seq, pos):
    return int(batch.block_table[seq, pos // BLOCK]), pos % BLOCK


def poison_visible(batch):
    """NaN / inf in queries and in keys and values that some queries see; returns the rows
    [num_tokens, num_q_heads] that must come out NaN."""
    bad = torch.zeros(batch.q.shape[:2], dtype=torch.bool)
    b, o = _slot(batch, 0, 200)
    batch.k_cache[b, o, 0, 3] = NAN  # seen by token 0, in one of its splits
    bad[0, 0:2] = True
    batch.q[0, 3, 0] = INF
    bad[0, 3] = True
    b, o = _slot(batch, 2, 5)
    batch.k_cache[b, o, 1, 3] = INF  # with V inf: q . k is +inf or -inf by the sign of q[..., 3]
    batch.v_cache[b, o, 1, 6] = INF
    batch.q[1:4, 2, 3] = -batch.q[1:4, 2, 3].abs() - 0.5
    batch.q[1:4, 3, 3] = batch.q[1:4, 3, 3].abs() + 0.5
    bad[1:4, 2:4] = True
    b, o = _slot(batch, 2, 39)
    batch.k_cache[b, o, 0, 1] = NAN  # the last token's own key: tokens 1 and 2 (positions 37, 38) do not see it
    bad[3, 0:2] = True
    b, o = _slot(batch, 3, 0)
    batch.v_cache[b, o, 0, 2] = -INF
    bad[4, 0:2] = True
    batch.q[4, 2, 7] = NAN
    bad[4, 2] = True
    return bad


def poison_key_inf(batch):
    """An inf in a key alone (its value finite): the rows whose q . k is -inf must be NaN as well as
    those where it is +inf (a -inf score from the data is not a masked key)."""
    bad = torch.zeros(batch.q.shape[:2], dtype=torch.bool)
    b, o = _slot(batch, 0, 250)
    batch.k_cache[b, o, 1, 3] = INF
    batch.q[0, 2, 3] = -1.0  # score -inf
    batch.q[0, 3, 3] = 1.0  # score +inf
    bad[0, 2:4] = True
    b, o = _slot(batch, 3, 1)
    batch.k_cache[b, o, 0, 5] = -INF
    batch.q[4, 0, 5] = 1.0  # score -inf
    batch.q[4, 1, 5] = -1.0
    bad[4, 0:2] = True
    return bad


def _used_blocks(batch):
    used = set()
    for s, (_, kv_len) in enumerate(batch.cases):
        used.update(int(x) for x in batch.block_table[s, : -(-kv_len // BLOCK)])
    return used


def poison_invisible(batch):
    """NaN in keys and values no query may read: the queryless sequence 1, the padding slots past
    the end of sequences 0 and 2, and every block that no sequence uses."""
    for seq in (1,):
        for pos in range(batch.cases[seq][1]):
            b, o = _slot(batch, seq, pos)
            batch.k_cache[b, o] = NAN
            batch.v_cache[b, o] = NAN
    for seq in (0, 2):
        b, o = _slot(batch, seq, batch.cases[seq][1] - 1)
        batch.k_cache[b, o + 1:] = NAN
        batch.v_cache[b, o + 1:] = NAN
    spare = [i for i in range(batch.k_cache.shape[0]) if i not in _used_blocks(batch)]
    batch.k_cache[spare] = NAN
    batch.v_cache[spare] = NAN
    return torch.zeros(batch.q.shape[:2], dtype=torch.bool)


WINDOW = 8


def poison_outside_window(batch):
    """NaN in keys and values that lie before every query's window (sliding_window=WINDOW)."""
    for seq, pos in ((0, 10), (0, 291), (2, 3), (2, 29), (3, 24)):
        b, o = _slot(batch, seq, pos)
        batch.k_cache[b, o] = NAN
        batch.v_cache[b, o] = NAN
    return torch.zeros(batch.q.shape[:2], dtype=torch.bool)


# docs/contract.md, "NaN and inf": the one known exception, kept visible as a strict xfail
HIDDEN_VALUE = pytest.mark.xfail(strict=True, reason="a non-finite value hidden from a row of the same tile reaches it "
                                 "through 0 x NaN (the fix measured 1.2-2.1x the decode time)")


def poison_value_hidden_in_tile(batch):
    """NaN and inf in the values of keys that the causal rule hides from earlier queries of the
    same sequence, inside the key tile those queries read too: only the rows that see them NaN."""
    bad = torch.zeros(batch.q.shape[:2], dtype=torch.bool)
    b, o = _slot(batch, 2, 39)
    batch.v_cache[b, o, 0, 4] = NAN  # position 39: seen by token 3 only
    bad[3, 0:2] = True
    b, o = _slot(batch, 2, 38)
    batch.v_cache[b, o, 1, 2] = INF  # position 38: seen by tokens 2 and 3, not token 1 (position 37)
    bad[2:4, 2:4] = True
    return bad


SCENARIOS = {
    "visible": (poison_visible, {}),
    "value-hidden-in-tile": (poison_value_hidden_in_tile, {}),
    "key-inf": (poison_key_inf, {}),
    "invisible": (poison_invisible, {}),
    "outside-window": (poison_outside_window, {"sliding_window": WINDOW}),
}


def make_batch(dtype, seed):
    return make_paged_batch(CASES, num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_size=32, block_size=BLOCK,
                            dtype=dtype, device=DEVICE, generator=torch.Generator().manual_seed(seed))


def assert_nan_rows(out, lse, ref_out, ref_lse, bad, tolerance_dtype):
    """Exactly the rows in ``bad`` are NaN (every element and the lse); the others match the
    reference (lse -inf where the reference has it)."""
    bad = bad.to(out.device)
    nan_out = torch.isnan(out.float())
    assert torch.equal(torch.isnan(lse), bad), f"NaN lse at {torch.isnan(lse).nonzero().tolist()}"
    assert torch.equal(nan_out.all(-1), bad) and torch.equal(nan_out.any(-1), bad), (
        f"NaN output at {nan_out.any(-1).nonzero().tolist()}, expected {bad.nonzero().tolist()}"
    )
    atol, rtol = TOLERANCES[tolerance_dtype]
    good = ~bad
    torch.testing.assert_close(out[good].double(), ref_out.to(out.device)[good], atol=atol, rtol=rtol)
    torch.testing.assert_close(lse[good].double(), ref_lse.to(out.device)[good], atol=atol, rtol=rtol)


def run_paged(batch, path, **kwargs):
    plan = None
    if path is not None:
        plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=HEADS, num_kv_heads=KV_HEADS,
                              head_size=batch.q.shape[2], device=DEVICE, path=path,
                              num_splits=3 if path == "split_kv" else None,
                              num_programs=64 if path == "persistent" else None, dtype=batch.q.dtype,
                              max_num_tokens=batch.q.shape[0])
        if path == "persistent":
            assert int(plan.work_counts[1]) > 0, "no split items: the persistent reduction is not exercised"
    out = torch.full_like(batch.q, SENTINEL)
    lse = torch.full(batch.q.shape[:2], SENTINEL, dtype=torch.float32, device=DEVICE)
    return paged_attention(*batch.args(), out=out, lse_out=lse, return_lse=True, plan=plan, **kwargs)


# The large-tile prefill kernel (paged_attention path "prefill", varlen_attention) and the MLA
# kernel form their scores outside scores_log2: until they pass their raw dot products through
# nonfinite_to_nan, an inf key whose score is -inf is dropped there like a masked key.

PATHS = [
    pytest.param("unified", id="unified"),
    pytest.param("split_kv", id="split_kv"),
    pytest.param("persistent", id="persistent"),
    pytest.param("prefill", id="prefill"),
    pytest.param(None, id="no-plan"),
]


def check_scenario(batch, scenario, run):
    poison, kwargs = SCENARIOS[scenario]
    ref_out, ref_lse = paged_attention_ref(*batch.args(), **kwargs)  # before the poison
    bad = poison(batch)
    out, lse = run(batch, kwargs)
    assert_nan_rows(out, lse, ref_out, ref_lse, bad, out.dtype)
    # the reference keeps the contract too
    assert_nan_rows(*paged_attention_ref(*batch.args(), **kwargs), ref_out, ref_lse, bad, torch.float32)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_paged_paths(scenario, path, request):
    if scenario == "value-hidden-in-tile":
        request.applymarker(HIDDEN_VALUE)
    batch = make_batch(torch.float32, seed=len(scenario))
    check_scenario(batch, scenario, lambda b, kw: run_paged(b, path, **kw))


@pytest.mark.parametrize("path", PATHS)
def test_paged_paths_fp16(path):
    batch = make_batch(torch.float16, seed=3)
    check_scenario(batch, "visible", lambda b, kw: run_paged(b, path, **kw))


def run_varlen(batch, kwargs):
    """varlen_attention over each sequence's keys gathered back to back (sequence 1's between 0's and 2's)."""
    ks, vs = [], []
    for s, (_, kv_len) in enumerate(batch.cases):
        k, v = gather_kv_ref(batch.k_cache, batch.v_cache, batch.block_table[s], kv_len, compute_dtype=batch.q.dtype)
        ks.append(k)
        vs.append(v)
    cu_k = torch.tensor([0] + [kv for _, kv in batch.cases], dtype=torch.int32).cumsum(0).to(torch.int32)
    out = torch.full_like(batch.q, SENTINEL)
    lse = torch.full(batch.q.shape[:2], SENTINEL, dtype=torch.float32, device=DEVICE)
    got = varlen_attention(batch.q, torch.cat(ks), torch.cat(vs), batch.query_start_loc, cu_k.to(DEVICE),
                           out=out, lse_out=lse, return_lse=True, **kwargs)
    # the contiguous reference agrees with the paged one
    ref = varlen_attention_ref(batch.q, torch.cat(ks), torch.cat(vs), batch.query_start_loc, cu_k, **kwargs)
    paged = paged_attention_ref(*batch.args(), **kwargs)
    for a, b in zip(ref, paged):
        torch.testing.assert_close(a, b, equal_nan=True)
    return got


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_varlen(scenario, request):
    if scenario == "value-hidden-in-tile":
        request.applymarker(HIDDEN_VALUE)
    batch = make_batch(torch.float32, seed=10 + len(scenario))
    check_scenario(batch, scenario, run_varlen)


# MLA: one latent row [c_kv (32) | k_pe (16)] per key shared by all 4 heads; c_kv is also the value.
MLA_CASES = [(1, 70), (0, 20), (2, 40), (1, 33)]  # tokens 0 | none | 1, 2 (positions 38, 39) | 3
LATENT, ROPE = 32, 16


def make_mla(dtype, seed):
    batch = make_paged_batch(MLA_CASES, num_q_heads=4, num_kv_heads=1, head_size=LATENT + ROPE, block_size=BLOCK,
                             dtype=dtype, device=DEVICE, generator=torch.Generator().manual_seed(seed))
    batch.k_cache = batch.k_cache[:, :, 0].contiguous()  # [num_blocks, block_size, latent + rope]
    return batch


def mla_args(batch):
    return (batch.q[..., :LATENT], batch.q[..., LATENT:], batch.k_cache, batch.block_table, batch.seq_lens,
            batch.query_start_loc)


def poison_mla_visible(batch):
    bad = torch.zeros(batch.q.shape[:2], dtype=torch.bool)
    b, o = _slot(batch, 0, 20)
    batch.k_cache[b, o, 3] = NAN  # in c_kv: a score and a value
    bad[0] = True
    b, o = _slot(batch, 2, 39)
    batch.k_cache[b, o, LATENT + 2] = NAN  # in k_pe of token 2's own key: token 1 does not see it
    bad[2] = True
    batch.q[1, 1, LATENT + 4] = NAN
    bad[1, 1] = True
    b, o = _slot(batch, 3, 2)
    batch.k_cache[b, o, 0] = INF  # in c_kv: +-inf scores and an inf value
    bad[3] = True
    return bad


def poison_mla_rope_inf(batch):
    """inf in k_pe alone (not a value): the -inf score rows are NaN too."""
    bad = torch.zeros(batch.q.shape[:2], dtype=torch.bool)
    b, o = _slot(batch, 0, 5)
    batch.k_cache[b, o, LATENT + 1] = INF
    batch.q[0, :2, LATENT + 1] = -1.0
    batch.q[0, 2:, LATENT + 1] = 1.0
    bad[0] = True
    return bad


def poison_mla_invisible(batch):
    for pos in range(MLA_CASES[1][1]):
        b, o = _slot(batch, 1, pos)
        batch.k_cache[b, o] = NAN
    for seq in (0, 2):
        b, o = _slot(batch, seq, MLA_CASES[seq][1] - 1)
        batch.k_cache[b, o + 1:] = NAN
    spare = [i for i in range(batch.k_cache.shape[0]) if i not in _used_blocks(batch)]
    batch.k_cache[spare] = NAN
    return torch.zeros(batch.q.shape[:2], dtype=torch.bool)


def poison_mla_value_hidden_in_tile(batch):
    """NaN in c_kv (a value) of token 2's own key, which token 1 of the same step does not see."""
    bad = torch.zeros(batch.q.shape[:2], dtype=torch.bool)
    b, o = _slot(batch, 2, 39)
    batch.k_cache[b, o, 7] = NAN
    bad[2] = True
    return bad


MLA_SCENARIOS = {"visible": poison_mla_visible, "rope-inf": poison_mla_rope_inf, "invisible": poison_mla_invisible,
                 "value-hidden-in-tile": poison_mla_value_hidden_in_tile}


@pytest.mark.parametrize("num_splits", [1, 3], ids=["1-split", "3-splits"])
@pytest.mark.parametrize("scenario", list(MLA_SCENARIOS))
def test_mla_decode(scenario, num_splits, request):
    if scenario == "value-hidden-in-tile":
        request.applymarker(HIDDEN_VALUE)
    batch = make_mla(torch.float32, seed=20 + len(scenario))
    scale = 1.0 / math.sqrt(LATENT + ROPE)
    ref_out, ref_lse = mla_decode_ref(*mla_args(batch), scale=scale)
    bad = MLA_SCENARIOS[scenario](batch)
    out = torch.full(batch.q[..., :LATENT].shape, SENTINEL, dtype=batch.q.dtype, device=DEVICE)
    out, lse = _mla_decode(*mla_args(batch), scale=scale, num_splits=num_splits, out=out, return_lse=True)
    assert_nan_rows(out, lse, ref_out, ref_lse, bad, torch.float32)
    assert_nan_rows(*mla_decode_ref(*mla_args(batch), scale=scale), ref_out, ref_lse, bad, torch.float32)


# merge_attention_states: lse pairs per row and what the merge must give
MERGE_ROWS = [
    # (lse_a, lse_b, expected lse: "nan", "-inf" or "value")
    (NAN, 0.5, "nan"), (0.5, NAN, "nan"), (INF, 0.5, "nan"), (0.5, INF, "nan"),
    (NAN, -INF, "nan"), (-INF, NAN, "nan"), (INF, -INF, "nan"), (-INF, INF, "nan"),
    (NAN, NAN, "nan"), (INF, INF, "nan"), (NAN, INF, "nan"),
    (-INF, -INF, "-inf"), (-INF, 1.5, "value"), (2.0, -INF, "value"), (0.25, -1.0, "value"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_merge_nan_and_inf_lse(dtype):
    g = torch.Generator().manual_seed(7)
    n = len(MERGE_ROWS)
    out_a = torch.randn(n, 2, 24, generator=g).to(DEVICE, dtype)
    out_b = torch.randn(n, 2, 24, generator=g).to(DEVICE, dtype)
    lse_a = torch.tensor([[r[0]] * 2 for r in MERGE_ROWS], device=DEVICE)
    lse_b = torch.tensor([[r[1]] * 2 for r in MERGE_ROWS], device=DEVICE)
    out_a[lse_a == -INF] = NAN  # a side with lse -inf is never read
    out_b[lse_b == -INF] = NAN
    out = torch.full_like(out_a, SENTINEL)
    lse_out = torch.full_like(lse_a, SENTINEL)
    got, lse = merge_attention_states(out_a, lse_a, out_b, lse_b, out=out, lse_out=lse_out)
    atol, rtol = TOLERANCES[dtype]
    for i, (la, lb, want) in enumerate(MERGE_ROWS):
        if want == "nan":
            assert torch.isnan(lse[i]).all() and torch.isnan(got[i].float()).all(), (i, la, lb)
        elif want == "-inf":
            assert (lse[i] == -INF).all() and (got[i] == 0).all(), (i, la, lb)
        else:
            assert not torch.isnan(got[i].float()).any(), (i, la, lb)
            sides = [(l, o) for l, o in ((la, out_a[i]), (lb, out_b[i])) if l != -INF]
            w = torch.softmax(torch.tensor([l for l, _ in sides], dtype=torch.float64), 0)
            expect = sum(wj * o.double().cpu() for wj, (_, o) in zip(w, sides))
            torch.testing.assert_close(got[i].double().cpu(), expect, atol=atol, rtol=rtol)
            torch.testing.assert_close(lse[i].double().cpu(),
                                       torch.logsumexp(torch.tensor([la, lb], dtype=torch.float64), 0).expand(2),
                                       atol=atol, rtol=rtol)


def test_merge_chain_keeps_nan():
    """merge(merge(NaN state, B), C) is NaN; merge(merge(empty state, B), C) is merge(B, C)."""
    g = torch.Generator().manual_seed(8)
    shape = (3, 2, 16)
    b_out, c_out = torch.randn(shape, generator=g).to(DEVICE), torch.randn(shape, generator=g).to(DEVICE)
    b_lse, c_lse = torch.randn(shape[:2], generator=g).to(DEVICE), torch.randn(shape[:2], generator=g).to(DEVICE)
    for bad_lse in (NAN, INF):
        a_out = torch.randn(shape, generator=g).to(DEVICE)
        a_lse = torch.full(shape[:2], bad_lse, device=DEVICE)
        out, lse = merge_attention_states(*merge_attention_states(a_out, a_lse, b_out, b_lse), c_out, c_lse)
        assert torch.isnan(out).all() and torch.isnan(lse).all()
        out, lse = merge_attention_states(c_out, c_lse, *merge_attention_states(b_out, b_lse, a_out, a_lse))
        assert torch.isnan(out).all() and torch.isnan(lse).all()
    empty_out = torch.full(shape, NAN, device=DEVICE)
    empty_lse = torch.full(shape[:2], -INF, device=DEVICE)
    out, lse = merge_attention_states(*merge_attention_states(empty_out, empty_lse, b_out, b_lse), c_out, c_lse)
    want_out, want_lse = merge_attention_states(b_out, b_lse, c_out, c_lse)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
