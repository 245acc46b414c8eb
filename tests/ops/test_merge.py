"""merge_attention_states: merging attention over two key halves gives attention over all keys."""

import pytest
import torch

from pagedattn import merge_attention_states
from pagedattn.reference import attention_ref
from pagedattn.testing import TOLERANCES
from tests.conftest import DEVICE


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("head_size", [32, 80])
def test_merge_halves(dtype, head_size):
    g = torch.Generator().manual_seed(head_size)
    q_len, kv_len, heads = 9, 40, 3
    q = torch.randn(q_len, heads, head_size, generator=g, dtype=torch.float64)
    k = torch.randn(kv_len, heads, head_size, generator=g, dtype=torch.float64)
    v = torch.randn(kv_len, heads, head_size, generator=g, dtype=torch.float64)
    pos = torch.full((q_len,), kv_len)
    kw = dict(q_pos=pos, scale=0.3, causal=False)
    full_out, full_lse = attention_ref(q, k, v, **kw)
    a_out, a_lse = attention_ref(q, k[:13], v[:13], **kw)
    # second half: shift q positions so keys 13.. are seen with the same (non-causal) rule
    b_out, b_lse = attention_ref(q, k[13:], v[13:], **kw)
    out = torch.full((q_len, heads, head_size), float("nan"), dtype=dtype, device=DEVICE)
    got, lse = merge_attention_states(
        a_out.to(DEVICE, dtype), a_lse.float().to(DEVICE), b_out.to(DEVICE, dtype), b_lse.float().to(DEVICE), out=out,
    )
    atol, rtol = TOLERANCES[dtype]
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got.double().cpu(), full_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double().cpu(), full_lse, atol=atol, rtol=rtol)


def test_merge_neg_inf_sides():
    g = torch.Generator().manual_seed(0)
    out_a = torch.randn(4, 2, 16, generator=g).to(DEVICE)
    out_b = torch.randn(4, 2, 16, generator=g).to(DEVICE)
    lse_a = torch.randn(4, 2, generator=g).to(DEVICE)
    lse_b = torch.randn(4, 2, generator=g).to(DEVICE)
    inf = float("-inf")
    lse_a[0, :] = inf  # only b
    lse_b[1, :] = inf  # only a
    lse_a[2, :] = inf  # neither
    lse_b[2, :] = inf
    out_a[0] = float("nan")  # a side with lse -inf must not be read into the result
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out[0], out_b[0])
    torch.testing.assert_close(out[1], out_a[1])
    assert (out[2] == 0).all() and torch.isinf(lse[2]).all()
    w = torch.softmax(torch.stack([lse_a[3], lse_b[3]]), 0)
    torch.testing.assert_close(out[3], w[0, :, None] * out_a[3] + w[1, :, None] * out_b[3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[3], torch.logaddexp(lse_a[3], lse_b[3]))


def test_merge_rejects_bad_input():
    x = torch.randn(3, 2, 16)
    l = torch.randn(3, 2)
    with pytest.raises(TypeError, match="lse_a"):
        merge_attention_states(x, l.double(), x, l)
    with pytest.raises(ValueError, match="out_b"):
        merge_attention_states(x, l, x[:2], l)
    with pytest.raises(ValueError, match="lse_b"):
        merge_attention_states(x, l, x, l[:, :1])


def test_merge_in_place_into_a():
    """out=out_a, lse_out=lse_a: the merge overwrites side a, allocating nothing (CUDA graphs)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(6, 2, 16, generator=g, dtype=torch.float64)
    k = torch.randn(30, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(30, 2, 16, generator=g, dtype=torch.float64)
    kw = dict(q_pos=torch.full((6,), 30), scale=0.25, causal=False)
    full_out, full_lse = attention_ref(q, k, v, **kw)
    a_out, a_lse = attention_ref(q, k[:11], v[:11], **kw)
    b_out, b_lse = attention_ref(q, k[11:], v[11:], **kw)
    out_a, lse_a = a_out.to(DEVICE, torch.float32), a_lse.float().to(DEVICE)
    got, lse = merge_attention_states(out_a, lse_a, b_out.to(DEVICE, torch.float32), b_lse.float().to(DEVICE),
                                      out=out_a, lse_out=lse_a)
    assert got.data_ptr() == out_a.data_ptr() and lse.data_ptr() == lse_a.data_ptr()
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(got.double().cpu(), full_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double().cpu(), full_lse, atol=atol, rtol=rtol)
    with pytest.raises(ValueError, match="lse_out"):
        merge_attention_states(out_a, lse_a, out_a, lse_a, lse_out=torch.empty(6, 3, device=DEVICE))
