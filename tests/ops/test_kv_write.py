"""write_kv against the reference scatter, on the interpreter."""

import pytest
import torch

from pagedattn import write_kv
from pagedattn.reference import write_kv_ref
from tests.conftest import DEVICE


@pytest.mark.parametrize(
    "dtype, cache_dtype, slot_dtype",
    [
        pytest.param(torch.float16, None, torch.int32, id="fp16"),
        pytest.param(torch.float32, None, torch.int64, id="fp32-int64-slots"),
        pytest.param(torch.float16, torch.float8_e4m3fn, torch.int64, id="fp16-to-fp8"),
        pytest.param(torch.float32, torch.float8_e4m3fn, torch.int32, id="fp32-to-fp8"),
    ],
)
@pytest.mark.parametrize("head_size, block_size", [(32, 16), (80, 32)])
def test_write_kv(dtype, cache_dtype, slot_dtype, head_size, block_size):
    g = torch.Generator().manual_seed(head_size + block_size)
    num_tokens, num_kv_heads, num_blocks = 23, 3, 9
    cache_dtype = cache_dtype or dtype
    key = (torch.randn(num_tokens, num_kv_heads, head_size, generator=g) * 4).to(DEVICE, dtype)
    value = (torch.randn(num_tokens, num_kv_heads, head_size, generator=g) * 4).to(DEVICE, dtype)
    key[0, 0, :3] = torch.tensor([1000.0, -1000.0, 1e-4])  # saturation and subnormals in fp8
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache = torch.randn(shape, generator=g).to(DEVICE, cache_dtype)
    v_cache = torch.randn(shape, generator=g).to(DEVICE, cache_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[3, 11]] = -1  # padding tokens are skipped
    slot_mapping = slots.to(DEVICE, slot_dtype)
    scales = {"k_scale": 0.75, "v_scale": torch.tensor([1.5], device=DEVICE)}
    ref_k, ref_v = write_kv_ref(key, value, k_cache, v_cache, slot_mapping, **scales)
    write_kv(key, value, k_cache, v_cache, slot_mapping, **scales)
    # Bitwise: the kernel must produce exactly the cast torch does (round to nearest even).
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))
