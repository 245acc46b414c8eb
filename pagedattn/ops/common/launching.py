"""Kernel launches, and tapes that replay a call's launches through the compiled handles.

A launch through the JIT (``kernel[grid](**kwargs)``) binds every argument, computes the
specialization key and looks the compiled kernel up: 28-43 us on the H200 machine's CPU for a
kernel of ~45 arguments, where the compiled handle's own launcher takes about 8 us. Every
launcher launches through :func:`launch`; while a :class:`Tape` records (``with tape:``), each
launch and each cross-stream wait is kept with its compiled kernel, grid, stream and arguments
in signature order. A later call whose inputs have the same layout (the caller keys tapes by
shapes, strides, dtypes and scalars) replays the tape: it puts its tensors' addresses into the
recorded arguments and launches through the handles, skipping the JIT and the launchers.

What a replay may reuse: tensors that are not the caller's (plan workspaces, a device copy of a
float scale) stay as recorded, so they must be the same on every call with that key. A host
tensor descriptor over a caller's tensor is rebuilt over the replay's tensor with the recorded
shape and box. On the interpreter nothing is compiled, and a tape records nothing (``usable``
stays False).
"""

from __future__ import annotations

import contextvars

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

_RECORDING: contextvars.ContextVar = contextvars.ContextVar("pagedattn_tape", default=None)


def launch(kernel, grid, **kwargs):
    """``kernel[grid](**kwargs)``, recorded into the active tape if there is one."""
    compiled = kernel[grid](**kwargs)
    tape = _RECORDING.get()
    if tape is not None:
        tape._add_launch(kernel, grid, kwargs, compiled)
    return compiled


def record(tapes: dict, key, bindables, run, kept: int) -> None:
    """Run ``run()`` while a :class:`Tape` over ``bindables`` records it, and keep the tape under
    ``key`` in ``tapes`` (at most ``kept``, the oldest dropped first) if it can be replayed."""
    with Tape(bindables) as tape:
        run()
    if tape.usable:
        if len(tapes) >= kept:
            tapes.pop(next(iter(tapes)))
        tapes[key] = tape


def wait_stream(waiter: torch.cuda.Stream, waitee: torch.cuda.Stream) -> None:
    """``waiter.wait_stream(waitee)``, recorded into the active tape if there is one."""
    waiter.wait_stream(waitee)
    tape = _RECORDING.get()
    if tape is not None:
        # one event per wait, made now: torch's wait_stream creates an event on every call
        tape._ops.append((waiter, waitee, torch.cuda.Event()))


def _jit_function(kernel, kwargs: dict):
    """The JITFunction under ``kernel`` and the keyword arguments it receives (heuristics applied)."""
    from triton.runtime.autotuner import Heuristics
    from triton.runtime.jit import JITFunction

    kw = dict(kwargs)
    while not isinstance(kernel, JITFunction):
        if isinstance(kernel, Heuristics):
            for name, heur in kernel.values.items():
                kw[name] = heur(dict(kw))
        elif not hasattr(kernel, "fn"):
            return None, kw
        kernel = kernel.fn
    return kernel, kw


def _extent(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    span = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) + 1 if t.numel() else 0
    return start, start + span * t.element_size()


class Tape:
    """The launches of one call, replayable with other tensors of the same layout.

    ``bindables``: the call's own tensors (None where absent), in a fixed order; a recorded
    tensor argument inside one of them (itself or a view) is replayed at the same byte offset
    from the tensor in the same place of the replay's list."""

    def __init__(self, bindables):
        self._ranges = [None if t is None else _extent(t) for t in bindables]
        # one tensor passed as two arguments (cu_seqlens_q and cu_seqlens_k of a self-attention
        # prefill): recorded through the first, so a replay needs the same tensor in both places
        self._aliases = [(i, j) for i, a in enumerate(self._ranges) for j in range(i + 1, len(self._ranges))
                         if a is not None and a == self._ranges[j]]
        self._ops: list = []
        self.usable = True

    def __enter__(self):
        self._token = _RECORDING.set(self)
        return self

    def __exit__(self, *exc):
        _RECORDING.reset(self._token)
        if exc[0] is not None or not self._ops:
            self.usable = False
        # (bindable, byte offset) of every address that must stay 16-byte aligned, checked before
        # a replay launches anything
        self._aligned = tuple(sorted({a for op in self._ops if isinstance(op, _Launch) for a in op.aligned}))
        return False

    def _slot(self, t: torch.Tensor):
        """(index of the bindable holding ``t``, byte offset) or None; raises if ambiguous."""
        ptr = t.data_ptr()
        hits = [(i, ptr - r[0]) for i, r in enumerate(self._ranges) if r is not None and r[0] <= ptr < r[1]]
        if len(hits) > 1:  # overlapping caller tensors (e.g. K and V interleaved in one buffer)
            exact = [h for h in hits if h[1] == 0]
            if len(exact) > 1 and all(self._ranges[i] == self._ranges[exact[0][0]] for i, _ in exact):
                return exact[0]  # one tensor in several places (``_aliases``)
            if len(exact) != 1:
                raise _NotReplayable
            return exact[0]
        return hits[0] if hits else None

    def _add_launch(self, kernel, grid, kwargs, compiled):
        from triton.compiler import CompiledKernel

        if not self.usable:
            return
        jit, kw = _jit_function(kernel, kwargs)
        if jit is None or not isinstance(compiled, CompiledKernel):
            self.usable = False  # the interpreter, or a wrapper this tape does not know
            return
        values = []
        for p in jit.params:
            if p.name in kw:
                values.append(kw[p.name])
            elif p.has_default:
                values.append(p.default)
            else:
                self.usable = False
                return
        # a slot: (argument, member of a tuple argument or -1, bindable, byte offset, form); the form
        # is a bool for a pointer (whether it was compiled as 16-byte aligned) or the
        # _DescriptorLayout of a tensor descriptor rebuilt at each replay
        slots = []
        try:
            for i, (p, v) in enumerate(zip(jit.params, values)):
                if p.is_constexpr:
                    continue
                members = v if isinstance(v, tuple) else (v,)
                for j, m in enumerate(members):
                    if isinstance(m, TensorDescriptor):  # rebuilt over the replay's tensor
                        s = self._slot(m.base)
                        if s is None:
                            raise _NotReplayable
                        slots.append((i, j if isinstance(v, tuple) else -1, s[0], s[1],
                                      _DescriptorLayout(m.base.dtype, m.shape, m.strides, m.block_shape, m.padding)))
                    elif isinstance(m, torch.Tensor):
                        s = self._slot(m)
                        if s is not None:
                            # a 16-byte aligned pointer was compiled as such: a replay must keep it
                            aligned = m.data_ptr() % 16 == 0 and not p.do_not_specialize_on_alignment
                            slots.append((i, j if isinstance(v, tuple) else -1, s[0], s[1], aligned))
                    elif not isinstance(m, (int, float, bool, type(None))):
                        raise _NotReplayable  # other objects built per call
        except _NotReplayable:
            self.usable = False
            return
        for i, j, *_ in slots:  # keep no reference to the recorded call's own tensors
            if j < 0:
                values[i] = 0
            else:
                values[i] = tuple(0 if k == j else m for k, m in enumerate(values[i]))
        g = grid if isinstance(grid, tuple) else tuple(grid)
        g = (g + (1, 1))[:3]
        from triton.runtime.driver import driver

        stream = driver.active.get_current_stream(driver.active.get_current_device())
        self._ops.append(_Launch(compiled, g, stream, values, slots))

    def replay(self, bindables) -> bool:
        """Launch the recorded work with ``bindables`` in place of the recorded tensors; False
        (nothing launched) if a tensor's alignment differs from the recording's."""
        ptrs = [0 if t is None else t.data_ptr() for t in bindables]
        for i, j in self._aliases:
            if ptrs[i] != ptrs[j]:
                return False  # recorded through one tensor in both places: re-record
        for b, off in self._aligned:
            if (ptrs[b] + off) & 15:
                return False  # compiled for 16-byte aligned pointers: re-record instead
        for op in self._ops:
            if op.__class__ is _Launch:
                args = op.values.copy()
                for i, b, off in op.pointers:
                    args[i] = ptrs[b] + off
                if op.others:
                    op.bind_others(args, ptrs)
                op.call(*op.prefix, *args)
            else:
                waiter, waitee, event = op
                event.record(waitee)
                waiter.wait_event(event)
        return True


class _NotReplayable(Exception):
    pass


class _Address:
    """A device address where Triton's launcher expects a tensor (it reads ``data_ptr()``)."""

    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self.ptr = ptr
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.ptr


class _DescriptorLayout:
    """A host tensor descriptor's layout, recorded; ``over(ptr)`` is the same descriptor over the
    tensor at ``ptr``, which the launcher encodes into a TMA descriptor at each launch, as it does
    for descriptors built per call."""

    __slots__ = ("dtype", "shape", "strides", "block_shape", "padding")

    def __init__(self, dtype, shape, strides, block_shape, padding):
        self.dtype, self.shape, self.strides = dtype, list(shape), list(strides)
        self.block_shape, self.padding = list(block_shape), padding

    def over(self, ptr: int):
        desc = object.__new__(TensorDescriptor)  # the checks of __post_init__ passed when recorded
        desc.base, desc.shape, desc.strides = _Address(ptr, self.dtype), self.shape, self.strides
        desc.block_shape, desc.padding = self.block_shape, self.padding
        return desc


class _Launch:
    """One recorded launch: ``call(*prefix, *args)`` launches it.

    Through Triton 3.6's CUDA launcher the call goes to its compiled ``launch`` function directly
    when the kernel needs no scratch memory and no tensor descriptors (the launcher's Python
    wrapper only allocates those): one Python frame less per launch. Otherwise, and on other
    backends, through the launcher as the JIT calls it.

    The slots are split for the replay: ``pointers`` (argument, bindable, byte offset), the plain
    pointer arguments set by one assignment each; ``others``, members of tuple arguments and
    tensor descriptors; ``aligned``, the (bindable, byte offset) pairs compiled as 16-byte aligned.
    """

    __slots__ = ("call", "prefix", "values", "pointers", "others", "aligned")

    def __init__(self, compiled, grid, stream, values, slots):
        launcher = compiled.run  # initializes the module's handles once
        tail = (compiled.packed_metadata, None, None, None)  # launch metadata and hooks: none
        raw = getattr(launcher, "launch", None)
        direct = (raw is not None and type(raw).__name__ == "builtin_function_or_method"
                  and getattr(launcher, "global_scratch_size", 1) == 0
                  and getattr(launcher, "profile_scratch_size", 1) == 0)
        if direct:
            self.call = raw
            self.prefix = (*grid, stream, compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl,
                           None, None, *tail)
        else:
            self.call = launcher
            self.prefix = (*grid, stream, compiled.function, *tail)
        self.values = values
        self.pointers = [(i, b, off) for i, j, b, off, form in slots if j < 0 and form.__class__ is bool]
        self.others = [s for s in slots if s[1] >= 0 or s[4].__class__ is not bool]
        self.aligned = [(b, off) for _, _, b, off, form in slots if form is not False]

    def bind_others(self, args: list, ptrs: list) -> None:
        """Put the bound addresses into tuple members and rebuilt tensor descriptors."""
        for i, j, b, off, form in self.others:
            ptr = ptrs[b] + off
            if isinstance(form, _DescriptorLayout):  # a tensor descriptor over the bound tensor
                ptr = form.over(ptr)
            if j < 0:
                args[i] = ptr
            else:
                members = list(args[i])
                members[j] = ptr
                args[i] = tuple(members)
