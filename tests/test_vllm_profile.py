"""scripts/vllm_profile.py's arithmetic on a chrome trace (the vLLM run itself needs a GPU)."""

import gzip
import json

import pytest

from tests.scripts_support import load_script


@pytest.fixture(scope="module")
def profile():
    return load_script("vllm_profile")


def test_kernel_table_sums_each_kernel_and_the_union_of_their_spans(profile, tmp_path):
    events = [
        {"ph": "X", "cat": "kernel", "name": "persistent_attention_kernel", "ts": 0.0, "dur": 10.0},
        {"ph": "X", "cat": "kernel", "name": "persistent_reduce_kernel", "ts": 4.0, "dur": 8.0},  # overlaps: 2 us past
        {"ph": "X", "cat": "kernel", "name": "persistent_attention_kernel", "ts": 20.0, "dur": 5.0},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 30.0, "dur": 1.5},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 100.0},  # host: not counted
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 3.0},  # not a span
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 1.0, "dur": 4.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 9.0, "dur": 20.0},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 19.0, "dur": 3.0},
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    table = profile.kernel_table(str(path))
    assert table["kernels"] == {"persistent_attention_kernel": [15.0, 2], "persistent_reduce_kernel": [8.0, 1],
                                "Memset": [1.5, 1]}
    assert table["busy_us"] == pytest.approx(12.0 + 5.0 + 1.5)
    assert table["api"] == {"cuLaunchKernelEx": [7.0, 2], "cudaStreamSynchronize": [20.0, 1]}
    # idle: 12 -> 20 after the reduce kernel, 25 -> 30 after the second attention kernel
    assert table["gaps"] == {"persistent_reduce_kernel -> persistent_attention_kernel": [8.0, 1],
                             "persistent_attention_kernel -> Memset": [5.0, 1]}


def test_host_clock_times_the_wrapped_methods_only_while_on(profile, monkeypatch):
    class Builder:
        def build(self, x):
            return x + 1

    module = type("m", (), {"FlashAttentionMetadataBuilder": Builder})
    monkeypatch.setattr(profile.HostClock, "CLASSES", (("fake_backend", ("FlashAttentionMetadataBuilder",)),))
    monkeypatch.setattr(profile.importlib, "import_module", lambda name: module)
    clock = profile.HostClock()
    assert Builder().build(1) == 2 and clock.take(1) == {}  # off: not counted
    clock.on = True
    for _ in range(4):
        assert Builder().build(2) == 3
    rows = clock.take(2)
    assert list(rows) == ["FlashAttentionMetadataBuilder.build"] and rows["FlashAttentionMetadataBuilder.build"][1] == 2
    assert rows["FlashAttentionMetadataBuilder.build"][0] >= 0 and clock.take(1) == {}


def test_host_clock_keeps_the_first_forward_after_a_build_apart(profile, monkeypatch):
    class Builder:
        def build(self):
            return None

    class Impl:
        def forward(self):
            return None

    module = type("m", (), {"PagedAttnMetadataBuilder": Builder, "PagedAttnImpl": Impl})
    monkeypatch.setattr(profile.HostClock, "CLASSES", (("fake_backend", ("PagedAttnMetadataBuilder", "PagedAttnImpl")),))
    monkeypatch.setattr(profile.importlib, "import_module", lambda name: module)
    clock = profile.HostClock()
    clock.on = True
    for _ in range(2):  # two steps of three layers
        Builder().build()
        for _ in range(3):
            Impl().forward()
    rows = clock.take(1)
    assert rows["PagedAttnImpl.forward (first of a step)"][1] == 2 and rows["PagedAttnImpl.forward"][1] == 4
    assert rows["PagedAttnMetadataBuilder.build"][1] == 2


def test_summarize_scales_per_step_and_sums_the_attention_kernels(profile):
    kernels = {"nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT": [640.0, 64], "write_kv_kernel": [128.0, 64],
               "void flash::FlashAttnFwdCombine<cute::tuple<": [64.0, 32],
               "void cublasLt::splitKreduce_kernel<32, 16": [32.0, 64], "triton_red_fused_add_rms_norm_0": [16.0, 64]}
    out = profile.summarize(kernels, 1.0 / 32)
    assert list(out["kernels"])[0].startswith("nvjet")  # longest first
    assert out["kernels"]["write_kv_kernel"] == [4.0, 2.0]
    assert out["attention_us"] == pytest.approx((128.0 + 64.0) / 32)
    assert out["kernel_us"] == pytest.approx(880.0 / 32)


@pytest.mark.parametrize("name, attention", [
    ("persistent_attention_kernel", True), ("prefill_gluon_kernel", True), ("reduce_splits_kernel", True),
    ("kernel_unified_attention_2d", True), ("reduce_segments", True),
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16", True),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<", True),
    ("nvjet_sm90_tst_256x64_64x5_4x1_v_bz_TNT", False), ("void cublasLt::splitKreduce_kernel<32, 16", False),
    ("triton_poi_fused_mul_silu_slice_1", False), ("_gumbel_sample_kernel", False),
])
def test_attention_kernels_of_each_backend_are_named(profile, name, attention):
    assert profile.is_attention(name) is attention


def test_gc_clock_counts_the_collections_inside_the_block(profile):
    import gc

    with profile.GcClock() as clock:
        gc.collect(0)
        gc.collect(2)
    gc.collect()  # outside: not counted
    assert clock.collections == [1, 0, 1] and clock.seconds > 0
