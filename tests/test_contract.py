"""The contract's refusals and promises beyond shape checks: plans that do not fit the call raise
before any launch, autograd is refused, and bf16 on the interpreter computes the right answer."""

import pytest
import torch

import pagedattn.api as api
from pagedattn import merge_attention_states, paged_attention, plan_attention, varlen_attention
from pagedattn.mla import mla_decode
from pagedattn.reference import mla_decode_ref, paged_attention_ref, varlen_attention_ref
from pagedattn.testing import TOLERANCES, assert_matches_reference, make_paged_batch
from tests.conftest import DEVICE

HEADS = dict(num_q_heads=4, num_kv_heads=2, head_size=32)


def _plan(batch, **kw):
    return plan_attention(batch.query_start_loc.tolist(), batch.seq_lens.tolist(), device=DEVICE, **HEADS, **kw)


def _no_launch(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a kernel was launched for a call that must be refused")

    for name in ("_run_unified", "_run_split_kv", "_run_persistent", "_run_prefill"):
        monkeypatch.setitem(api._RUN_PATH, name[5:], boom)


@pytest.mark.parametrize("path", ["persistent", "prefill"])
def test_plan_for_more_tokens_than_the_call_raises(path, monkeypatch):
    big = make_paged_batch([(3, 40), (5, 18), (2, 33)], **HEADS, device=DEVICE)
    small = make_paged_batch([(1, 40), (2, 18), (1, 33)], **HEADS, device=DEVICE)
    plan = _plan(big, path=path)
    _no_launch(monkeypatch)
    with pytest.raises(ValueError, match="tokens"):
        paged_attention(*small.args(), plan=plan)


@pytest.mark.parametrize("path", ["persistent", "prefill"])
def test_plan_with_zero_sequence_call_raises(path, monkeypatch):
    batch = make_paged_batch([(1, 40), (2, 18)], **HEADS, device=DEVICE)
    plan = _plan(batch, path=path)
    q = batch.q[:0]
    empty = (q, batch.k_cache, batch.v_cache, batch.block_table[:0], batch.seq_lens[:0],
             batch.query_start_loc[:1])
    _no_launch(monkeypatch)
    with pytest.raises(ValueError, match="sequences|tokens"):
        paged_attention(*empty, plan=plan)


def test_persistent_plan_updated_smaller_then_bigger_call_is_right():
    """update() to a smaller batch, then a call of that batch: right, and rows past it untouched."""
    big = make_paged_batch([(3, 40), (5, 18), (2, 33)], **HEADS, device=DEVICE)
    plan = _plan(big, path="persistent")
    small = make_paged_batch([(1, 50), (2, 18)], **HEADS, device=DEVICE)
    plan.update(small.query_start_loc.tolist(), small.seq_lens.tolist())
    out = torch.full_like(small.q, float("nan"))
    lse = torch.full(small.q.shape[:2], float("nan"), device=DEVICE)
    paged_attention(*small.args(), plan=plan, out=out, lse_out=lse)
    ref, ref_lse = paged_attention_ref(*small.args())
    assert_matches_reference(out, lse, ref, ref_lse)


ENTRY_POINTS = ["paged", "varlen", "merge", "mla"]


def _call(which, dtype, requires_grad=False):
    """(function call, reference output) for one entry point at small shapes."""
    torch.manual_seed(0)
    if which == "paged":
        b = make_paged_batch([(1, 40), (5, 18), (3, 3)], **HEADS, dtype=dtype, device=DEVICE)
        q = b.q.detach().requires_grad_(requires_grad)
        ref, _ = paged_attention_ref(*b.args())
        return (lambda: paged_attention(q, *b.args()[1:], max_query_len=5, max_seq_len=40)), ref
    if which == "varlen":
        q = torch.randn(12, 4, 32, dtype=dtype, device=DEVICE).requires_grad_(requires_grad)
        k = torch.randn(20, 2, 32, dtype=dtype, device=DEVICE)
        v = torch.randn_like(k)
        cu_q = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
        cu_k = torch.tensor([0, 9, 20], dtype=torch.int32, device=DEVICE)
        ref = varlen_attention_ref(q.detach(), k, v, cu_q, cu_k)
        ref = ref[0] if isinstance(ref, tuple) else ref
        return (lambda: varlen_attention(q, k, v, cu_q, cu_k)), ref
    if which == "merge":
        a = torch.randn(6, 4, 32, dtype=dtype, device=DEVICE).requires_grad_(requires_grad)
        b = torch.randn(6, 4, 32, dtype=dtype, device=DEVICE)
        la, lb = torch.randn(6, 4, device=DEVICE), torch.randn(6, 4, device=DEVICE)
        lse = torch.logaddexp(la, lb)
        ref = (torch.exp(la - lse)[..., None] * a.detach().double() + torch.exp(lb - lse)[..., None] * b.double())
        return (lambda: merge_attention_states(a, la, b, lb)[0]), ref
    num_blocks, block, heads = 8, 16, 4
    kv = torch.randn(num_blocks, block, 64 + 16, dtype=dtype, device=DEVICE)
    bt = torch.randperm(num_blocks, device=DEVICE)[:6].view(2, 3).int()
    sl = torch.tensor([37, 20], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 1, 3], dtype=torch.int32, device=DEVICE)
    qn = torch.randn(3, heads, 64, dtype=dtype, device=DEVICE).requires_grad_(requires_grad)
    qp = torch.randn(3, heads, 16, dtype=dtype, device=DEVICE)
    ref = mla_decode_ref(qn.detach(), qp, kv, bt, sl, qsl, scale=0.1)
    ref = ref[0] if isinstance(ref, tuple) else ref
    return (lambda: mla_decode(qn, qp, kv, bt, sl, qsl, scale=0.1, max_query_len=2)), ref


@pytest.mark.parametrize("which", ENTRY_POINTS)
def test_autograd_is_refused(which):
    call, _ = _call(which, torch.float32, requires_grad=True)
    with pytest.raises(RuntimeError, match="requires grad"):
        call()
    with torch.no_grad():
        call()  # inference under no_grad works


@pytest.mark.parametrize("which", ENTRY_POINTS)
def test_bf16_is_right(which):
    """bf16 inputs give bf16 outputs within bf16's tolerance of the reference (on the
    interpreter, computed in fp32 and rounded once)."""
    call, ref = _call(which, torch.bfloat16)
    out = call()
    out = out[0] if isinstance(out, tuple) else out
    assert out.dtype == torch.bfloat16
    atol, rtol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(out.double(), ref.double(), atol=atol, rtol=rtol)


def test_plan_attention_device_defaults_to_where_kernels_run():
    plan = plan_attention([0, 1, 2], [40, 18], **HEADS, path="split_kv", num_splits=2)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert plan.partial_out.device.type == expected
