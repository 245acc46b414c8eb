"""The Gluon MLA decode kernel for sm90 (``pagedattn.ops.mla_gluon``; PAGEDATTN_MLA_GLUON picks or refuses it).

Without a GPU: the kernel compiles for sm90 (no spills, shared memory within the limit) and the
calls it does not serve are told apart. On an sm90 GPU (``pytest -m gpu``): mla_decode with the
Gluon path on against the float64 reference. Run from a plain checkout with
``PYTHONPATH=. pytest -m gpu tests/test_gluon_mla.py``.
"""

import dataclasses

import pytest
import torch

import pagedattn.mla as mla_module
from pagedattn import mla_decode
from pagedattn.ops.mla_gluon.launch import (GLUON_ENV, GLUON_MLA_CONFIG, GLUON_MLA_CONFIGS, gluon_kernel,
                                            gluon_mla_supported, use_gluon_mla)
from pagedattn.reference import mla_decode_ref
from pagedattn.testing import assert_matches_reference, captured, make_mla_batch, runs_under_consan, runs_within

LATENT, ROPE = 512, 64
SCALE = 192 ** -0.5  # DeepSeek-V3: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)

needs_gluon = pytest.mark.skipif(gluon_kernel() is None, reason="triton.experimental.gluon is missing")
needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                reason="the Gluon MLA kernel runs on compute capability 9.x only")


# ---------------------------------------------------------------------------------------------
# CPU: compile for sm90, and which calls the kernel serves


@needs_gluon
@pytest.mark.parametrize(
    "page_size, config, dtype, num_splits",
    [
        pytest.param(16, GLUON_MLA_CONFIGS["1"], torch.bfloat16, 1, id="page16-bf16"),
        pytest.param(64, GLUON_MLA_CONFIGS["1"], torch.bfloat16, 4, id="page64-bf16-split"),
        pytest.param(16, GLUON_MLA_CONFIGS["1"], torch.float16, 4, id="page16-fp16-split"),
        pytest.param(64, GLUON_MLA_CONFIGS["1"], torch.float16, 1, id="page64-fp16"),
        pytest.param(16, GLUON_MLA_CONFIGS["sync"], torch.bfloat16, 1, id="sync-page16-bf16"),
        pytest.param(64, GLUON_MLA_CONFIGS["sync"], torch.bfloat16, 1, id="sync-page64-bf16"),
        pytest.param(64, GLUON_MLA_CONFIGS["sync"], torch.float16, 4, id="sync-page64-fp16-split"),
        pytest.param(16, GLUON_MLA_CONFIGS["n32"], torch.bfloat16, 1, id="n32-page16-bf16"),
        pytest.param(16, GLUON_MLA_CONFIGS["groups"], torch.bfloat16, 1, id="groups-page16-bf16"),
        pytest.param(64, GLUON_MLA_CONFIGS["groups"], torch.bfloat16, 4, id="groups-page64-bf16-split"),
    ],
)
def test_gluon_mla_compiles_for_sm90(page_size, config, dtype, num_splits):
    from pagedattn.compile_matrix import compile_gluon
    from pagedattn.ops.common.target import props_for

    row = compile_gluon("mla_gluon", page_size=page_size, dtype=dtype, config=config, num_splits=num_splits)
    assert row["problems"] == [], row
    assert row["spill_bytes"] == 0 and row["local"] == 0, row
    assert 0 < row["shared"] <= props_for("sm90").max_shared, row
    # the warp-specialized kernel: 4 launched warps (warpgroup 0) and two 4-warp worker partitions
    assert row["num_warps"] == (12 if config.warp_specialized else 8) and row["regs"] <= 255, row
    if config.warp_specialized:
        _check_register_budgets(page_size, dtype, config, num_splits)


def _check_register_budgets(page_size, dtype, config, num_splits):
    """The partitions' setmaxnreg values (the spill check above covers every partition: ptxas
    reports the one kernel): the two workers' and warpgroup 0's, which Triton sets to the rest
    of the register file, fit the 64K registers at 128 threads each."""
    import re

    from pagedattn.compile_matrix import compile_launch, gluon_call
    from pagedattn.ops.common.launching import capturing
    from pagedattn.ops.mla_gluon.kernel_ws import COPY_REGS, PV_REGS

    with capturing() as launched:
        gluon_call("mla_gluon", page_size=page_size, dtype=dtype, config=config, num_splits=num_splits)
    (kernel, _, kwargs), = [launch for launch in launched if type(launch[0]).__name__ == "GluonJITFunction"]
    ptx = compile_launch(kernel, kwargs, "sm90").asm["ptx"]
    regs = {int(r) for r in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)}
    workers = {PV_REGS.value, COPY_REGS.value}
    assert workers <= regs and max(regs) <= 256 and all(r % 8 == 0 for r in regs), regs
    default = max(regs - workers - {256})  # warpgroup 0 inside the partitions (256 before the fork)
    assert default >= 232 and 128 * (default + sum(workers)) <= 65536, regs


def _inputs(dtype=torch.bfloat16, latent=LATENT, rope=ROPE, page_size=16, num_heads=16):
    q = torch.zeros(3, num_heads, latent + rope, dtype=dtype)
    kv_cache = torch.zeros(4, page_size, latent + rope, dtype=dtype)
    return q[..., :latent], q[..., latent:], kv_cache


@needs_gluon
def test_gluon_mla_supported():
    q_nope, q_pe, kv_cache = _inputs()
    assert gluon_mla_supported(q_nope, q_pe, kv_cache, 1) is None
    assert gluon_mla_supported(*_inputs(page_size=64, num_heads=128), 1) is None
    assert gluon_mla_supported(q_nope.contiguous(), q_pe.contiguous(), kv_cache, 1) is None
    assert "max_query_len" in gluon_mla_supported(q_nope, q_pe, kv_cache, 2)
    assert "max_query_len" in gluon_mla_supported(q_nope, q_pe, kv_cache, 0)
    assert "no fp8" in gluon_mla_supported(q_nope, q_pe, kv_cache.to(torch.float8_e4m3fn), 1)
    assert "bfloat16 or float16" in gluon_mla_supported(*_inputs(torch.float32), 1)
    assert "latent 256" in gluon_mla_supported(*_inputs(latent=256), 1)
    assert "rope 32" in gluon_mla_supported(*_inputs(rope=32), 1)
    assert "block_size 24" in gluon_mla_supported(*_inputs(page_size=24), 1)
    wide = torch.zeros(3, 16, 520, dtype=torch.bfloat16)  # a head stride of 520: not a multiple of 16
    assert "aligned" in gluon_mla_supported(wide[..., :LATENT], q_pe, kv_cache, 1)


def test_gluon_mla_not_used_off_gpu(monkeypatch):
    q_nope, q_pe, kv_cache = _inputs(num_heads=128)
    for value in (None, "1", "ws", "sync", "n32", "groups"):
        if value is None:
            monkeypatch.delenv(GLUON_ENV, raising=False)
        else:
            monkeypatch.setenv(GLUON_ENV, value)
        assert use_gluon_mla(q_nope, q_pe, kv_cache, 1) is None  # CPU tensors


def test_gluon_mla_variable_picks_the_config(monkeypatch):
    """PAGEDATTN_MLA_GLUON: 1 (or ws) the default config, the warp-specialized kernel; sync and n32
    the older kernel's kept variants; groups the default kernel with the ring signal ConSan
    follows; 0 off; unset (or anything else) the automatic rule."""
    from pagedattn.ops.mla_gluon.launch import GLUON_OFF, GluonMLAConfig, gluon_mla_requested

    assert GLUON_MLA_CONFIG.warp_specialized and GLUON_MLA_CONFIG.num_warps == 4
    assert not GLUON_MLA_CONFIG.group_signal
    assert not GLUON_MLA_CONFIGS["sync"].warp_specialized and GLUON_MLA_CONFIGS["sync"].num_warps == 8
    assert (GLUON_MLA_CONFIGS["n32"].tile_n, GLUON_MLA_CONFIGS["n32"].warp_specialized) == (32, False)
    groups = GLUON_MLA_CONFIGS["groups"]
    assert groups.group_signal and groups.label == GLUON_MLA_CONFIG.label + "-groups"
    assert dataclasses.replace(groups, group_signal=False) == GLUON_MLA_CONFIG  # that signal alone differs
    with pytest.raises(ValueError, match="group_signal"):
        GluonMLAConfig(warp_specialized=False, group_signal=True)
    monkeypatch.delenv(GLUON_ENV, raising=False)
    assert gluon_mla_requested() is None
    for value, expected in (("1", GLUON_MLA_CONFIG), ("ws", GLUON_MLA_CONFIG), ("sync", GLUON_MLA_CONFIGS["sync"]),
                            ("n32", GLUON_MLA_CONFIGS["n32"]), ("groups", groups), ("0", GLUON_OFF), ("wso", None),
                            ("yes", None)):
        monkeypatch.setenv(GLUON_ENV, value)
        assert gluon_mla_requested() == expected, value


# ---------------------------------------------------------------------------------------------
# GPU: mla_decode through the Gluon kernel against the float64 reference


def make_batch(cases, *, num_heads, block_size, **kwargs):
    return make_mla_batch(cases, num_heads=num_heads, block_size=block_size, latent=LATENT, rope=ROPE, **kwargs)[0]


def mixed_cases(num_seqs, seed):
    """Decode rows of lengths 1, 17, 300 and 4100, all in a batch of 4 or more, shuffled."""
    lens = [4100, 1, 17, 300]
    g = torch.Generator().manual_seed(seed)
    chosen = [lens[i % 4] for i in range(num_seqs)]
    return [(1, chosen[i]) for i in torch.randperm(num_seqs, generator=g).tolist()]


SMOKE = """
import torch
from pagedattn.testing import use_scratch_allocator_when_instrumented
use_scratch_allocator_when_instrumented()
from pagedattn import mla_decode
from pagedattn.testing import make_mla_batch
batch, _, _ = make_mla_batch([(1, 300), (1, 17)], num_heads=128, block_size=64)
mla_decode(**batch, scale=0.07, max_query_len=1, max_seq_len=300, num_splits=2)
torch.cuda.synchronize()
cases = [(1, 5000), (0, 9), (1, 0), (1, 1), (1, 65)]
batch, _, _ = make_mla_batch(cases, num_heads=96, block_size=16, dtype=torch.float16)
mla_decode(**batch, scale=0.07, max_query_len=1, max_seq_len=5000, num_splits=1)
mla_decode(**batch, scale=0.07, max_query_len=1, max_seq_len=5000, num_splits=200)
torch.cuda.synchronize()
"""


@pytest.fixture(scope="module")
def gluon_finishes():
    """The warp-specialized kernel's first calls in a separate process, the default and its
    ``groups`` signal: uneven tile counts, empty splits and sequences without a token. If an
    mbarrier protocol deadlocks, every GPU test of this file fails at once instead of hanging
    the suite."""
    for variant in ("1", "groups"):
        problem = runs_within(SMOKE, timeout=240, env={GLUON_ENV: variant})
        if problem:
            pytest.fail(f"the Gluon MLA kernel's first calls ({variant}) {problem}")


@pytest.fixture
def gluon_calls(monkeypatch, gluon_finishes):
    """PAGEDATTN_MLA_GLUON=1; the Gluon launches are counted (their num_splits listed) and the
    split workspaces poisoned with NaN, so an unwritten partial fails."""
    monkeypatch.setenv(GLUON_ENV, "1")
    calls = []
    launcher = mla_module.launch_mla_decode_gluon
    split_partials = mla_module.split_partials

    def counted(*args, **kwargs):
        calls.append(kwargs["num_splits"])
        return launcher(*args, **kwargs)

    def poisoned(*args, **kwargs):
        return tuple(t.fill_(float("nan")) for t in split_partials(*args, **kwargs))

    monkeypatch.setattr(mla_module, "launch_mla_decode_gluon", counted)
    monkeypatch.setattr(mla_module, "split_partials", poisoned)
    mla_module._TAPES.clear()  # a replayed tape would bypass the launcher
    yield calls
    mla_module._TAPES.clear()


def run_and_compare(batch, calls, *, num_splits=None, max_query_len=1):
    out = torch.full_like(batch["q_nope"], float("nan"))
    max_seq_len = int(batch["seq_lens"].max())
    out, lse = mla_decode(**batch, scale=SCALE, max_query_len=max_query_len, max_seq_len=max_seq_len,
                          num_splits=num_splits, out=out, return_lse=True)
    ref_out, ref_lse = mla_decode_ref(**batch, scale=SCALE)
    assert_matches_reference(out, lse, ref_out, ref_lse)
    assert calls, "the Gluon kernel was not launched"


@pytest.mark.gpu
@needs_gluon
@needs_sm90
@pytest.mark.parametrize("num_splits", [1, None], ids=["splits1", "splits-auto"])
@pytest.mark.parametrize("num_seqs", [1, 7, 33], ids=lambda n: f"B{n}")
@pytest.mark.parametrize("block_size", [16, 64], ids=lambda n: f"page{n}")
@pytest.mark.parametrize("num_heads", [16, 64, 128], ids=lambda n: f"h{n}")
@pytest.mark.parametrize("variant", ["1", "sync", "n32"])
def test_gluon_mla_decode_gpu(gluon_calls, monkeypatch, variant, num_heads, block_size, num_seqs, num_splits):
    monkeypatch.setenv(GLUON_ENV, variant)
    cases = [(1, 4100)] if num_seqs == 1 else mixed_cases(num_seqs, seed=num_seqs)
    batch = make_batch(cases, num_heads=num_heads, block_size=block_size, seed=num_heads + block_size + num_seqs)
    run_and_compare(batch, gluon_calls, num_splits=num_splits)
    if num_splits is None and num_seqs == 1:
        assert gluon_calls[-1] > 1, "the split rule was expected to split one long sequence"


@pytest.mark.gpu
@needs_gluon
@needs_sm90
@pytest.mark.parametrize("num_splits", [1, 5, 200], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("variant", ["1", "sync", "n32", "groups"])
def test_gluon_mla_edge_rows_gpu(gluon_calls, monkeypatch, variant, num_splits):
    """Sequences without a query token, an empty sequence, heads not a multiple of 64, fp16,
    separate q_nope / q_pe tensors; 200 splits leave most segments empty. ``groups`` (the
    default kernel with ConSan's ring signal) runs here uninstrumented."""
    monkeypatch.setenv(GLUON_ENV, variant)
    cases = [(1, 5000), (0, 9), (1, 0), (1, 1), (1, 64), (1, 65), (0, 3), (1, 130)]
    batch = make_batch(cases, num_heads=96, block_size=16, dtype=torch.float16, split_q=False, seed=num_splits)
    run_and_compare(batch, gluon_calls, num_splits=num_splits)


CONSAN_CHECK = """
import torch
from pagedattn.testing import use_scratch_allocator_when_instrumented
use_scratch_allocator_when_instrumented()
import pagedattn.mla as mla_module
from pagedattn import mla_decode
from pagedattn.reference import mla_decode_ref
from pagedattn.testing import assert_matches_reference, make_mla_batch
labels = []
launcher = mla_module.launch_mla_decode_gluon
mla_module.launch_mla_decode_gluon = lambda *a, **k: labels.append(k["config"].label) or launcher(*a, **k)
cases = [(1, 300), (0, 9), (1, 17), (1, 0), (1, 130)]
for block_size, dtype, num_splits in ((16, torch.bfloat16, 1), (64, torch.float16, 3)):
    batch, _, _ = make_mla_batch(cases, num_heads=96, block_size=block_size, dtype=dtype, seed=block_size)
    out, lse = mla_decode(**batch, scale=0.07, max_query_len=1, max_seq_len=300, num_splits=num_splits,
                          return_lse=True)
    assert_matches_reference(out, lse, *mla_decode_ref(**batch, scale=0.07))
torch.cuda.synchronize()
assert len(labels) == 2 and all(label.endswith("-ws-groups") for label in labels), labels
"""


@pytest.mark.gpu
@needs_gluon
@needs_sm90
def test_gluon_mla_ring_protocol_under_consan_gpu(tmp_path):
    """Triton's concurrency sanitizer over the warp-specialized kernel's barriers (pages 16 and
    64, one split and three, uneven tiles, empty splits, a sequence without a token and an
    empty one, heads not a multiple of 64), in a fresh process with its own kernel cache: no
    race between the copy warps' cp.async writes and the MMA warpgroups' wgmma reads of a ring
    slot, nor between a refill and the reads before it, nor on the buffers the MMA warpgroups
    hand over (P, alpha, the row statistics); and the reference's result. The ``groups`` variant:
    ConSan in triton 3.6 follows cp.async completion through commit groups only, not through
    the default's ``cp.async.mbarrier.arrive.noinc``; the two differ in that signal alone."""
    problem = runs_under_consan(CONSAN_CHECK, tmp_path, env={GLUON_ENV: "groups"})
    assert problem is None, f"under ConSan: {problem}"


@pytest.mark.gpu
@needs_gluon
@needs_sm90
def test_gluon_mla_cache_past_int32_offsets_gpu(gluon_calls):
    # [num_blocks, 64, 576] bf16 past 2**31 elements (> 4 GiB); the batch uses the top blocks
    num_blocks = 2**31 // (64 * (LATENT + ROPE)) + 64
    batch = make_batch([(1, 700), (1, 300), (1, 17)], num_heads=128, block_size=64, num_blocks=num_blocks, seed=9)
    assert batch["kv_cache"].numel() > 2**31
    run_and_compare(batch, gluon_calls, num_splits=1)
    run_and_compare(batch, gluon_calls, num_splits=5)


@pytest.mark.gpu
@needs_gluon
@needs_sm90
def test_gluon_mla_path_taken_gpu(gluon_calls, monkeypatch):
    """Unset, the kernel serves 128 heads and leaves 16 to the tl kernel; =1 takes 16 too; =0
    takes none. Longer queries and an fp8 cache stay on the tl kernel whatever is asked."""
    batch = make_batch([(1, 300), (1, 17)], num_heads=128, block_size=16, seed=3)
    few = make_batch([(1, 300), (1, 17)], num_heads=16, block_size=16, seed=4)
    monkeypatch.delenv(GLUON_ENV)
    run_and_compare(batch, gluon_calls, num_splits=1)
    assert gluon_calls == [1]
    mla_decode(**few, scale=SCALE, max_query_len=1, max_seq_len=300)  # tl: 16 heads pad a 64-row CTA
    mla_decode(**batch, scale=SCALE, max_query_len=2, max_seq_len=300)  # tl: more than one token
    fp8 = dict(batch, kv_cache=batch["kv_cache"].to(torch.float8_e4m3fn))
    mla_decode(**fp8, scale=SCALE, max_query_len=1, max_seq_len=300, kv_scale=0.5)  # tl: fp8 cache
    monkeypatch.setenv(GLUON_ENV, "0")
    mla_decode(**batch, scale=SCALE, max_query_len=1, max_seq_len=300)  # tl: turned off
    torch.cuda.synchronize()
    assert gluon_calls == [1]
    monkeypatch.setenv(GLUON_ENV, "1")
    run_and_compare(few, gluon_calls, num_splits=1)
    assert gluon_calls == [1, 1]


@pytest.mark.gpu
@needs_gluon
@needs_sm90
def test_gluon_mla_cuda_graph_gpu(gluon_calls):
    """With max_query_len / max_seq_len given the call replays its tape and can be captured."""
    batch = make_batch([(1, 4000), (1, 300)], num_heads=128, block_size=64, seed=13)
    out = torch.empty_like(batch["q_nope"])
    lse = torch.empty(out.shape[:2], device="cuda")

    def step():
        _, l = mla_decode(**batch, scale=SCALE, max_query_len=1, max_seq_len=4000, out=out, return_lse=True)
        lse.copy_(l)

    graph = captured(step)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert gluon_calls, "the Gluon kernel was not launched"
    ref_out, ref_lse = mla_decode_ref(**batch, scale=SCALE)
    assert_matches_reference(out, lse, ref_out, ref_lse)
