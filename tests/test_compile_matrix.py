"""The compile matrix (pagedattn check --compile) and the tiles fitted per target.

The parsing and fitting tests are pure host code. ``test_compiles_for_nvidia_and_amd`` compiles
one decode variant for sm90 and gfx942 in a fresh process (the interpreter's kernels cannot be
compiled): about 10 s, marked ``compile`` (``-m "not compile"`` leaves it out).
"""

import dataclasses
import itertools
from dataclasses import replace

import pytest
import torch

from pagedattn import compile_matrix as cm
from pagedattn.ops.common.target import KNOWN_TARGETS, H200, fit_tiles, props_for, tiles_shared_bytes
from pagedattn.ops.common.tiles import Tiles
from pagedattn.plan import fitted, pick_prefill_tiles, pick_tiles

NVIDIA_RES_USAGE = """
Fatbin elf code:
================
arch = sm_90a
	Function unified_attention_kernel:
		REG:151 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:936 TEXTURE:0 SURFACE:0 SAMPLER:0
"""

AMDGCN_TAIL = """
; NumVgprs: 196
; ScratchSize: 124
; Occupancy: 2
amdhsa.kernels:
  - .agpr_count:     0
    .group_segment_fixed_size: 17408
    .sgpr_count:     106
    .sgpr_spill_count: 30
    .vgpr_count:     196
    .vgpr_spill_count: 0
"""


def test_parse_nvidia_usage():
    assert cm.parse_nvidia_usage(NVIDIA_RES_USAGE) == dict(regs=151, stack=0, local=0)


def test_parse_amdgcn():
    u = cm.parse_amdgcn(AMDGCN_TAIL)
    assert (u["vgprs"], u["agprs"], u["sgprs"], u["vgpr_spills"], u["sgpr_spills"], u["lds"], u["occupancy"]) == (
        196, 0, 106, 0, 30, 17408, 2)


def test_nvidia_programs_per_sm():
    # the H200's decode tiles: 151 registers, 70 KB, 4 warps -> 3 programs per SM (the planner's wave)
    assert cm.nvidia_programs_per_sm(151, 71680, 4, H200) == 3
    assert cm.nvidia_programs_per_sm(255, 230400, 8, H200) == 1


def _row(target, spill=0, shared=1024, problems=()):
    return dict(variant="v", target=target, kernel="k", tiles="16x64 w4 s3", regs=100, shared=shared,
                spill_bytes=spill, occupancy=1, problems=list(problems) + ([f"spills {spill} B"] if spill else []))


def test_judge_spills_and_limits():
    rows = cm.judge([_row("sm90", spill=32), _row("sm80", spill=56), _row("gfx942", spill=8)])
    assert [r["ok"] for r in rows] == [True, True, True]  # sm90's timed spill, inherited where sm90 spills
    rows = cm.judge([_row("sm90"), _row("sm120", spill=40), _row("gfx942", problems=["shared memory 70000 B over"])])
    assert [r["ok"] for r in rows] == [True, False, False]
    table = cm.format_table(rows, ["sm90", "sm120", "gfx942"])
    assert "SPILL" in table and ">LIM" in table and "sm90 (timed)" in table
    s = cm.summary(rows, ["sm90", "sm120", "gfx942"])
    assert (s["failed"], s["spills"], s["over_limit"]) == (2, 1, 1)


def test_unknown_target_is_named():
    with pytest.raises(ValueError, match="sm75"):
        props_for("sm75")


HEADS = (64, 80, 96, 128, 192, 256)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.fixture
def gpu_tables(monkeypatch):
    """The planner's GPU tables (the interpreter has tiles of its own)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_sm90_tiles_unchanged(gpu_tables):
    """On sm90 the fitted tiles are the H200 tables' own, for every head, dtype and shape."""
    for head, dtype, short in itertools.product(HEADS, DTYPES, (False, True)):
        t = pick_prefill_tiles(head, dtype, short=short)
        assert fitted(t, H200, head, dtype) == t
    for head, dtype, q_len, group in itertools.product(HEADS, DTYPES, (1, 4, 64), (1, 4, 8)):
        t = pick_tiles(q_len, group, head)
        assert fitted(t, H200, head, dtype) == t
        # decode: sm90's tiles on sm100, with ptxas's register budget past head 128 (its default
        # of 168 spills there)
        budget = 255 if t.block_m < 64 and head > 128 and dtype != torch.float32 else None
        assert fitted(t, KNOWN_TARGETS["sm100"], head, dtype) == dataclasses.replace(t, max_registers=budget)
    # sm100: 64 keys a tile, where its compiler leaves the 128-row prefill tiles without spills
    assert fitted(pick_prefill_tiles(128, torch.bfloat16), KNOWN_TARGETS["sm100"], 128, torch.bfloat16) == Tiles(
        128, 128, 64, 8, 3)
    # sm80: 64 rows on 4 warps
    assert fitted(pick_prefill_tiles(128, torch.bfloat16), KNOWN_TARGETS["sm80"], 128, torch.bfloat16) == Tiles(
        64, 64, 64, 4, 3)


@pytest.mark.parametrize("name", sorted(KNOWN_TARGETS))
def test_fitted_tiles_fit_the_target(name, gpu_tables):
    target = KNOWN_TARGETS[name]
    for head, dtype in itertools.product(HEADS, DTYPES):
        pad = max(16, 1 << (head - 1).bit_length())
        for t in (pick_prefill_tiles(head, dtype), pick_tiles(1, 4, head), pick_tiles(64, 4, head)):
            f = fitted(t, target, head, dtype)
            assert tiles_shared_bytes(f, pad, dtype.itemsize, dtype.itemsize, target.shared_overhead,
                                      target) <= target.max_shared
            assert f.block_m >= 16 and f.tile_n >= 16 and f.block_m % f.block_q == 0
            if target.max_warps:
                assert f.num_warps <= max(target.max_warps, target.fp32_warps or 0)
            if target.max_tile_n:
                assert f.tile_n <= target.max_tile_n


def test_fit_shrinks_stages_before_keys():
    prefill = Tiles(128, 128, 128, 8, 3)
    assert fit_tiles(prefill, replace(H200, max_shared=163 * 1024), 128, 2) == Tiles(128, 128, 128, 8, 2)
    assert fit_tiles(prefill, replace(H200, max_shared=99 * 1024), 128, 2) == Tiles(128, 128, 64, 8, 2)


@pytest.mark.compile
def test_compiles_for_nvidia_and_amd():
    rows = cm.run_matrix(("sm90", "gfx942"), only=["decode d96"], jobs=1)
    assert {r["target"] for r in rows} == {"sm90", "gfx942"}
    by_target = {r["target"]: r for r in rows}
    assert all(r["ok"] for r in rows), [r.get("failures") for r in rows]
    assert by_target["sm90"]["tiles"] == "16x64 w4 s3" and by_target["sm90"]["regs"] > 0
    assert by_target["gfx942"]["sgprs"] > 0 and by_target["gfx942"]["shared"] <= 64 * 1024


def test_gluon_rows_are_sm90_only():
    """The Gluon kernels' rows compile for sm90 only; on every other target the row says so and
    neither fails nor counts as a kernel compiled or refused."""
    names = {v.family for v in cm.variants(full=False)}
    assert set(cm.GLUON_FAMILIES) <= names  # CI's subset compiles one of each for sm90
    for family in cm.GLUON_FAMILIES:
        for target in ("sm80", "sm100", "gfx942"):
            (row,) = cm.compile_variant(cm.Variant(family), target)
            assert row["elsewhere"] and row["problems"] == []
    rows = cm.judge([cm.compile_variant(cm.Variant("mla_gluon"), "gfx942")[0]])
    assert rows[0]["ok"] and cm._cell(rows[0], None) == "sm90 only"
    s = cm.summary(rows, ["gfx942"])
    assert s["elsewhere"] == 1 and s["refused"] == 0 and s["failed"] == 0


@pytest.mark.parametrize("name", sorted(KNOWN_TARGETS))
def test_decode_tiles_take_the_targets_register_budget_and_warps(gpu_tables, name):
    """16-bit decode tiles carry the target's ptxas budget (up to head 128 and past it) and, past
    head 128, its warp counts; fp32 tiles and prefill tiles keep the compiler's choice."""
    from pagedattn.plan.tiles import persistent_tiles

    target = KNOWN_TARGETS[name]
    for head in (64, 128, 256):
        wide = head > 128
        t = fitted(pick_tiles(1, 4, head), target, head, torch.bfloat16)
        assert t.max_registers == (target.wide_decode_registers if wide else
                                   target.decode_registers if head == 128 else None)
        assert t.num_warps == (target.wide_decode_warps if wide and target.wide_decode_warps else
                               fitted(pick_tiles(1, 4, 128), target, 128, torch.bfloat16).num_warps)
        assert fitted(pick_tiles(1, 4, head), target, head, torch.float32).max_registers is None
        assert fitted(pick_prefill_tiles(head, torch.bfloat16), target, head, torch.bfloat16).max_registers is None
        p = persistent_tiles(t, target, head)
        assert p.num_warps == (target.wide_persistent_warps if wide and target.wide_persistent_warps else t.num_warps)
