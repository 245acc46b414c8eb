"""Kernel launches, and tapes that replay a call's launches through the compiled handles.

A launch through the JIT (``kernel[grid](**kwargs)``) binds every argument, computes the
specialization key and looks the compiled kernel up: 28-43 us on the H200 machine's CPU for a
kernel of ~45 arguments, where the compiled handle's own launcher takes about 8 us. Every
launcher launches through :func:`launch`; while a :class:`Tape` records (``with tape:``), each
launch and each cross-stream wait is kept with its compiled kernel, grid, stream and arguments
in signature order. A later call with the same scalars (the caller's key: sizes, flags, the
stream) and tensors of the same layout (dtype, device, shape, strides, ``requires_grad``, which
of them are None) replays the tape: it puts its tensors' addresses into the recorded arguments
and launches through the handles, skipping the JIT and the launchers' Python.

A tape's replay is a Python function generated for it when the recording ends: the recorded
arguments are constants, each tensor address one addition, and the layout check one call of
torch's C++ tensor guard (the check Dynamo uses; about 1 us for 8 tensors where reading shape,
strides, dtype and device in Python took 5-8 us on the H200 machine). Where that guard is
missing, the generated code compares the layouts in Python.

What a replay may reuse: tensors that are not the caller's (plan workspaces, a device copy of a
float scale) stay as recorded (passed as their addresses, the tape keeping them alive), so they
must be the same on every call with that key. A host tensor descriptor (Triton's, or Gluon's
with its box's shared layout) over a caller's tensor is rebuilt over the replay's tensor with the
recorded shape and box. On the interpreter nothing is compiled, and a tape records nothing
(``usable`` stays False).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

_RECORDING: contextvars.ContextVar = contextvars.ContextVar("pagedattn_tape", default=None)
_CAPTURING: contextvars.ContextVar = contextvars.ContextVar("pagedattn_capture", default=None)


def launch(kernel, grid, **kwargs):
    """``kernel[grid](**kwargs)``, recorded into the active tape if there is one; inside
    :func:`capturing`, only listed (nothing launched)."""
    captured = _CAPTURING.get()
    if captured is not None:
        captured.append((kernel, grid, kwargs))
        tape = _RECORDING.get()
        if tape is not None:  # nothing was launched: a replay of this recording would launch nothing
            tape.usable = False
        return None
    compiled = kernel[grid](**kwargs)
    tape = _RECORDING.get()
    if tape is not None:
        tape._add_launch(kernel, grid, kwargs, compiled)
    return compiled


@contextlib.contextmanager
def capturing():
    """Inside the block every :func:`launch` appends ``(kernel, grid, kwargs)`` to the yielded
    list instead of launching: the exact arguments the launchers build, for compiling them
    for a GPU that is not here (pagedattn.compile_matrix)."""
    launched: list = []
    token = _CAPTURING.set(launched)
    try:
        yield launched
    finally:
        _CAPTURING.reset(token)


def compile_ahead(launched: list, *, jobs: int = 1, **cfg_fields) -> int:
    """Compile each captured launch ``(kernel, grid, kwargs)`` (from :func:`capturing`), launching
    nothing; returns how many were compiled. With fields named, each launch is compiled with those
    fields of its ``CFG`` set to the values given, and a launch whose ``CFG`` lacks a field or
    already has the values is skipped; with none, each as captured. Every launch on the
    interpreter (nothing compiles there) is skipped.

    For variants that a scratch call cannot reach: a warm-up on a small cache compiles the kernels
    with 32-bit offsets, and ``compile_ahead(launched, LARGE_CACHE=True)`` the ones that a cache of
    2**31 elements or more takes. Triton keys a compiled kernel on its constexprs and its
    arguments' alignment, so a later launch whose other arguments match finds it.

    ``jobs`` > 1 compiles in that many threads (Triton's ``AsyncCompileMode``); Triton's compiler
    lets go of the GIL for most of its work: 13 sm90 kernels compiled in 7.8 s one at a time and
    4.6 s in 2 threads on 2 cores."""
    todo = []
    for kernel, grid, kwargs in launched:
        fn, kw = _jit_function(kernel, kwargs)
        if fn is None:
            continue
        if cfg_fields:
            cfg = kw.get("CFG")
            if not hasattr(cfg, "_replace") or not all(hasattr(cfg, f) for f in cfg_fields):
                continue
            if all(getattr(cfg, f) == value for f, value in cfg_fields.items()):
                continue
            kw = {**kw, "CFG": cfg._replace(**cfg_fields)}
        todo.append((fn, grid, kw))
    threads = min(jobs, len(todo))
    with _compiling_in_threads(threads) if threads > 1 else contextlib.nullcontext():
        for fn, grid, kw in todo:
            fn.warmup(grid=grid, **kw)
    return len(todo)


@contextlib.contextmanager
def _compiling_in_threads(threads: int):
    """Inside the block a JIT kernel's ``warmup`` hands its compile to one of ``threads`` threads
    (Triton's ``AsyncCompileMode``); leaving it waits for every compile."""
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime._async_compile import AsyncCompileMode

    with ThreadPoolExecutor(threads) as pool, AsyncCompileMode(pool):
        yield


def call_context(t: torch.Tensor) -> tuple:
    """What every caller's key holds besides its scalars: the device of ``t`` (a CUDA tensor),
    its current stream and whether grad mode is on."""
    dev = t.get_device()
    return dev, torch._C._cuda_getCurrentRawStream(dev), torch.is_grad_enabled()


def scalar_or_tensor(x):
    """A scale argument in a key: the number itself, or "tensor" (its layout is the tape's)."""
    return "tensor" if isinstance(x, torch.Tensor) else x


class Tapes:
    """The tapes of one call site (or one plan): up to ``kept``, by the caller's key; under one
    key, one tape per layout of the call's tensors, the most recently replayed first (the layers
    of one step share a layout: after the first, each call's first check hits). When full, the
    least recently replayed tape of the oldest key is dropped."""

    def __init__(self, kept: int = 64):
        self._kept = kept
        self._by_key: dict = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, key) -> bool:
        return key in self._by_key

    def clear(self) -> None:
        self._by_key.clear()
        self._count = 0

    def replay(self, key, bindables) -> bool:
        """Replay the tape recorded under ``key`` for ``bindables``' layout; False (nothing
        launched) if there is none, or if its pointers' alignment differs from the recording's."""
        if _CAPTURING.get() is not None:  # capturing lists launches: a replay would bypass the list
            return False
        entries = self._by_key.get(key, ())
        for i, tape in enumerate(entries):
            try:
                if tape.replay(bindables):
                    if i:
                        entries.insert(0, entries.pop(i))
                    return True
            except (AttributeError, TypeError):  # not tensors where tensors were recorded
                return False
        return False

    def record(self, key, bindables, run) -> None:
        """Run ``run()`` while a :class:`Tape` over ``bindables`` records it, and keep the tape
        under ``key`` if it can be replayed."""
        with Tape(bindables) as tape:
            run()
        if not tape.usable:
            return
        if self._count >= self._kept:
            oldest = next(iter(self._by_key))
            entries = self._by_key[oldest]
            entries.pop()
            if not entries:
                del self._by_key[oldest]
            self._count -= 1
        self._by_key.setdefault(key, []).insert(0, tape)
        self._count += 1


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
        self._layouts = [None if t is None else _layout(t) for t in bindables]
        self._guard = _layout_guard([t for t in bindables if t is not None])
        self._ops: list = []
        self.usable = True

    def __enter__(self):
        self._token = _RECORDING.set(self)
        return self

    def __exit__(self, *exc):
        _RECORDING.reset(self._token)
        if exc[0] is not None or not self._ops:
            self.usable = False
        if self.usable:
            self.replay = _compile_replay(self._layouts, self._guard, self._aliases, self._ops)
        return False

    def replay(self, bindables) -> bool:
        """Launch the recorded work with ``bindables`` in place of the recorded tensors; falsy
        (nothing launched) if their layout or a pointer's alignment differs from the recording's.
        (Replaced by the function generated when the recording ends.)"""
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
                    if isinstance(m, _descriptor_types()):  # rebuilt over the replay's tensor
                        s = self._slot(m.base)
                        if s is None:
                            raise _NotReplayable
                        slots.append((i, j if isinstance(v, tuple) else -1, s[0], s[1], _DescriptorLayout.of(m)))
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


@functools.lru_cache(maxsize=None)
def _descriptor_types() -> tuple:
    """The host tensor descriptor classes a tape rebuilds: Triton's, and Gluon's (which also
    carries the shared-memory layout of its box) where this Triton has Gluon."""
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    except ImportError:
        return (TensorDescriptor,)
    return (TensorDescriptor, GluonTensorDescriptor)


class _DescriptorLayout:
    """A host tensor descriptor's layout, recorded; ``over(ptr)`` is the same descriptor (of the
    same class; a Gluon one keeps its box's shared layout) over the tensor at ``ptr``, which the
    launcher encodes into a TMA descriptor at each launch, as it does for descriptors built per
    call."""

    __slots__ = ("cls", "dtype", "shape", "strides", "block_shape", "padding", "layout")

    def __init__(self, dtype, shape, strides, block_shape, padding, cls=TensorDescriptor, layout=None):
        self.cls, self.dtype, self.shape, self.strides = cls, dtype, list(shape), list(strides)
        self.block_shape, self.padding, self.layout = list(block_shape), padding, layout

    @classmethod
    def of(cls, desc) -> "_DescriptorLayout":
        return cls(desc.base.dtype, desc.shape, desc.strides, desc.block_shape, desc.padding, type(desc),
                   getattr(desc, "layout", None))

    def over(self, ptr: int):
        desc = object.__new__(self.cls)  # the checks of __post_init__ passed when recorded
        desc.base, desc.shape, desc.strides = _Address(ptr, self.dtype), self.shape, self.strides
        desc.block_shape, desc.padding = self.block_shape, self.padding
        if self.layout is not None:
            desc.layout = self.layout
        return desc


class _Launch:
    """One recorded launch: ``call(*prefix, *args)`` launches it.

    Through Triton 3.6's CUDA launcher the call goes to its compiled ``launch`` function directly
    when the kernel needs no scratch memory and no tensor descriptors (the launcher's Python
    wrapper only allocates those): one Python frame less per launch. Otherwise, and on other
    backends, through the launcher as the JIT calls it.
    """

    __slots__ = ("call", "prefix", "values", "slots")

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
        self.slots = slots


def _layout(t: torch.Tensor) -> tuple:
    return (t.dtype, t.get_device(), t.shape, t.stride(), t.requires_grad)


def _layout_of(x) -> tuple | None:
    """``_layout`` of a tensor; None for anything else (the replay then finds no match)."""
    return _layout(x) if isinstance(x, torch.Tensor) else None


def _layout_guard(tensors: list):
    """A function of ``len(tensors)`` tensors: whether they have the layouts (dtype, device,
    shape, strides, requires_grad, dispatch keys) of ``tensors``. Torch's C++ tensor guard where
    it exists (it keeps sizes and strides, not the tensors: a tape holds no caller's memory);
    else None."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        guard = TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None).check
        if guard(*tensors):
            return guard
    except Exception:  # noqa: BLE001 - another torch: the generated code compares in Python
        pass
    return None


def _compile_replay(layouts: list, guard, aliases: list, ops: list):
    """The replay function of a tape (see the module docstring): ``replay(bindables)`` checks
    that the tensors in ``bindables`` have the recorded layouts (None where None was recorded),
    that tensors recorded as one are one and that pointers compiled as 16-byte aligned still
    are, and returns None / False if not; else launches the recorded work and returns True.
    ``guard``: :func:`_layout_guard` of the recorded tensors that were not None, or None."""
    consts: dict = {}
    kept: list = []  # the tensors whose addresses are constants: alive while the tape is
    consts["kept"] = kept

    def const(value) -> str:
        name = f"c{len(consts)}"
        consts[name] = value
        return name

    n = len(layouts)
    names = [f"b{i}" for i in range(n)]
    present = [i for i in range(n) if layouts[i] is not None]
    lines = ["def replay(bindables):", f"    {', '.join(names)}, = bindables"]
    absent = [f"{names[i]} is not None" for i in range(n) if layouts[i] is None]
    if absent:
        lines.append(f"    if {' or '.join(absent)}: return None")
    if present:
        args = ", ".join(names[i] for i in present)
        if guard is not None:
            lines.append(f"    if not {const(guard)}({args}): return None")
        else:
            layout = const(_layout_of)
            recorded = const(tuple(layouts[i] for i in present))
            lines.append(f"    if ({', '.join(f'{layout}({names[i]})' for i in present)},) != {recorded}: return None")

    used = sorted({s[2] for op in ops if isinstance(op, _Launch) for s in op.slots} | {i for a in aliases for i in a})
    for i in used:
        lines.append(f"    p{i} = {names[i]}.data_ptr()")
    for i, j in aliases:
        lines.append(f"    if p{i} != p{j}: return False")
    aligned = sorted({(b, off) for op in ops if isinstance(op, _Launch) for _, _, b, off, form in op.slots
                      if form is not False})  # aligned pointers and descriptor bases
    if aligned:
        lines.append(f"    if {' or '.join(f'({_address(b, off)}) & 15' for b, off in aligned)}: return False")

    for op in ops:
        if not isinstance(op, _Launch):
            waiter, waitee, event = op
            # the event's own C methods: torch.cuda.Event.record / Stream.wait_event are Python
            # wrappers around them (three frames a wait)
            base = super(torch.cuda.Event, event) if isinstance(event, torch.cuda.Event) else event
            lines.append(f"    {const(base.record)}({const(waitee)}); {const(base.wait)}({const(waiter)})")
            continue
        by_arg: dict = {}
        for i, j, b, off, form in op.slots:
            expr = _address(b, off)
            if isinstance(form, _DescriptorLayout):  # a tensor descriptor over the bound tensor
                expr = f"{const(form)}.over({expr})"
            by_arg.setdefault(i, {})[j] = expr
        args = []
        for i, value in enumerate(op.values):
            fills = by_arg.get(i)
            if fills is None:
                args.append(const(_fixed(value, kept)))
            elif -1 in fills:
                args.append(fills[-1])
            else:
                members = [fills.get(j) or const(_fixed(m, kept)) for j, m in enumerate(value)]
                args.append(f"({', '.join(members)},)")
        lines.append(f"    {const(op.call)}(*{const(op.prefix)}, {', '.join(args)})")
    lines.append("    return True")
    source = "\n".join(lines)
    code = _REPLAY_CODE.get(source)
    if code is None:  # compiling takes ~0.4 ms; tapes of one call path share their source
        if len(_REPLAY_CODE) >= 256:
            _REPLAY_CODE.pop(next(iter(_REPLAY_CODE)))
        code = _REPLAY_CODE[source] = compile(source, "<pagedattn tape replay>", "exec")
    namespace = dict(consts)
    exec(code, namespace)  # noqa: S102 - our own source; defines replay() over the constants
    return namespace["replay"]


_REPLAY_CODE: dict = {}  # generated source -> its compiled code


def _fixed(value, kept: list):
    """A recorded argument as a replay passes it: a tensor that is not the caller's (a plan's
    workspace) as its address, the rest as recorded. Triton's launcher takes an int as a device
    address as is; for a tensor it calls ``data_ptr()`` and asks the driver whether the address is
    a device's (``cuPointerGetAttribute``), per tensor argument and launch. A recorded tensor keeps
    its address while it lives (a plan updates its buffers in place), and ``kept`` keeps it alive."""
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        kept.append(value)
        return value.data_ptr()
    if isinstance(value, tuple) and any(isinstance(m, torch.Tensor) for m in value):
        return tuple(_fixed(m, kept) for m in value)
    return value


def _address(b: int, off: int) -> str:
    return f"p{b} + {off}" if off else f"p{b}"
