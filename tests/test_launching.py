"""Tapes (pagedattn.ops.common.launching) on the CPU: a recorded launch replayed with other tensors.

The interpreter compiles nothing, so these tests record stand-in launches (a Python function in
place of a compiled launcher) and check what a replay passes it: each tensor's address at its
recorded offset, the recorded constants, and no launch at all when a layout, a None pattern, an
alias or an alignment differs. The GPU tests replay real kernels (tests/test_gpu.py).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pagedattn.ops.common import launching
from pagedattn.ops.common.launching import Tape, Tapes, _Launch


def _stand_in_launch(calls: list, values: list, slots: list) -> _Launch:
    op = object.__new__(_Launch)
    op.call = lambda *args: calls.append(args)
    op.prefix = (4, 2, 1, "stream")
    op.values = values
    op.slots = slots
    return op


def _add_stand_ins(tape, bindables, calls) -> None:
    """Into a recording tape: one launch whose argument 0 is bindable 0's pointer, argument 1 a
    tuple (bindable 1 at byte offset 64, 7, bindable 0) and argument 2 the int 5; and a second
    launch reading bindable 2 when it is present."""
    tape._ops.append(_stand_in_launch(calls, [0, (0, 7, 0), 5], [
        (0, -1, 0, 0, True), (1, 0, 1, 64, True), (1, 2, 0, 0, False)]))
    if bindables[2] is not None:
        tape._ops.append(_stand_in_launch(calls, [0], [(0, -1, 2, 0, True)]))


def _record(bindables, calls):
    tape = Tape(bindables)
    with tape:
        _add_stand_ins(tape, bindables, calls)
    return tape


def _recording(bindables, calls):
    """A ``run`` for Tapes.record that adds the stand-in launches to the recording tape."""
    return lambda: _add_stand_ins(launching._RECORDING.get(), bindables, calls)


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(8, 4, 16, generator=g), torch.randn(32, 16, generator=g),
            torch.randint(0, 9, (5,), dtype=torch.int32, generator=g))


@pytest.fixture(params=["tensor guard", "python"])
def guard_kind(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(launching, "_layout_guard", lambda tensors: None)
    return request.param


def test_replay_binds_new_addresses_and_keeps_constants(guard_kind):
    calls = []
    tape = _record(_tensors(), calls)
    assert tape.usable
    calls.clear()
    a, b, c = _tensors(seed=1)
    assert tape.replay((a, b, c)) is True
    assert calls == [(4, 2, 1, "stream", a.data_ptr(), (b.data_ptr() + 64, 7, a.data_ptr()), 5),
                     (4, 2, 1, "stream", c.data_ptr())]


@pytest.mark.parametrize("change", ["shape", "stride", "dtype", "requires_grad", "none", "not none"])
def test_replay_refuses_another_layout(guard_kind, change):
    calls = []
    recorded = _tensors()
    if change == "not none":
        recorded = (recorded[0], recorded[1], None)
    tape = _record(recorded, calls)
    calls.clear()
    a, b, c = _tensors(seed=1)
    if change == "shape":
        b = torch.randn(33, 16)
    elif change == "stride":
        b = torch.randn(16, 32).t()
    elif change == "dtype":
        b = b.double()
    elif change == "requires_grad":
        b = b.requires_grad_(True)
    elif change == "none":
        c = None
    assert not tape.replay((a, b, c))
    assert calls == []


def test_replay_refuses_a_misaligned_pointer(guard_kind):
    calls = []
    tape = _record(_tensors(), calls)
    calls.clear()
    a, b, c = _tensors(seed=1)
    base = torch.randn(33 * 16 + 1)
    b_odd = base[1:].view(33, 16)[:32]  # same layout as b, 4 bytes off a 16-byte boundary
    assert b_odd.shape == b.shape and b_odd.stride() == b.stride() and b_odd.data_ptr() % 16
    assert not tape.replay((a, b_odd, c))
    assert calls == []


def test_replay_keeps_one_tensor_in_two_places(guard_kind):
    calls = []
    shared = torch.randn(32, 16)
    tape = Tape((torch.randn(8, 4, 16), shared, shared))
    with tape:
        tape._ops.append(_stand_in_launch(calls, [0, 0], [(0, -1, 1, 0, True), (1, -1, 0, 0, True)]))
    a, b, _ = _tensors(seed=1)
    assert not tape.replay((a, b, torch.randn(32, 16)))
    assert calls == []
    assert tape.replay((a, b, b))
    assert calls == [(4, 2, 1, "stream", b.data_ptr(), a.data_ptr())]


def test_tape_holds_no_reference_to_recorded_tensors(guard_kind):
    calls = []
    recorded = _tensors()
    refs = [weakref.ref(t) for t in recorded]
    tape = _record(recorded, calls)
    del recorded
    gc.collect()
    assert all(r() is None for r in refs)
    assert tape.replay(_tensors(seed=2))


def test_tapes_by_key_and_layout_oldest_dropped():
    calls = []
    tapes = Tapes(kept=2)
    small = _tensors()
    wide = (torch.randn(8, 4, 32), *_tensors()[1:])
    tapes.record("k", small, _recording(small, calls))
    assert "k" in tapes and len(tapes) == 1
    assert not tapes.replay("k", wide)  # same key, another layout: not recorded yet
    assert not tapes.replay("other", _tensors(seed=1))
    tapes.record("k", wide, _recording(wide, calls))
    calls.clear()
    assert tapes.replay("k", _tensors(seed=1)) and tapes.replay("k", wide)
    assert len(calls) == 4
    tapes.record("j", small, _recording(small, calls))
    assert len(tapes) == 2
    assert not tapes.replay("k", _tensors(seed=1))  # the least recently replayed (small under "k") was dropped
    assert tapes.replay("k", wide) and tapes.replay("j", _tensors(seed=3))
    assert not tapes.replay("k", (None, None, None))  # not tensors: falls back to the checked call


def test_replay_keeps_the_order_of_launches_and_cross_stream_waits(guard_kind):
    log = []

    class StandInEvent:  # torch.cuda.Event's record(stream) / wait(stream), without CUDA
        def record(self, stream):
            log.append(("record", stream))

        def wait(self, stream):
            log.append(("wait", stream))

    recorded = _tensors()
    tape = Tape(recorded)
    with tape:
        tape._ops.append(("side", "caller", StandInEvent()))  # the side stream waits for the caller's
        tape._ops.append(_stand_in_launch(log, [0], [(0, -1, 0, 0, True)]))
        tape._ops.append(("caller", "side", StandInEvent()))
    a, b, c = _tensors(seed=1)
    assert tape.replay((a, b, c))
    assert log == [("record", "caller"), ("wait", "side"), (4, 2, 1, "stream", a.data_ptr()),
                   ("record", "side"), ("wait", "caller")]


def test_tapes_try_the_most_recently_replayed_first():
    """Many layouts under one key (write_kv's token counts): a replay finds the layout in use
    with its first check, so the calls of one step do not scan every recorded layout."""
    tapes = Tapes(kept=8)
    calls = []
    layouts = [(torch.randn(n, 4, 16), torch.randn(32, 16), torch.randint(0, 9, (5,), dtype=torch.int32))
               for n in range(1, 7)]
    for bindables in layouts:
        tapes.record("k", bindables, _recording(bindables, calls))
    checked = []
    for tape in tapes._by_key["k"]:
        real = tape.replay
        tape.replay = lambda b, real=real, tape=tape: checked.append(tape) or real(b)
    assert tapes.replay("k", layouts[0])  # the first recorded: last in the list
    assert len(checked) == 6
    checked.clear()
    assert tapes.replay("k", layouts[0]) and len(checked) == 1


def test_replay_passes_a_workspace_as_its_address_and_keeps_it_alive(guard_kind):
    """A device tensor that is not the caller's (a plan's workspace) is passed as an int, which
    Triton's launcher uses as is (no data_ptr() call, no driver query per launch); the tape keeps
    the tensor alive so that its address stays valid."""
    calls = []
    workspace = torch.empty(16, device="meta")  # a tensor off the host, as a GPU workspace is
    ref = weakref.ref(workspace)
    recorded = _tensors()
    tape = Tape(recorded)
    with tape:
        tape._ops.append(_stand_in_launch(calls, [0, workspace, (3, workspace)], [(0, -1, 0, 0, True)]))
    del workspace
    gc.collect()
    assert ref() is not None
    a, b, c = _tensors(seed=1)
    assert tape.replay((a, b, c))
    assert calls == [(4, 2, 1, "stream", a.data_ptr(), ref().data_ptr(), (3, ref().data_ptr()))]
    assert all(type(x) is int for x in calls[0][5:6] + calls[0][6])


def test_capturing_neither_replays_a_tape_nor_keeps_one():
    """Inside ``capturing`` every launch is listed: a recorded tape is not replayed (its launches
    would bypass the list), and a recording made while capturing, which launched nothing and may
    hold only cross-stream waits, is not kept."""
    calls = []
    tapes = Tapes()
    bindables = _tensors()
    tapes.record("k", bindables, _recording(bindables, calls))
    with launching.capturing() as launched:
        assert not tapes.replay("k", bindables)
    assert calls == [] and launched == []
    assert tapes.replay("k", bindables)  # outside, the tape replays as before

    kernel, grid, kwargs = object(), (3,), {"x": 1}
    fresh = Tapes()

    def run():
        launching._RECORDING.get()._ops.append(("side", "caller", None))  # a wait, then a listed launch
        launching.launch(kernel, grid, **kwargs)

    with launching.capturing() as launched:
        fresh.record("k", bindables, run)
    assert launched == [(kernel, grid, kwargs)]
    assert "k" not in fresh


def test_compile_ahead_skips_what_it_cannot_or_need_not_compile(monkeypatch):
    """Only a JIT kernel whose ``CFG`` has the named fields at other values is compiled, with those
    fields replaced and every other argument as captured; on the interpreter nothing is."""
    from typing import NamedTuple

    from triton.runtime.jit import JITFunction

    class Cfg(NamedTuple):
        LARGE_CACHE: bool
        TILE_N: int

    compiled = []

    class StandIn(JITFunction):  # a JIT kernel's warmup without a compiler
        def __init__(self):
            pass

        def warmup(self, *, grid, **kwargs):
            compiled.append((grid, kwargs))

    kernel = StandIn()
    launched = [(kernel, (2, 1), {"CFG": Cfg(False, 64), "x": 7, "num_warps": 4}),
                (kernel, (2, 1), {"CFG": Cfg(True, 64)}),  # already the variant asked for
                (kernel, (1,), {"x": 3}),  # no CFG
                (object(), (1,), {"CFG": Cfg(False, 32)})]  # not a JIT kernel (the interpreter's)
    assert launching.compile_ahead(launched, LARGE_CACHE=True) == 1
    assert compiled == [((2, 1), {"CFG": Cfg(True, 64), "x": 7, "num_warps": 4})]
    assert launching.compile_ahead(launched, OTHER=1) == 0  # no such field
    for jobs in (1, 2):  # no field named: every JIT launch as captured, in one thread or two
        compiled.clear()
        assert launching.compile_ahead(launched, jobs=jobs) == 3
        assert compiled == [(grid, kwargs) for _, grid, kwargs in launched[:3]]


@pytest.mark.parametrize("kind", ["triton", "gluon"])
def test_replay_rebuilds_a_host_descriptor_over_the_new_tensor(guard_kind, kind):
    """A recorded host TMA descriptor over a caller's tensor is passed again over the replay's
    tensor: the same class, shape, strides, box and (Gluon's) shared layout, the new address."""
    cache = torch.randn(6, 16, 2, 64)
    if kind == "triton":
        from triton.tools.tensor_descriptor import TensorDescriptor

        desc = TensorDescriptor(cache, list(cache.shape), list(cache.stride()), [1, 16, 1, 64])
    else:
        gluon = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
        from triton.experimental.gluon import language as gl

        layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=4)
        desc = gluon.TensorDescriptor(cache, list(cache.shape), list(cache.stride()), [1, 16, 1, 64], layout)
    assert isinstance(desc, launching._descriptor_types())
    form = launching._DescriptorLayout.of(desc)
    calls = []
    tape = Tape((cache,))
    with tape:
        launching._RECORDING.get()._ops.append(_stand_in_launch(calls, [0, 3], [(0, -1, 0, 0, form)]))
    other = torch.randn(6, 16, 2, 64)
    assert tape.replay((other,)) is True
    (args,) = calls
    rebuilt = args[4]
    assert type(rebuilt) is type(desc) and rebuilt.base.data_ptr() == other.data_ptr() and args[5] == 3
    assert (rebuilt.shape, rebuilt.strides, rebuilt.block_shape, rebuilt.padding) == (
        desc.shape, desc.strides, desc.block_shape, desc.padding)
    assert getattr(rebuilt, "layout", None) == getattr(desc, "layout", None)

