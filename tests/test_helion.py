"""pagedattn.helion against the float64 reference.

On the CPU the kernels run in Helion's reference mode (eager PyTorch); one group of tests runs
the compiled Triton code that a GPU would run through Triton's interpreter instead. The
``gpu`` tests at the end take bf16 at Llama-3.1-8B shapes. Skipped when Helion is absent.
"""

import json
import os
import subprocess
import sys
import zlib
from dataclasses import dataclass

import pytest
import torch

# through pagedattn.helion: it makes torch 2.11 importable for Helion before importing it
ph = pytest.importorskip("pagedattn.helion")

from pagedattn.backends import AUTO_PRIORITY, BackendConfig, get_backend, select_backend  # noqa: E402
from pagedattn.bench.providers import Prepared, Provider  # noqa: E402
from pagedattn.helion import api as helion_api  # noqa: E402
from pagedattn.reference import paged_attention_ref  # noqa: E402
from pagedattn.testing import (  # noqa: E402
    BATCHES,
    GPU_SHAPES,
    assert_matches_reference,
    feature_kwargs,
    make_paged_batch,
)
from tests.conftest import DEVICE  # noqa: E402

SUPPORTED = ["causal", "noncausal", "window", "window_noncausal", "softcap", "scale"]
UNSUPPORTED = {"alibi": "alibi_slopes", "alibi_sqrt": "alibi_slopes", "sinks": "sinks", "prefix": "prefix_ranges"}
MIXED = BATCHES["mixed"]  # [(1, 463), (5, 18), (0, 7), (33, 129), (1, 1), (17, 40)]
SHAPE_BATCHES = {**BATCHES, "chunks": [(1, 328), (5, 18), (129, 463)]}  # 129 queries: two prefill chunks


def _seed(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32("-".join(map(str, parts)).encode()))


def run(batch, kwargs, *, segment_size=None, plan_kwargs=None):
    """The Helion call with poisoned outputs and workspaces (an unwritten element is NaN)."""
    plan_kwargs = plan_kwargs if plan_kwargs is not None else {
        k: kwargs[k] for k in ("causal", "sliding_window") if k in kwargs}
    plan = ph.plan_attention(batch.query_start_loc.cpu(), batch.seq_lens.cpu(), num_q_heads=batch.q.shape[1],
                             num_kv_heads=batch.k_cache.shape[2], head_size=batch.q.shape[2], device=DEVICE,
                             segment_size=segment_size, **plan_kwargs)
    plan.part_out.fill_(float("nan"))
    plan.part_lse.fill_(float("nan"))
    out = torch.full_like(batch.q, float("nan"))
    lse = torch.full(batch.q.shape[:2], float("nan"), device=batch.q.device)
    res = ph.paged_attention(*batch.args(), out=out, lse_out=lse, plan=plan, **kwargs)
    assert res[0].data_ptr() == out.data_ptr() and res[1].data_ptr() == lse.data_ptr()
    return out, lse, plan


def check(batch, kwargs, **run_kwargs):
    out, lse, plan = run(batch, kwargs, **run_kwargs)
    assert_matches_reference(out, lse, *paged_attention_ref(*batch.args(), **kwargs))
    return plan


# --- reference mode -------------------------------------------------------------------------


@pytest.mark.parametrize("feature", SUPPORTED)
def test_features(feature, dtype=torch.float32):
    g = _seed(feature, dtype)
    cases = MIXED + ([(7, 3)] if "noncausal" in feature else [(7, 3)])  # causal (7, 3): 4 rows see no key
    batch = make_paged_batch(cases, dtype=dtype, device=DEVICE, generator=g)
    plan = check(batch, feature_kwargs(feature, batch.q.shape[1], len(cases), device=DEVICE, generator=g),
                 segment_size=64)
    assert plan.stats["prefill_chunks"] == 2 and plan.stats["decode_tokens"] == len(batch.q) - 50


@pytest.mark.parametrize("batch_kind", list(SHAPE_BATCHES))
def test_batches_bf16(batch_kind):
    g = _seed(batch_kind)
    batch = make_paged_batch(SHAPE_BATCHES[batch_kind], dtype=torch.bfloat16, device=DEVICE, generator=g)
    check(batch, {"sliding_window": 100, "softcap": 20.0})


@pytest.mark.parametrize("segment_size, segment", [(1, 64), (100, 128), (10**6, 10**6)],
                         ids=["seg64", "seg128", "one-segment"])
def test_decode_segments(segment_size, segment):
    g = _seed(segment_size)
    batch = make_paged_batch(BATCHES["decode"] + [(3, 300)], dtype=torch.float32, device=DEVICE, generator=g)
    plan = check(batch, {"sliding_window": 200}, segment_size=segment_size, plan_kwargs={})
    assert plan.segment == segment  # rounded up to 64 keys
    visible = [17, 129, 1, 463, 298, 299, 300]  # keys of each decode token under the plan's causal rule
    assert plan.stats["decode_items"] == sum(-(-v // segment) for v in visible)


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_size, block_size",
    [
        pytest.param(8, 1, 64, 16, id="mqa-group8"),
        pytest.param(6, 2, 40, 4, id="group3-head40-page4"),
        pytest.param(4, 4, 32, 1, id="mha-page1"),
        pytest.param(4, 2, 16, 64, id="page64"),
    ],
)
def test_shapes(num_q_heads, num_kv_heads, head_size, block_size):
    g = _seed(num_q_heads, num_kv_heads, head_size, block_size)
    batch = make_paged_batch([(1, 200), (20, 70), (2, 9)], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                             head_size=head_size, block_size=block_size, dtype=torch.float32, device=DEVICE,
                             generator=g)
    check(batch, {"scale": 0.2})


def test_nan_reaches_the_rows_that_see_it():
    g = _seed("nan")
    batch = make_paged_batch([(1, 40), (20, 40), (1, 40)], dtype=torch.float32, device=DEVICE, generator=g)
    for seq, key in ((0, 3), (1, 25), (2, 20)):  # key 3 of sequence 0 is outside its query's window
        batch.v_cache[int(batch.block_table[seq, key // 16]), key % 16, 0, 5] = float("nan")
    batch.k_cache[int(batch.block_table[0, 1]), 14, 1, 7] = float("inf")  # key 30 of sequence 0, KV head 1
    out, lse, _ = run(batch, {"sliding_window": 30})
    ref_out, ref_lse = paged_attention_ref(*batch.args(), sliding_window=30)
    # Decode rows (0 and 21) and the prefill rows that see key 25 (positions 25..39, rows 6..20) match
    # the reference, NaN included. Rows 1..5 (positions 20..24) read key 25's tile without seeing it:
    # docs/contract.md's one exception (0 x NaN through a masked weight), as on the Triton path.
    rows = [0, *range(6, 21), 21]
    assert torch.isnan(ref_out[21, :2]).all() and torch.isnan(ref_out[0, 2:]).all()  # KV head 0: q heads 0, 1
    assert not torch.isnan(ref_out[0, :2]).any()
    torch.testing.assert_close(out[rows].double(), ref_out[rows], atol=2e-4, rtol=2e-4, equal_nan=True)
    torch.testing.assert_close(lse[rows].double(), ref_lse[rows], atol=2e-4, rtol=2e-4, equal_nan=True)


def test_plan_covers_narrower_calls_only():
    g = _seed("cover")
    batch = make_paged_batch(MIXED, dtype=torch.float32, device=DEVICE, generator=g)
    check(batch, {"sliding_window": 9}, plan_kwargs={})  # a plan without a window serves a windowed call
    check(batch, {}, plan_kwargs={"causal": False})  # and a non-causal plan a causal one
    with pytest.raises(ValueError, match="sliding_window=9.*sees more keys"):
        run(batch, {"sliding_window": 20}, plan_kwargs={"sliding_window": 9})
    with pytest.raises(ValueError, match="causal=True.*sees more keys"):
        run(batch, {"causal": False}, plan_kwargs={})


@pytest.mark.parametrize("feature", list(UNSUPPORTED))
def test_unsupported_features_raise_naming_the_argument(feature):
    batch = make_paged_batch(MIXED, dtype=torch.float32, device=DEVICE, generator=_seed(feature))
    kwargs = feature_kwargs(feature, batch.q.shape[1], len(MIXED), device=DEVICE, generator=_seed(feature))
    with pytest.raises(ValueError, match=f"^{UNSUPPORTED[feature]}: .*not implemented"):
        ph.paged_attention(*batch.args(), **kwargs)


def test_bad_inputs_raise():
    batch = make_paged_batch(MIXED, dtype=torch.float16, cache_dtype=torch.float8_e4m3fn, device=DEVICE,
                             generator=_seed("fp8"))
    with pytest.raises(ValueError, match="^k_cache: an fp8 cache"):
        ph.paged_attention(*batch.args(), k_scale=0.5, v_scale=0.5)
    batch = make_paged_batch(MIXED, block_size=12, dtype=torch.float32, device=DEVICE, generator=_seed("page"))
    with pytest.raises(ValueError, match="block_size .* power of two"):
        ph.paged_attention(*batch.args())
    batch = make_paged_batch(MIXED, dtype=torch.float32, device=DEVICE, generator=_seed("plan"))
    other = ph.plan_attention([0, 1], [5], num_q_heads=4, num_kv_heads=2, head_size=32, device=DEVICE)
    with pytest.raises(ValueError, match="plan was made for"):
        ph.paged_attention(*batch.args(), plan=other)
    with pytest.raises(TypeError, match="plan must be a HelionPlan"):
        ph.paged_attention(*batch.args(), plan=object())
    bad = batch.block_table.clone()
    bad[3, 1] = batch.k_cache.shape[0] + 5
    with pytest.raises(ValueError, match="block_table"):
        ph.paged_attention(batch.q, batch.k_cache, batch.v_cache, bad, batch.seq_lens, batch.query_start_loc,
                           validate=True)
    with pytest.raises(TypeError, match="block_table must have dtype int32"):
        ph.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_table.long(), batch.seq_lens,
                           batch.query_start_loc)


def test_backend_by_name_only():
    assert "helion" not in AUTO_PRIORITY
    backend = get_backend("helion")
    assert backend.supports_feature("window") and not backend.supports_feature("sinks")
    cfg = BackendConfig(DEVICE, torch.float32, 32, 4, 2, features={"causal", "sinks", "fp8"})
    assert backend.validate(cfg) == ["feature 'fp8' is not supported", "feature 'sinks' is not supported"]
    cfg = BackendConfig(DEVICE, torch.float32, 32, 4, 2, features={"noncausal", "window", "softcap", "lse"})
    assert select_backend(cfg, name="helion") is backend
    g = _seed("backend")
    batch = make_paged_batch(MIXED + [(7, 3)], dtype=torch.float32, device=DEVICE, generator=g)
    md = backend.plan(batch.block_table, batch.seq_lens, batch.query_start_loc, cfg)
    kwargs = {"causal": False, "sliding_window": 8, "softcap": 2.0}
    out, lse = backend.forward(batch.q, batch.k_cache, batch.v_cache, md, return_lse=True, **kwargs)
    assert_matches_reference(out, lse, *paged_attention_ref(*batch.args(), **kwargs))


def test_import_pagedattn_does_not_import_helion():
    code = ("import sys, pagedattn, pagedattn.backends as b; b.list_backends(); b.get_backend('helion').validate("
            "b.BackendConfig()); assert 'helion' not in sys.modules and 'pagedattn.helion' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


# --- the compiled kernels, in Triton's interpreter ---------------------------------------


@pytest.fixture
def compiled_kernels(monkeypatch):
    """Run the Triton code Helion generates (what a GPU runs) in Triton's interpreter. The
    interpreter of Triton 3.6 has no libdevice (its functions return None): the three the
    kernels call are pointed at tl.math for the test. bf16 is left out: the interpreter's bf16
    tl.dot is not IEEE bf16."""
    if DEVICE != "cpu" or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the compiled kernels in Triton's interpreter (TRITON_INTERPRET=1 on the CPU)")
    import triton.language as tl
    from triton.language.extra import libdevice

    monkeypatch.setattr(libdevice, "exp2", lambda x, **_: tl.math.exp2(x), raising=False)
    monkeypatch.setattr(libdevice, "log2", lambda x, **_: tl.math.log2(x), raising=False)
    monkeypatch.setattr(libdevice, "tanh", lambda x, **_: 2 * tl.sigmoid(2 * x) - 1, raising=False)
    monkeypatch.setattr(helion_api, "use_reference_mode", lambda device: False)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the rows with no key, selected away after
@pytest.mark.parametrize("kwargs", [
    pytest.param({"sliding_window": 20, "softcap": 3.0}, id="window-softcap"),
    pytest.param({"causal": False, "softcap": 5.0}, id="noncausal-softcap"),  # reuses the compiled kernels
])
def test_compiled_kernels_interpreted(compiled_kernels, kwargs, dtype=torch.float16):
    # Small on purpose: each program's every op is Python in the interpreter.
    g = _seed("compiled", kwargs)
    batch = make_paged_batch([(1, 90), (2, 18), (0, 7), (17, 40), (5, 3)], num_q_heads=2, num_kv_heads=1,
                             dtype=dtype, device=DEVICE, generator=g)
    check(batch, kwargs, segment_size=64)


# --- the benchmark: Helion, the Triton path and the peers -----------------------------------------


@dataclass
class _RefPeer(Provider):
    """A peer computing the reference (plus ``offset``): one that agrees with the Triton path,
    and with an offset one that does not."""

    offset: float = 0.0

    def prepare(self, inputs):
        def run():
            out, _ = paged_attention_ref(*inputs.paged_args(), **inputs.features)
            return out.to(inputs.q.dtype) + self.offset

        return Prepared(run)


@dataclass
class _BrokenPeer(Provider):
    def prepare(self, inputs):
        raise RuntimeError("no kernel for this case")


def _bench(tmp_path, *argv):
    from pagedattn.helion import bench

    path = tmp_path / "helion_bench.json"
    assert bench.main(["--quick", "--cases", "decode", "--json", str(path), "--md", str(tmp_path / "t.md"), *argv]) == 0
    with open(path) as f:
        return json.load(f), (tmp_path / "t.md").read_text()


def test_bench_quick_reports_unavailable_peers(tmp_path):
    from pagedattn.helion.bench import PEERS

    results, table = _bench(tmp_path)
    assert set(results["peers"]) == set(PEERS)
    for name, info in results["peers"].items():
        if DEVICE == "cpu":  # FlashInfer and cuDNN need a GPU: reported, not run
            assert not info["available"] and info["reason"]
        if not info["available"]:
            assert f"- peer {name} left out: {info['reason']}" in table
            assert f"{name} us" not in table
    (rec,) = results["records"]
    assert rec["triton"]["time_us"] > 0 and rec["helion"]["time_us"] > 0 and rec["max_abs_diff"] < 1e-4
    assert "| helion / best peer |" in table.splitlines()[2]

    results, table = _bench(tmp_path, "--no-peers")
    assert results["peers"] == {} and results["records"][0]["peers"] == {} and "left out" not in table


def test_bench_checks_peers_before_timing(tmp_path, monkeypatch):
    from pagedattn.bench.providers import PROVIDERS

    monkeypatch.setitem(PROVIDERS, "ref-peer", _RefPeer("ref-peer"))
    monkeypatch.setitem(PROVIDERS, "off-peer", _RefPeer("off-peer", offset=1.0))
    monkeypatch.setitem(PROVIDERS, "broken-peer", _BrokenPeer("broken-peer"))
    results, table = _bench(tmp_path, "--peers", "ref-peer,off-peer,broken-peer")
    peers = results["records"][0]["peers"]
    assert peers["ref-peer"]["status"] == "ok" and peers["ref-peer"]["max_abs_diff"] < 1e-4
    assert peers["ref-peer"]["time_us"] > 0 and results["records"][0]["best_peer"] == "ref-peer"
    assert peers["off-peer"]["status"] == "fail" and "time_us" not in peers["off-peer"]
    assert abs(peers["off-peer"]["max_abs_diff"] - 1.0) < 1e-4
    assert peers["broken-peer"] == {"status": "error", "reason": "RuntimeError: no kernel for this case"}
    header, _, row = table.splitlines()[2:5]
    assert "| ref-peer us | off-peer us | broken-peer us | helion / best peer |" in header
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[5:7] == ["fail", "error"] and float(cells[4]) > 0 and float(cells[7]) > 0
    with pytest.raises(SystemExit):
        _bench(tmp_path, "--peers", "no-such-peer")


# --- GPU: bf16 at Llama-3.1-8B shapes ------------------------------------------------------------

LLAMA = dict(num_q_heads=32, num_kv_heads=8, head_size=128, block_size=16)
GPU_CASES = {
    "decode-b8-l4096": [(1, 4096)] * 8,
    "prefill-s2048": [(2048, 2048)],
    "extend-4x512-on-4096": [(512, 4096)] * 4,
    "mixed-2048-and-63-decodes": [(2048, 2048)] + [(1, 4096)] * 63,
    "vllm-mix": [(1, 1328), (5, 18), (129, 463), (0, 7), (1, 1), (300, 2000), (8, 4096), (1, 32768)],
}


@pytest.mark.gpu
@pytest.mark.parametrize("feature", ["causal", "window", "softcap", "noncausal"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_bf16(case, feature):
    g = _seed("gpu", case, feature)
    batch = make_paged_batch(GPU_CASES[case], dtype=torch.bfloat16, device="cuda", generator=g, **LLAMA)
    kwargs = {"window": {"sliding_window": 1000}, "softcap": {"softcap": 30.0}, "noncausal": {"causal": False},
              "causal": {}}[feature]
    check(batch, kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_size, block_size",
                         [pytest.param(*shape, id=name) for name, shape in GPU_SHAPES.items()
                          if name != "head192-page128"])  # the GPU suite's shapes, less head 192 on 128-token pages
def test_gpu_shapes(num_q_heads, num_kv_heads, head_size, block_size):
    g = _seed("gpu-shape", num_q_heads, head_size)
    batch = make_paged_batch([(1, 700), (37, 37), (0, 3), (200, 4000)], num_q_heads=num_q_heads,
                             num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size,
                             dtype=torch.bfloat16, device="cuda", generator=g)
    check(batch, {"sliding_window": 333, "softcap": 30.0})


@pytest.mark.gpu
def test_gpu_cache_past_int32_offsets():
    num_blocks = 2**31 // (16 * 8 * 128) + 512  # [num_blocks, 16, 8, 128] bf16: > 2**31 elements
    batch = make_paged_batch([(1, 1500), (64, 2000), (1, 17)], num_blocks=num_blocks, dtype=torch.bfloat16,
                             device="cuda", generator=_seed("int64"), **LLAMA)
    assert batch.k_cache.numel() > 2**31
    check(batch, {})
