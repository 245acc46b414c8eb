"""The Gluon prefill kernel for sm90 (``pagedattn.ops.prefill_gluon``; PAGEDATTN_PREFILL_GLUON picks or refuses it).

Without a GPU: the kernel compiles for sm90 (no spills in either partition, shared memory within
the limit) and the calls it does not serve are told apart. On an sm90 GPU (``pytest -m gpu``):
paged_attention with the Gluon path on against the float64 reference. Run from a plain checkout
with ``PYTHONPATH=. pytest -m gpu tests/test_gluon_prefill.py``.
"""

import dataclasses
import functools

import pytest
import torch
import triton

import pagedattn.api as api_module
from pagedattn import paged_attention, plan_attention
from pagedattn.ops.common.bundles import AttentionArgs
import pagedattn.ops.prefill_gluon.launch as launch_module
from pagedattn.ops.prefill_gluon.launch import (
    GLUON_AUTO_CONFIG_HEAD128,
    GLUON_MIN_QUERY_LEN,
    GLUON_MIN_QUERY_TOKENS,
    GLUON_OFF,
    GLUON_PREFILL_CONFIG,
    GLUON_PREFILL_CONFIGS,
    GLUON_PREFILL_ENV,
    GluonPrefillConfig,
    gluon_kernel,
    gluon_prefill_requested,
    gluon_prefill_supported,
    use_gluon_prefill,
)
from pagedattn.plan import PREFILL_MIN_QUERY_LEN
from pagedattn.reference import paged_attention_ref
from pagedattn.testing import assert_matches_reference, captured, make_paged_batch, runs_under_consan, runs_within

needs_gluon = pytest.mark.skipif(gluon_kernel() is None, reason="triton.experimental.gluon is missing")
needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                reason="the Gluon prefill kernel runs on compute capability 9.x only")

BLOCK_M64 = GluonPrefillConfig(block_m=64)  # one consumer warpgroup
SERIAL = GLUON_PREFILL_CONFIGS["serial"]  # each tile's wgmma and softmax one after the other
PIPELINED = GLUON_PREFILL_CONFIGS["pipelined"]  # the two 64-row halves in one consumer partition
SPLIT = GLUON_PREFILL_CONFIGS["split"]  # the two 64-row halves in two consumer partitions
OVERLAP = GluonPrefillConfig(split_consumers=True, overlap=True)  # and P V beside the next softmax
SMEMQ = GLUON_PREFILL_CONFIGS["smemq"]  # the default with Q read from shared memory by each S = Q K^T
PAIRS = GLUON_PREFILL_CONFIGS["pairs"]  # the default with the mask-free tiles two at a time
PAIRS_SMEMQ = GLUON_PREFILL_CONFIGS["pairs-smemq"]  # and Q read from shared memory


# ---------------------------------------------------------------------------------------------
# CPU: compile for sm90, and which calls the kernel serves


@needs_gluon
@pytest.mark.parametrize(
    "page_size, dtype, return_lse, config, head_size, modifiers",
    [
        pytest.param(16, torch.bfloat16, True, GLUON_PREFILL_CONFIG, 128, False, id="page16-bf16-lse"),
        pytest.param(64, torch.bfloat16, False, GLUON_PREFILL_CONFIG, 128, False, id="page64-bf16"),
        pytest.param(16, torch.float16, False, GLUON_PREFILL_CONFIG, 128, False, id="page16-fp16"),
        pytest.param(64, torch.float16, True, GLUON_PREFILL_CONFIG, 128, False, id="page64-fp16-lse"),
        pytest.param(256, torch.bfloat16, True, GLUON_PREFILL_CONFIG, 128, False, id="page256-bf16-lse"),
        pytest.param(16, torch.bfloat16, True, GLUON_PREFILL_CONFIG, 64, False, id="page16-bf16-lse-head64"),
        pytest.param(64, torch.bfloat16, True, BLOCK_M64, 128, False, id="page64-bf16-lse-m64"),
        pytest.param(16, torch.bfloat16, True, SERIAL, 128, False, id="page16-bf16-lse-serial"),
        pytest.param(16, torch.bfloat16, True, PIPELINED, 128, False, id="page16-bf16-lse-pipelined"),
        pytest.param(64, torch.float16, False, PIPELINED, 64, False, id="page64-fp16-head64-pipelined"),
        pytest.param(16, torch.bfloat16, True, SPLIT, 128, False, id="page16-bf16-lse-split"),
        pytest.param(64, torch.float16, False, SPLIT, 64, False, id="page64-fp16-head64-split"),
        pytest.param(16, torch.bfloat16, True, GLUON_PREFILL_CONFIGS["groups"], 128, True, id="page16-bf16-lse-groups"),
        pytest.param(64, torch.bfloat16, True, GLUON_PREFILL_CONFIGS["lagged"], 128, True, id="page64-bf16-lse-lagged"),
        pytest.param(16, torch.float16, False, GLUON_PREFILL_CONFIGS["lagged"], 64, False,
                     id="page16-fp16-head64-lagged"),
        pytest.param(16, torch.bfloat16, True, GLUON_PREFILL_CONFIG, 128, True, id="page16-bf16-lse-modifiers"),
        pytest.param(16, torch.bfloat16, True, SMEMQ, 128, True, id="page16-bf16-lse-smemq-modifiers"),
        pytest.param(64, torch.float16, False, SMEMQ, 64, False, id="page64-fp16-head64-smemq"),
        pytest.param(16, torch.bfloat16, True, GLUON_PREFILL_CONFIG, 256, False, id="page16-bf16-lse-head256"),
        pytest.param(64, torch.float16, False, GLUON_PREFILL_CONFIG, 256, False, id="page64-fp16-head256"),
        pytest.param(256, torch.float16, False, GLUON_PREFILL_CONFIG, 64, True, id="page256-fp16-head64-modifiers"),
        pytest.param(64, torch.bfloat16, True, SERIAL, 128, True, id="page64-bf16-lse-serial-modifiers"),
        pytest.param(16, torch.bfloat16, True, PAIRS_SMEMQ, 128, True, id="page16-bf16-lse-pairs-smemq-modifiers"),
        pytest.param(64, torch.float16, False, PAIRS_SMEMQ, 128, False, id="page64-fp16-pairs-smemq"),
        pytest.param(16, torch.bfloat16, True, PAIRS_SMEMQ, 64, True,
                     id="page16-bf16-lse-head64-pairs-smemq-modifiers"),
        pytest.param(16, torch.bfloat16, True, PAIRS_SMEMQ, 256, False, id="page16-bf16-lse-head256-pairs-smemq"),
        pytest.param(16, torch.bfloat16, True, PAIRS, 128, False, id="page16-bf16-lse-pairs"),
        pytest.param(16, torch.float16, False, PAIRS, 128, True, id="page16-fp16-pairs-modifiers"),
        pytest.param(16, torch.bfloat16, True, GLUON_PREFILL_CONFIGS["stages4"], 128, False,
                     id="page16-bf16-lse-stages4"),
        pytest.param(64, torch.float16, False, GLUON_PREFILL_CONFIGS["stages4"], 128, True,
                     id="page64-fp16-stages4-modifiers"),
        pytest.param(64, torch.bfloat16, False, GLUON_PREFILL_CONFIGS["tma128-earlyk-1w"], 128, False,
                     id="page64-bf16-tma128-earlyk-1w"),
        pytest.param(16, torch.float16, False, GLUON_PREFILL_CONFIGS["tma128-earlyk-1w"], 64, False,
                     id="page16-fp16-head64-tma128-earlyk-1w"),
        pytest.param(256, torch.bfloat16, False, GLUON_PREFILL_CONFIGS["tma128-earlyk-1w"], 128, False,
                     id="page256-bf16-tma128-earlyk-1w"),
        pytest.param(16, torch.bfloat16, True, GLUON_PREFILL_CONFIGS["tma128-earlyk-1w"], 128, False,
                     id="page16-bf16-lse-tma128-earlyk-1w"),
        pytest.param(64, torch.float16, False, GLUON_PREFILL_CONFIGS["tma128-earlyk-1w"], 64, False,
                     id="page64-fp16-head64-tma128-earlyk-1w"),
        pytest.param(64, torch.bfloat16, True, GLUON_PREFILL_CONFIGS["groups-earlyk"], 128, True,
                     id="page64-bf16-lse-groups-earlyk-modifiers"),
        pytest.param(16, torch.bfloat16, True, GLUON_PREFILL_CONFIGS["tma128-threads"], 128, False,
                     id="page16-bf16-lse-tma128-threads"),
        pytest.param(64, torch.float16, False, GLUON_PREFILL_CONFIGS["tma128-threads"], 64, False,
                     id="page64-fp16-head64-tma128-threads"),
        pytest.param(256, torch.bfloat16, False, GLUON_PREFILL_CONFIGS["tma128-threads"], 128, False,
                     id="page256-bf16-tma128-threads"),
        pytest.param(16, torch.bfloat16, True, GLUON_PREFILL_CONFIGS["tma"], 128, True,
                     id="page16-bf16-lse-tma-modifiers"),
        pytest.param(16, torch.float16, False, GLUON_PREFILL_CONFIGS["tma"], 64, False, id="page16-fp16-head64-tma"),
        pytest.param(256, torch.bfloat16, False, GLUON_PREFILL_CONFIGS["tma"], 128, False, id="page256-bf16-tma"),
        pytest.param(16, torch.bfloat16, False, GLUON_PREFILL_CONFIGS["tma"], 256, False, id="page16-bf16-head256-tma"),
    ],
)
def test_gluon_prefill_compiles_for_sm90(page_size, dtype, return_lse, config, head_size, modifiers):
    from pagedattn.compile_matrix import compile_gluon
    from pagedattn.ops.common.target import props_for

    row = compile_gluon("prefill_gluon", page_size=page_size, dtype=dtype, return_lse=return_lse, config=config,
                        head_size=head_size, modifiers=modifiers)
    assert row["problems"] == [], row
    assert row["spill_bytes"] == 0 and row["local"] == 0 and row["stack"] == 0, row
    assert 0 < row["shared"] <= props_for("sm90").max_shared, row
    # the consumer warps (one partition or two) plus the producer's, a whole warpgroup
    assert row["num_warps"] == config.num_warps * config.num_consumers + 4, row
    (d_cap, d_used), (p_cap, p_used) = row["partition_regs"]["default"], row["partition_regs"]["producer"]
    assert p_cap == config.producer_regs and 0 < p_used <= p_cap, row
    assert 0 < d_used <= d_cap, row
    if config.split_consumers:
        c_cap, c_used = row["partition_regs"]["consumer"]
        assert c_cap == config.consumer_regs and 0 < c_used <= c_cap, row


def _args(dtype=torch.bfloat16, cache_dtype=None, head_size=128, page_size=16, num_q_heads=8, num_kv_heads=2,
          **changes) -> AttentionArgs:
    q = torch.zeros(40, num_q_heads, head_size, dtype=dtype)
    k_cache = torch.zeros(6, page_size, num_kv_heads, head_size, dtype=cache_dtype or dtype)
    fields = dict(q=q, k_cache=k_cache, v_cache=torch.zeros_like(k_cache),
                  block_table=torch.zeros(2, 3, dtype=torch.int32), seq_lens=torch.tensor([20, 20], dtype=torch.int32),
                  query_start_loc=torch.tensor([0, 20, 40], dtype=torch.int32), scale=head_size ** -0.5, causal=True,
                  sliding_window=0, softcap=0.0, alibi_mode=0, alibi_slopes=None, sinks=None, prefix_ranges=None,
                  k_scale=None, v_scale=None)
    fields.update(changes)
    return AttentionArgs(**fields)


def test_gluon_prefill_variable_picks_the_config(monkeypatch):
    """PAGEDATTN_PREFILL_GLUON: 1 the default config, split / pipelined / serial / groups / lagged /
    stages4 / tma / groups-earlyk / tma128-earlyk-1w / tma128-threads /
    smemq / pairs / pairs-smemq the kept variants, 0 off, anything else (or unset) the automatic
    rule; read at each call."""
    monkeypatch.delenv(GLUON_PREFILL_ENV, raising=False)
    assert gluon_prefill_requested() is None
    default = dataclasses.replace(OVERLAP, q_in_regs=True)
    assert GLUON_PREFILL_CONFIG == default
    for value, config in (("1", default), ("serial", SERIAL), ("split", SPLIT), ("pipelined", PIPELINED),
                          ("groups", dataclasses.replace(default, group_signal=True)),
                          ("lagged", dataclasses.replace(default, group_signal=True, lagged_signal=True, num_stages=4)),
                          ("stages4", dataclasses.replace(default, num_stages=4)),
                          ("tma", dataclasses.replace(default, group_signal=True, tma=True)),
                          ("groups-earlyk", dataclasses.replace(default, group_signal=True, split_release=True)),
                          ("tma128-earlyk-1w", dataclasses.replace(default, group_signal=True, tma=True, block_n=128,
                                                                   num_stages=2, producer_warps=1, producer_regs=48,
                                                                   consumer_regs=232, copy_rows=8, split_release=True)),
                          ("tma128-threads", dataclasses.replace(default, group_signal=True, tma=True, block_n=128,
                                                                 num_stages=2, producer_warps=1, producer_regs=48,
                                                                 consumer_regs=232, copy_rows=8, split_release=True,
                                                                 thread_release=True)),
                          ("smemq", OVERLAP),
                          ("pairs", dataclasses.replace(default, paired=True, num_stages=6, producer_regs=56,
                                                        consumer_regs=224)),
                          ("pairs-smemq", dataclasses.replace(OVERLAP, paired=True, num_stages=6)),
                          ("0", GLUON_OFF), ("yes", None)):
        monkeypatch.setenv(GLUON_PREFILL_ENV, value)
        assert gluon_prefill_requested() == config, value
    # past head 128 every config takes 32-key tiles (64 spill at head 256)
    assert GLUON_PREFILL_CONFIG.for_head(128) == GLUON_PREFILL_CONFIG == GLUON_PREFILL_CONFIG.for_head(64)
    # and keep Q in shared memory (in registers: 64 more a thread)
    assert GLUON_PREFILL_CONFIG.for_head(256) == dataclasses.replace(OVERLAP, block_n=32)
    assert SMEMQ.for_head(256) == dataclasses.replace(OVERLAP, block_n=32)
    # pairs need six 64-key slots of 64 KB: past head 128 the ring is three slots of 32 keys, singly
    assert GLUON_PREFILL_CONFIGS["stages4"].for_head(256) == dataclasses.replace(OVERLAP, block_n=32)
    # TMA boxes of 64 columns are taken at heads 64 and 128 only: past them the copies are cp.async
    assert GLUON_PREFILL_CONFIGS["tma"].for_head(256) == dataclasses.replace(OVERLAP, block_n=32, group_signal=True)
    assert PAIRS.for_head(256) == dataclasses.replace(OVERLAP, block_n=32, producer_regs=56, consumer_regs=224)
    assert PAIRS_SMEMQ.for_head(256) == dataclasses.replace(OVERLAP, block_n=32)


@needs_gluon
def test_gluon_prefill_automatic_rule(monkeypatch):
    """Unset, on sm9x (faked here), the automatic configs serve calls of at least
    GLUON_MIN_QUERY_TOKENS query tokens with a sequence of GLUON_MIN_QUERY_LEN or more, and only
    calls the kernel serves; =1 serves the small ones too; =0 none."""
    monkeypatch.setattr(launch_module, "on_sm9x", lambda t: True)
    monkeypatch.delenv(GLUON_PREFILL_ENV, raising=False)
    big = _args(q=torch.zeros(GLUON_MIN_QUERY_TOKENS, 8, 128, dtype=torch.bfloat16))
    assert use_gluon_prefill(big, GLUON_MIN_QUERY_LEN) == GLUON_AUTO_CONFIG_HEAD128  # 128-key tiles by TMA
    narrow = _args(head_size=64)
    narrow = dataclasses.replace(narrow, q=torch.zeros(GLUON_MIN_QUERY_TOKENS, 8, 64, dtype=torch.bfloat16))
    assert use_gluon_prefill(narrow, GLUON_MIN_QUERY_LEN) == GLUON_PREFILL_CONFIG  # 128-key tiles untimed at 64
    assert use_gluon_prefill(big, GLUON_MIN_QUERY_LEN - 1) is None  # many short sequences
    small = _args(q=torch.zeros(GLUON_MIN_QUERY_TOKENS - 1, 8, 128, dtype=torch.bfloat16))
    # head 256: served, not yet timed: only an explicit PAGEDATTN_PREFILL_GLUON sends it there
    wide = _args(head_size=256)
    wide = dataclasses.replace(wide, q=torch.zeros(GLUON_MIN_QUERY_TOKENS, 8, 256, dtype=torch.bfloat16))
    assert use_gluon_prefill(wide, GLUON_MIN_QUERY_LEN) is None
    assert use_gluon_prefill(small, GLUON_MIN_QUERY_LEN) is None
    # a score modifier: the kernel computes it, but only an explicit PAGEDATTN_PREFILL_GLUON sends it there
    assert use_gluon_prefill(dataclasses.replace(big, softcap=2.0), GLUON_MIN_QUERY_LEN) is None
    assert use_gluon_prefill(dataclasses.replace(big, prefix_ranges=torch.zeros(2, 1, 2, dtype=torch.int32)),
                             GLUON_MIN_QUERY_LEN) is None
    monkeypatch.setenv(GLUON_PREFILL_ENV, "1")
    assert use_gluon_prefill(small, 20) == GLUON_PREFILL_CONFIG
    assert use_gluon_prefill(wide, GLUON_MIN_QUERY_LEN) == GLUON_PREFILL_CONFIG
    assert use_gluon_prefill(dataclasses.replace(big, softcap=2.0), GLUON_MIN_QUERY_LEN) == GLUON_PREFILL_CONFIG
    monkeypatch.setenv(GLUON_PREFILL_ENV, "serial")
    assert use_gluon_prefill(small, 20) == SERIAL
    monkeypatch.setenv(GLUON_PREFILL_ENV, "0")
    assert use_gluon_prefill(big, GLUON_MIN_QUERY_LEN) is None


@needs_gluon
def test_gluon_prefill_supported():
    assert gluon_prefill_supported(_args(), 20) is None
    assert gluon_prefill_supported(_args(torch.float16, page_size=64, num_q_heads=8, num_kv_heads=8), 20) is None
    assert gluon_prefill_supported(_args(head_size=64, page_size=256), 20) is None
    assert gluon_prefill_supported(_args(head_size=256), 20) is None
    a = _args()
    every = dict(sliding_window=7, softcap=2.0, alibi_mode=2, alibi_slopes=torch.ones(8), sinks=torch.ones(8))
    for name, value in every.items():
        changes = dict(alibi_mode=1, alibi_slopes=torch.ones(8)) if name.startswith("alibi") else {name: value}
        assert gluon_prefill_supported(dataclasses.replace(a, **changes), 20) is None, name
    assert gluon_prefill_supported(dataclasses.replace(a, **every), 20) is None
    prefix = torch.zeros(2, 1, 2, dtype=torch.int32)
    assert gluon_prefill_supported(dataclasses.replace(a, prefix_ranges=prefix, **every), 20) is None
    assert "without alibi_slopes" in gluon_prefill_supported(dataclasses.replace(a, alibi_mode=1), 20)
    assert "causal" in gluon_prefill_supported(dataclasses.replace(a, causal=False), 20)
    assert "positive scale" in gluon_prefill_supported(dataclasses.replace(a, scale=-0.1), 20)
    fp8 = _args(cache_dtype=torch.float8_e4m3fn, k_scale=torch.ones(1), v_scale=torch.ones(1))
    assert "no fp8" in gluon_prefill_supported(fp8, 20)
    assert "bfloat16 or float16" in gluon_prefill_supported(_args(torch.float32), 20)
    assert "head_size 96" in gluon_prefill_supported(_args(head_size=96), 20)
    assert "block_size 8" in gluon_prefill_supported(_args(page_size=8), 20)
    assert "block_size 48" in gluon_prefill_supported(_args(page_size=48), 20)
    assert "contiguous" in gluon_prefill_supported(dataclasses.replace(a, block_table=None), 20)
    v_other = torch.zeros(6, 2, 16, 128, dtype=torch.bfloat16).transpose(1, 2)  # another layout, same shape
    assert "strides" in gluon_prefill_supported(dataclasses.replace(a, v_cache=v_other), 20)
    wide = torch.zeros(6, 16, 2, 136, dtype=torch.bfloat16)[..., :128]  # a head stride of 136: not a multiple of 16
    assert "aligned" in gluon_prefill_supported(dataclasses.replace(a, k_cache=wide, v_cache=wide), 20)
    assert "Q tiles" in gluon_prefill_supported(a, 65536 * GLUON_PREFILL_CONFIG.block_m + 1)


@needs_gluon
def test_gluon_prefill_refuses_a_modifier_it_has_never_heard_of():
    """A score modifier added to AttentionArgs later is refused without a change to the Gluon
    launcher: every field that is not an input counts as a modifier."""
    @dataclasses.dataclass
    class WithTemperature(AttentionArgs):
        temperature: float = 0.0

    a = WithTemperature(**{f.name: getattr(_args(), f.name) for f in dataclasses.fields(AttentionArgs)})
    assert gluon_prefill_supported(a, 20) is None
    assert "temperature" in gluon_prefill_supported(dataclasses.replace(a, temperature=0.7), 20)


@needs_gluon
@pytest.mark.parametrize("cases, decodes", [([(2048, 2048)], False), ([(512, 4608)] * 4, False),
                                           ([(2048, 2048)] + [(1, 2049)] * 63, True)],
                         ids=["prefill", "extends", "among-decodes"])
def test_gluon_prefill_rule_inside_a_call(monkeypatch, cases, decodes):
    """The automatic rule inside a call (the launchers and sm9x faked): a prefill, extends, and a
    prefill among decodes take the Gluon kernel for their prefill launch, with a plan or without;
    the decodes beside it take the unified kernel."""
    monkeypatch.setattr(launch_module, "on_sm9x", lambda t: True)
    monkeypatch.setattr(launch_module, "gluon_prefill_supported", lambda *a, **k: None)
    monkeypatch.delenv(GLUON_PREFILL_ENV, raising=False)
    launched = []
    for name in ("launch_prefill_gluon", "launch_prefill", "launch_unified"):
        monkeypatch.setattr(api_module, name, lambda *a, name=name, **k: launched.append(name))
    batch = make_paged_batch(cases, num_q_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                             dtype=torch.bfloat16, device="cpu")
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=8, num_kv_heads=2, head_size=128,
                          device="cpu", dtype=torch.bfloat16)
    assert plan.path == "prefill"
    for with_plan in (True, False):
        launched.clear()
        paged_attention(*batch.args(), max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
                        plan=plan if with_plan else None)
        assert "launch_prefill_gluon" in launched and "launch_prefill" not in launched, (with_plan, launched)
        if decodes:
            assert "launch_unified" in launched, (with_plan, launched)


def test_gluon_prefill_not_used_off_gpu(monkeypatch):
    big = _args(q=torch.zeros(GLUON_MIN_QUERY_TOKENS, 8, 128, dtype=torch.bfloat16))
    monkeypatch.delenv(GLUON_PREFILL_ENV, raising=False)
    assert use_gluon_prefill(big, GLUON_MIN_QUERY_LEN) is None
    monkeypatch.setenv(GLUON_PREFILL_ENV, "1")
    assert use_gluon_prefill(big, GLUON_MIN_QUERY_LEN) is None  # CPU tensors


# ---------------------------------------------------------------------------------------------
# GPU: paged_attention through the Gluon kernel against the float64 reference


def make_batch(cases, *, num_q_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16,
               num_blocks=None, seed=0, pad_tokens=0):
    """(query_len, kv_len) cases in a paged cache with shuffled block ids, random data; the table's
    entries past each sequence's pages (and two extra columns) hold -1 or ids past the cache,
    never to be read. ``pad_tokens``: rows of q past the last sequence's queries (padding)."""
    g = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(cases, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                             block_size=block_size, dtype=dtype, device="cuda", num_blocks=num_blocks, generator=g)
    n = batch.k_cache.shape[0]
    table = torch.cat([batch.block_table.cpu(), torch.zeros(len(cases), 2, dtype=torch.int32)], 1)
    for s, (_, kv) in enumerate(cases):
        table[s, -(-kv // block_size):] = -1 if s % 2 == 0 else n + 1000
    batch.block_table = table.cuda()
    if pad_tokens:
        batch.q = torch.cat([batch.q, torch.randn(pad_tokens, *batch.q.shape[1:], generator=g).to("cuda", dtype)])
    return batch


class GluonCalls:
    """The Gluon and tl prefill launches of a test (their keyword arguments), and the config
    the Gluon launches use."""

    def __init__(self):
        self.gluon: list = []
        self.tl: list = []
        self.config = GLUON_PREFILL_CONFIG


SMOKE = """
import torch
from pagedattn.testing import use_scratch_allocator_when_instrumented
use_scratch_allocator_when_instrumented()
import pagedattn
from pagedattn.testing import make_paged_batch
batch = make_paged_batch([(300, 300), (129, 700)], num_q_heads=8, num_kv_heads=2, head_size=HEAD, block_size=16,
                         dtype=torch.bfloat16, device="cuda")
pagedattn.paged_attention(*batch.args(), max_query_len=300, max_seq_len=700)
torch.cuda.synchronize()
"""


@functools.lru_cache(maxsize=None)
def first_call_problem(variant: str, head_size: int = 128) -> str | None:
    """One small call of a PAGEDATTN_PREFILL_GLUON variant in a separate process: what went
    wrong, or None. A kernel that never finishes (a barrier protocol that deadlocks) then fails
    the tests of that variant instead of hanging the suite."""
    return runs_within(SMOKE.replace("HEAD", str(head_size)), timeout=180, env={GLUON_PREFILL_ENV: variant})


def require_first_call(variant: str, head_size: int = 128) -> None:
    problem = first_call_problem(variant, head_size)
    if problem:
        pytest.fail(f"the Gluon prefill kernel's first call ({GLUON_PREFILL_ENV}={variant}, head {head_size}) "
                    f"{problem}")


@pytest.fixture(scope="module")
def gluon_finishes():
    require_first_call("1")


@pytest.fixture
def calls(monkeypatch, gluon_finishes):
    """PAGEDATTN_PREFILL_GLUON=1; both prefill launchers are counted (tapes cleared: a replayed
    tape would bypass them)."""
    monkeypatch.setenv(GLUON_PREFILL_ENV, "1")
    state = GluonCalls()
    gluon_launcher, tl_launcher = api_module.launch_prefill_gluon, api_module.launch_prefill

    def gluon(*args, **kwargs):
        state.gluon.append(kwargs)
        return gluon_launcher(*args, **{**kwargs, "config": state.config})

    def tl(*args, **kwargs):
        state.tl.append(kwargs)
        return tl_launcher(*args, **kwargs)

    monkeypatch.setattr(api_module, "launch_prefill_gluon", gluon)
    monkeypatch.setattr(api_module, "launch_prefill", tl)
    api_module._CALL_TAPES.clear()
    yield state
    api_module._CALL_TAPES.clear()


def run_and_compare(batch, *, path="auto", **kwargs):
    """paged_attention (outputs poisoned with NaN; with a plan for ``path`` unless "auto") against
    the reference; rows of q past the batch's queries must stay unwritten."""
    q = batch.q
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device="cuda")
    plan = None
    if path != "auto":
        plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=q.shape[1],
                              num_kv_heads=batch.k_cache.shape[2], head_size=q.shape[2], device="cuda", path=path,
                              dtype=q.dtype, max_num_tokens=q.shape[0])
        assert plan.path == path
    paged_attention(*batch.args(), max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len, out=out,
                    lse_out=lse, plan=plan, **kwargs)
    ref_out, ref_lse = paged_attention_ref(*batch.args(), **kwargs)
    n = int(batch.query_start_loc[-1])
    assert_matches_reference(out[:n], lse[:n], ref_out[:n], ref_lse[:n])
    assert torch.isnan(out[n:]).all() and torch.isnan(lse[n:]).all(), "a padding row was written"


@pytest.mark.gpu
@needs_gluon
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size", [16, 64, 256], ids=lambda n: f"page{n}")
@pytest.mark.parametrize("heads", [(32, 8), (8, 8)], ids=["gqa32-8", "mha8"])
@pytest.mark.parametrize("seq_len", [1, 17, 128, 300, 1000], ids=lambda n: f"S{n}")
def test_gluon_prefill_single_sequence_gpu(calls, seq_len, heads, block_size, dtype):
    """One prefill of S tokens, every sequence through the large-tile path (a plan for "prefill")."""
    batch = make_batch([(seq_len, seq_len)], num_q_heads=heads[0], num_kv_heads=heads[1], block_size=block_size,
                       dtype=dtype, seed=seq_len + block_size + heads[1], pad_tokens=3)
    run_and_compare(batch, path="prefill")
    assert len(calls.gluon) == 1 and not calls.tl


@pytest.mark.gpu
@needs_gluon
@needs_sm90
@pytest.mark.parametrize("variant", ["1", "split", "pipelined", "m64", "serial", "groups", "lagged", "stages4",
                                     "tma", "tma128-earlyk-1w", "tma128-threads", "smemq",
                                     "pairs", "pairs-smemq"])
@pytest.mark.parametrize("block_size", [16, 64, 256], ids=lambda n: f"page{n}")
def test_gluon_prefill_extend_gpu(calls, block_size, variant):
    """Extends: 128 and 300 queries over 2000 keys, queries that start mid-page, a Q tile that
    ends mid-tile; 64- and 128-row tiles, the serial loop, the pipelined one and the overlapped
    one, one consumer partition and two, the producer signalling through commit groups (at once
    and one tile late), rings of 3, 4 and 5 tiles, block ids loaded before or after the slot
    wait, the copies by TMA (and the tile at the range's end by cp.async), Q in registers (the default) and read from
    shared memory, the mask-free tiles singly and in pairs (odd and even counts of them)."""
    if variant != "m64":
        require_first_call(variant)
    calls.config = BLOCK_M64 if variant == "m64" else GLUON_PREFILL_CONFIGS[variant]
    batch = make_batch([(128, 2000), (300, 2000), (129, 777)], block_size=block_size, seed=block_size)
    run_and_compare(batch, path="prefill")
    run_and_compare(batch)  # the automatic plan: all three reach the prefill threshold
    assert len(calls.gluon) == 2 and not calls.tl


@pytest.mark.gpu
@needs_gluon
@needs_sm90
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_gluon_prefill_among_decodes_gpu(calls, head_size):
    """A prefill among decodes and a short extend: the Gluon kernel serves the long sequence
    only (the others stay on the unified kernel, on the side stream)."""
    require_first_call("1", head_size)
    cases = [(1, 77), (700, 700), (1, 1500), (5, 40), (0, 9)]
    batch = make_batch(cases, head_size=head_size, dtype=torch.float16, seed=head_size)
    run_and_compare(batch)
    assert len(calls.gluon) == 1 and not calls.tl
    # a call without a plan does not read the lengths on the host: the kernel's grid covers every
    # sequence and min_q_len sends the short ones away (a plan narrows the grid to its prefill_seqs)
    assert calls.gluon[0]["min_q_len"] == PREFILL_MIN_QUERY_LEN and calls.gluon[0]["seqs"] == (0, len(cases))


@pytest.mark.gpu
@needs_gluon
@needs_sm90
@pytest.mark.parametrize("variant", ["1", "tma", "tma128-earlyk-1w", "tma128-threads"])
def test_gluon_prefill_cache_past_int32_offsets_gpu(calls, variant):
    # [num_blocks, 16, 8, 128] bf16 past 2**31 elements (> 4 GiB a cache); the batch uses the top blocks
    require_first_call(variant)
    calls.config = GLUON_PREFILL_CONFIGS[variant]
    num_blocks = 2**31 // (16 * 8 * 128) + 64
    batch = make_batch([(300, 1000), (200, 200)], num_blocks=num_blocks, seed=9)
    assert batch.k_cache.numel() > 2**31
    run_and_compare(batch, path="prefill")
    assert len(calls.gluon) == 1


@pytest.mark.gpu
@needs_gluon
@needs_sm90
def test_gluon_prefill_path_taken_gpu(calls, monkeypatch):
    """=1 takes a small prefill, =0 or unset leaves it to the tl kernel (the thin path's key
    holds the setting, so a recorded call is not replayed across it); unset, a prefill past the
    automatic rule's floor takes the Gluon kernel."""
    batch = make_batch([(300, 300)], seed=5)
    run_and_compare(batch)
    assert len(calls.gluon) == 1 and not calls.tl
    run_and_compare(batch)  # replayed: the recorded Gluon launch again
    gluon_launches = len(calls.gluon)
    monkeypatch.setenv(GLUON_PREFILL_ENV, "0")
    run_and_compare(batch)
    assert len(calls.gluon) == gluon_launches and len(calls.tl) == 1
    monkeypatch.delenv(GLUON_PREFILL_ENV)
    run_and_compare(batch)
    assert len(calls.gluon) == gluon_launches and len(calls.tl) == 2
    big = make_batch([(GLUON_MIN_QUERY_TOKENS, GLUON_MIN_QUERY_TOKENS)], seed=6)
    run_and_compare(big)
    assert len(calls.gluon) == gluon_launches + 1 and len(calls.tl) == 2


@pytest.mark.gpu
@needs_gluon
@needs_sm90
@pytest.mark.parametrize("variant", ["1", "tma", "tma128-earlyk-1w", "tma128-threads"])
def test_gluon_prefill_bad_block_id_inside_a_sequence_gpu(calls, variant):
    """A block id outside the cache inside a sequence (a caller's bug, not validated on a GPU):
    nothing outside the cache is read (its keys are zero-filled: masked copies, or TMA boxes out
    of the descriptor's bounds), no NaN reaches the output, and the other sequence is exact."""
    require_first_call(variant)
    calls.config = GLUON_PREFILL_CONFIGS[variant]
    batch = make_batch([(300, 300), (200, 500)], block_size=16, seed=21)
    ref_out, ref_lse = paged_attention_ref(*batch.args())
    batch.block_table[0, 3] = -1
    batch.block_table[0, 7] = batch.k_cache.shape[0] + 5
    out, lse = paged_attention(*batch.args(), max_query_len=300, max_seq_len=500, return_lse=True)
    assert len(calls.gluon) == 1
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_matches_reference(out[300:], lse[300:], ref_out[300:], ref_lse[300:])


@pytest.mark.gpu
@needs_gluon
@needs_sm90
@pytest.mark.parametrize("feature", ["fp8", "head96", "noncausal"])
def test_gluon_prefill_unsupported_falls_back_gpu(calls, feature):
    """Calls the kernel does not serve run the tl prefill kernel, and still match the reference."""
    kwargs, make = {}, {}
    if feature == "head96":
        make = dict(head_size=96)
    elif feature == "noncausal":
        kwargs = dict(causal=False)
    batch = make_batch([(300, 300), (1, 50)], dtype=torch.float16, seed=len(feature), **make)
    if feature == "fp8":
        batch.k_cache = batch.k_cache.to(torch.float8_e4m3fn)
        batch.v_cache = batch.v_cache.to(torch.float8_e4m3fn)
        kwargs = dict(k_scale=0.5, v_scale=1.5)
    run_and_compare(batch, **kwargs)
    assert not calls.gluon and len(calls.tl) == 1


MODIFIER_CASES = {
    "window100": dict(sliding_window=100),  # narrower than a Q tile: every tile masked
    "window1000": dict(sliding_window=1000),  # masked edge tiles, mask-free middle ones, the diagonal
    "softcap": dict(softcap=20.0),
    "alibi": dict(alibi=True),
    "alibi_sqrt": dict(alibi=True, alibi_sqrt=True),
    "sinks": dict(sinks=True),
    # bidirectional ranges: inside the first Q tile, across a tile boundary past the diagonal, two
    # in one sequence; the third sequence has none (a padding row, start >= end)
    "prefix": dict(prefix=[[[0, 40], [500, 650]], [[1700, 1950], [0, 0]], [[0, 0], [0, 0]]]),
    "all": dict(sliding_window=300, softcap=30.0, alibi=True, sinks=True,
                prefix=[[[100, 180], [0, 0]], [[1750, 1900], [10, 30]], [[700, 760], [0, 0]]]),
}


@pytest.mark.gpu
@needs_gluon
@needs_sm90
@pytest.mark.parametrize("variant", ["1", "serial", "smemq", "pairs", "pairs-smemq", "lagged", "stages4", "tma",
                                     "tma128-earlyk-1w", "tma128-threads"])
@pytest.mark.parametrize("case", list(MODIFIER_CASES))
def test_gluon_prefill_score_modifiers_gpu(calls, case, variant):
    """The score modifiers the kernel computes, asked for with PAGEDATTN_PREFILL_GLUON: a prompt
    and two extends over longer contexts (tiles before the window, at its edge, in its middle,
    on the diagonal and past it inside a prefix range), against the float64 reference."""
    if variant != "1":
        require_first_call(variant)
    calls.config = GLUON_PREFILL_CONFIGS[variant]
    spec = dict(MODIFIER_CASES[case])
    num_q_heads = 32
    g = torch.Generator().manual_seed(len(case))
    kwargs = {k: v for k, v in spec.items() if k in ("sliding_window", "softcap", "alibi_sqrt")}
    if spec.get("alibi"):
        kwargs["alibi_slopes"] = (torch.rand(num_q_heads, generator=g) * 0.5).cuda()
    if spec.get("sinks"):
        kwargs["sinks"] = (torch.randn(num_q_heads, generator=g) * 2.0).cuda()
    if "prefix" in spec:
        kwargs["prefix_ranges"] = torch.tensor(spec["prefix"], dtype=torch.int32, device="cuda")
    batch = make_batch([(700, 700), (300, 2000), (129, 777)], num_q_heads=num_q_heads, seed=len(case) + 1)
    run_and_compare(batch, **kwargs)
    assert len(calls.gluon) == 1 and not calls.tl


CONSAN_CHECK = """
import torch
from pagedattn.testing import use_scratch_allocator_when_instrumented
use_scratch_allocator_when_instrumented()
import pagedattn
import pagedattn.api as api
from pagedattn.reference import paged_attention_ref
from pagedattn.testing import assert_matches_reference, make_paged_batch
launches = []
launcher = api.launch_prefill_gluon
api.launch_prefill_gluon = lambda *a, **k: launches.append(k) or launcher(*a, **k)
g = torch.Generator().manual_seed(7)
heads = 8
modifiers = dict(sliding_window=300, softcap=30.0, alibi_slopes=(torch.rand(heads, generator=g) * 0.5).cuda(),
                 sinks=torch.randn(heads, generator=g).cuda(),
                 prefix_ranges=torch.tensor([[[100, 180]], [[1750, 1900]], [[0, 0]]], dtype=torch.int32).cuda())
for block_size, kwargs in ((16, {}), (64, modifiers)):
    batch = make_paged_batch([(128, 2000), (300, 2000), (129, 777)], num_q_heads=heads, num_kv_heads=2,
                             head_size=128, block_size=block_size, dtype=torch.bfloat16, device="cuda", generator=g)
    out = torch.full_like(batch.q, float("nan"))
    lse = torch.full(batch.q.shape[:2], float("nan"), device="cuda")
    pagedattn.paged_attention(*batch.args(), max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
                              out=out, lse_out=lse, **kwargs)
    assert_matches_reference(out, lse, *paged_attention_ref(*batch.args(), **kwargs))
torch.cuda.synchronize()
assert len(launches) == 2, launches
"""


# Triton 3.6's ConSan counts each TMA copy as one arrival on its barrier and the expect as none
# (in the sm_90a PTX it instruments, an update of the barrier's state precedes every
# cp.async.bulk.tensor and none follows the mbarrier.arrive.expect_tx). A ring slot's ready
# barrier takes one TMA box per page and 64 columns (8 at page 16, 2 at page 64) and one real
# arrival, so ConSan's model flips its phase an even number of times a tile and reports the
# consumers' wait as a deadlock that the hardware does not have (the variant's GPU tests pass).
# Strict: a Triton that models the expected bytes makes this pass, and the mark must go.
_CONSAN_TMA = pytest.mark.xfail(
    triton.__version__.startswith("3.6"), strict=True,
    reason="triton 3.6's ConSan counts every TMA copy as a barrier arrival (several boxes a barrier)")


@pytest.mark.gpu
@needs_gluon
@needs_sm90
@pytest.mark.parametrize("variant", ["groups", "lagged", "groups-earlyk",
                                     pytest.param("tma", marks=_CONSAN_TMA)])
def test_gluon_prefill_ring_protocol_under_consan_gpu(tmp_path, variant):
    """Triton's concurrency sanitizer over the Gluon prefill's ring (an extend at page 16, every
    score modifier at page 64), in a fresh process with its own kernel cache: no race between
    the producer's copies and the consumers' wgmma reads, both ways, and the reference's
    result. The ``groups`` variant: ConSan in triton 3.6 follows cp.async completion through
    commit groups only, not through the default's ``cp.async.mbarrier.arrive.noinc`` (it flags
    every read of a ring slot there); the two differ in that signal alone. ``lagged`` signals a
    tile one tile later, two tiles' groups in flight, and its consumers do not fence.
    ``groups-earlyk``: the split release (K's slot and V's apart), whose waits and order
    ``tma128-threads`` keeps. ``tma``: see ``_CONSAN_TMA``. Not checked here: the release by
    every consumer thread (``thread_release``). ConSan models one logical thread a partition and
    does not model ``cp.async.mbarrier.arrive`` at all, so on a barrier that counts 256 such
    arrivals its shadow phase never turns, and it reported every such run (at page 16 and 64,
    the ``groups`` signal) as a deadlock on the H200 while the same kernel passed this file's
    GPU tests; that release is covered by those tests only."""
    problem = runs_under_consan(CONSAN_CHECK, tmp_path, env={GLUON_PREFILL_ENV: variant})
    assert problem is None, f"under ConSan: {problem}"


@pytest.mark.gpu
@needs_gluon
@needs_sm90
@pytest.mark.parametrize("variant", ["1", "tma", "tma128-earlyk-1w", "tma128-threads"])
def test_gluon_prefill_cuda_graph_gpu(calls, variant):
    """With max_query_len / max_seq_len and a plan the call replays its tape and can be captured
    (``tma``: the tape rebuilds its host descriptors, which the captured launch encodes)."""
    if variant != "1":
        require_first_call(variant)
    calls.config = GLUON_PREFILL_CONFIGS[variant]
    batch = make_batch([(400, 1200), (1, 300)], seed=13)
    q = batch.q
    plan = plan_attention(batch.query_start_loc, batch.seq_lens, num_q_heads=q.shape[1],
                          num_kv_heads=batch.k_cache.shape[2], head_size=q.shape[2], device="cuda", dtype=q.dtype)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device="cuda")

    def step():
        paged_attention(*batch.args(), max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len, out=out,
                        lse_out=lse, plan=plan)

    graph = captured(step)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert calls.gluon, "the Gluon kernel was not launched"
    assert_matches_reference(out, lse, *paged_attention_ref(*batch.args()))
