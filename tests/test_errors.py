"""Bad input raises ValueError / TypeError naming the argument, before any kernel launch."""

import pytest
import torch

import pagedattn.api as api
from pagedattn import paged_attention, write_kv
from pagedattn.testing import make_paged_batch


@pytest.fixture
def batch():
    return make_paged_batch([(1, 20), (3, 9)], num_q_heads=4, num_kv_heads=2, head_size=32)


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Any kernel launch during these tests is itself a failure."""

    def boom(*args, **kwargs):
        raise AssertionError("a kernel was launched for bad input")

    monkeypatch.setattr(api, "launch_unified", boom)
    monkeypatch.setattr(api, "launch_write_kv", boom)


def _args(batch, **changes):
    names = ["q", "k_cache", "v_cache", "block_table", "seq_lens", "query_start_loc"]
    args = dict(zip(names, batch.args()))
    kwargs = {k: changes.pop(k) for k in list(changes) if k not in names}
    args.update(changes)
    return [args[n] for n in names], kwargs


BAD_ATTENTION_INPUTS = [
    pytest.param({"q": lambda b: b.q[0]}, ValueError, "q", id="q-ndim"),
    pytest.param({"q": lambda b: b.q.to(torch.int32)}, TypeError, "q", id="q-dtype"),
    pytest.param({"q": lambda b: torch.randn(3, 32, 4).transpose(1, 2)}, ValueError, "q", id="q-last-dim-strided"),
    pytest.param({"k_cache": lambda b: b.k_cache.float()}, TypeError, "k_cache", id="cache-dtype-mismatch"),
    pytest.param({"v_cache": lambda b: b.v_cache[:, :, :1]}, ValueError, "v_cache", id="v-shape"),
    pytest.param({"k_cache": lambda b: b.k_cache[..., :16], "v_cache": lambda b: b.v_cache[..., :16]}, ValueError, "head_size", id="head-mismatch"),
    pytest.param({"q": lambda b: b.q[:, :3]}, ValueError, "heads", id="heads-not-divisible"),
    pytest.param({"q": lambda b: torch.randn(4, 4, 36).half(), "k_cache": lambda b: torch.randn(8, 16, 2, 36).half(), "v_cache": lambda b: torch.randn(8, 16, 2, 36).half()}, ValueError, "head_size", id="unsupported-head-size"),
    pytest.param({"q": lambda b: torch.randn(4, 4, 512).half(), "k_cache": lambda b: torch.randn(8, 16, 2, 512).half(), "v_cache": lambda b: torch.randn(8, 16, 2, 512).half()}, ValueError, "head_size", id="head-size-too-large"),
    pytest.param({"block_table": lambda b: b.block_table.long()}, TypeError, "block_table", id="block-table-int64"),
    pytest.param({"block_table": lambda b: b.block_table[:1]}, ValueError, "block_table", id="block-table-rows"),
    pytest.param({"seq_lens": lambda b: b.seq_lens.long()}, TypeError, "seq_lens", id="seq-lens-int64"),
    pytest.param({"query_start_loc": lambda b: b.query_start_loc[:2]}, ValueError, "query_start_loc", id="qsl-length"),
    pytest.param({"query_start_loc": lambda b: b.query_start_loc.float()}, TypeError, "query_start_loc", id="qsl-dtype"),
    pytest.param({"out": lambda b: torch.empty(1, 4, 32).half()}, ValueError, "out", id="out-shape"),
    pytest.param({"out": lambda b: torch.empty_like(b.q, dtype=torch.float32)}, TypeError, "out", id="out-dtype"),
    pytest.param({"alibi_slopes": lambda b: torch.ones(3)}, ValueError, "alibi_slopes", id="alibi-shape"),
    pytest.param({"alibi_slopes": lambda b: torch.ones(4, dtype=torch.float64)}, TypeError, "alibi_slopes", id="alibi-dtype"),
    pytest.param({"alibi_sqrt": lambda b: True}, ValueError, "alibi_sqrt", id="alibi-sqrt-alone"),
    pytest.param({"sinks": lambda b: torch.ones(4, dtype=torch.float16)}, TypeError, "sinks", id="sinks-dtype"),
    pytest.param({"prefix_ranges": lambda b: torch.zeros(2, 1, 3, dtype=torch.int32)}, ValueError, "prefix_ranges", id="prefix-shape"),
    pytest.param({"prefix_ranges": lambda b: torch.zeros(2, 1, 2, dtype=torch.int64)}, TypeError, "prefix_ranges", id="prefix-int64"),
    pytest.param({"sliding_window": lambda b: 0}, ValueError, "sliding_window", id="window-zero"),
    pytest.param({"sliding_window": lambda b: 2.5}, TypeError, "sliding_window", id="window-float"),
    pytest.param({"softcap": lambda b: -1.0}, ValueError, "softcap", id="softcap-negative"),
    pytest.param({"max_query_len": lambda b: -1}, ValueError, "max_query_len", id="max-query-len"),
    pytest.param({"k_scale": lambda b: torch.ones(2)}, ValueError, "k_scale", id="k-scale-shape"),
    pytest.param({"q": lambda b: "not a tensor"}, TypeError, "q", id="q-not-tensor"),
]


@pytest.mark.parametrize("changes, exc, word", BAD_ATTENTION_INPUTS)
def test_paged_attention_rejects(batch, changes, exc, word):
    args, kwargs = _args(batch, **{k: f(batch) for k, f in changes.items()})
    with pytest.raises(exc, match=word):
        paged_attention(*args, **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs two devices (cpu and cuda)")
def test_paged_attention_rejects_mixed_devices(batch):
    with pytest.raises(ValueError, match="seq_lens"):
        args, _ = _args(batch, seq_lens=batch.seq_lens.cuda())
        paged_attention(*args)


def test_write_kv_rejects(batch):
    key = torch.randn(3, 2, 32).half()
    slots = torch.arange(3, dtype=torch.int32)
    cases = [
        (dict(key=key.float()), TypeError, "value"),
        (dict(value=key[:2]), ValueError, "value"),
        (dict(slot_mapping=slots.float()), TypeError, "slot_mapping"),
        (dict(slot_mapping=slots[:2]), ValueError, "slot_mapping"),
        (dict(k_cache=batch.k_cache[:, :, :1], v_cache=batch.v_cache[:, :, :1]), ValueError, "k_cache"),
        (dict(k_cache=batch.k_cache.float(), v_cache=batch.v_cache.float()), TypeError, "k_cache"),
    ]
    for change, exc, word in cases:
        args = dict(key=key, value=key.clone(), k_cache=batch.k_cache, v_cache=batch.v_cache, slot_mapping=slots)
        args.update(change)
        with pytest.raises(exc, match=word):
            write_kv(**args)


# --- CPU tensors without Triton's interpreter ---------------------------------------------------


def test_kernels_here_are_interpreted():
    from pagedattn._checks import interpreted
    from pagedattn.ops.mla.kernel import mla_decode_kernel

    assert api._INTERPRETED and interpreted(mla_decode_kernel)  # conftest sets TRITON_INTERPRET=1 first


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only case")
def test_cpu_tensors_without_the_interpreter_raise_before_launch(batch, monkeypatch):
    """Kernels compiled for a GPU would fail inside Triton ("0 active drivers"); every public
    function says instead what to set."""
    import pagedattn.mla as mla
    from pagedattn import merge_attention_states, mla_decode, varlen_attention, write_mla_kv

    monkeypatch.setattr(api, "_INTERPRETED", False)
    monkeypatch.setattr(mla, "_INTERPRETED", False)
    q = batch.q
    lse = torch.zeros(q.shape[:2])
    lens = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    latent = torch.zeros(4, 16, 576)
    calls = {
        "q": lambda: paged_attention(*batch.args()),
        "key": lambda: write_kv(q[:, :2], q[:, :2], batch.k_cache, batch.v_cache,
                                torch.arange(q.shape[0], dtype=torch.int32)),
        "q ": lambda: varlen_attention(q, q, q, lens, lens),
        "out_a": lambda: merge_attention_states(q, lse, q, lse),
        "q_nope": lambda: mla_decode(torch.zeros(1, 16, 512), torch.zeros(1, 16, 64), latent,
                                     torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                     torch.tensor([0, 1], dtype=torch.int32), scale=0.1),
        "c_kv": lambda: write_mla_kv(torch.zeros(1, 512), torch.zeros(1, 64), latent, torch.zeros(1, dtype=torch.int32)),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"^{name.strip()} is on the CPU.*TRITON_INTERPRET=1"):
            call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only case")
def test_cpu_call_in_a_process_without_the_interpreter():
    import os
    import subprocess
    import sys

    code = ("import torch; from pagedattn import write_kv\n"
            "c = torch.zeros(2, 16, 1, 32)\n"
            "try:\n"
            "    write_kv(torch.zeros(1, 1, 32), torch.zeros(1, 1, 32), c, c.clone(), torch.zeros(1, dtype=torch.int32))\n"
            "except RuntimeError as e:\n"
            "    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("key is on the CPU") and "TRITON_INTERPRET=1" in done.stdout
