"""pagedattn check --compile: every kernel variant the planner can launch, compiled for GPUs
that are not here, with what each compiler made of it.

Triton compiles for any of its targets without a device (``triton.compile`` of an ``ASTSource``
for a ``GPUTarget``; ptxas and the AMD linker ship with it). Each variant calls the public
function (``paged_attention`` with a plan for one path, ``varlen_attention``, ``write_kv``,
``merge_attention_states``, ``mla_decode``, ``write_mla_kv``) on CPU tensors while the planner
plans for the target (``targeting``) and the launches are captured (``capturing``): the kernels
are compiled with exactly the arguments, tiles and options the launchers build on that GPU,
specialized as Triton's launcher would (16-byte aligned pointers, strides that are multiples of
16, the per-batch sizes left alone).

Per kernel and target the table gives registers (VGPRs and SGPRs on AMD, from the code object's
metadata; NVIDIA from ``cuobjdump -res-usage`` of the cubin), spills (NVIDIA: the spill stores
``ptxas -v`` reports, asked when the cubin has a stack frame or local memory; AMD:
``.vgpr_spill_count``, while SGPR spills, which go to VGPR lanes, are listed apart), shared
memory (LDS) against the target's limit, and the programs one SM holds (NVIDIA, from
registers, shared memory and threads) or the waves per SIMD the AMD compiler reports. A
compile error, a spill sm90 does not have, or shared memory over the limit fails the row
(``judge``).

Nothing here runs a kernel: only the H200 and Triton's CPU interpreter run them (docs/portability.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

TARGETS = ("sm80", "sm90", "sm100", "sm120", "gfx942", "gfx950", "gfx1100")
HEADS = dict(num_q_heads=32, num_kv_heads=8)  # Llama-3.1-8B: 4 query heads per KV head


@dataclass(frozen=True)
class Variant:
    """One call whose launches are compiled.

    ``family``: decode (the unified 2D kernel at one query), split_kv, persistent, spec (the
    unified kernel at 4 queries), prefill (the large-tile kernel over the paged cache, long
    extends), prefill_short (its 64-row tiles), varlen (contiguous K/V: the tensor-descriptor
    loads on sm90+), kv_write, merge, mla (decode, one wave: no split), mla_split (a small batch:
    keys split, then merged), mla_kv_write; and the Gluon kernels for sm90 only, mla_gluon (MLA
    decode) and prefill_gluon (paged causal prefill), compiled with their launchers' default
    tiles (other targets show "sm90 only": the portable kernels serve them). ``feature``: "+"-joined names of
    ``pagedattn.testing.FEATURES``. ``ci``: in the subset CI compiles for every target.
    """

    family: str
    head_size: int = 128
    page_size: int = 16
    dtype: str = "bf16"
    kv_fp8: bool = False
    feature: str = ""
    ci: bool = False

    @property
    def name(self) -> str:
        parts = [self.family]
        if self.family not in ("merge", "mla", "mla_split", "mla_kv_write", "mla_gluon"):
            parts.append(f"d{self.head_size}")
        if self.family not in ("merge", "varlen"):
            parts.append(f"p{self.page_size}")
        parts.append(self.dtype + ("/fp8" if self.kv_fp8 else ""))
        if self.feature:
            parts.append(self.feature)
        return " ".join(parts)


MODIFIERS = ("window", "softcap", "alibi", "alibi_sqrt", "sinks", "prefix")


def variants(full: bool = True) -> list[Variant]:
    """The variants of the matrix (``full=False``: the CI subset, marked ``ci``).

    Full: the decode, split-KV, persistent and prefill paths at head sizes 64, 96 (not a power
    of 2), 128 and 256 and pages of 16 and 64; each score modifier on the decode and prefill
    kernels, and all at once; an fp8 cache on every attention path; fp16 and fp32; the
    contiguous prefill; the KV writes, the merge and MLA. The CI subset keeps one of each kernel
    and mode: every path at head 128, head 256 on every path, head 96 on decode and (with every
    modifier and 64-token pages) on prefill, all modifiers at once on decode too, ALiBi in both
    forms, fp8 and fp32 once, and the shapes where a target's compiler spilled at sm90's choices
    before the planner fitted them (head 256 on the decode-family kernels, the persistent kernel
    on 64-token pages, linear ALiBi on decode).
    """
    out: list[Variant] = []
    ci_shapes = {("decode", 96, 16), ("decode", 256, 16), ("prefill", 256, 16), ("split_kv", 256, 64),
                 ("persistent", 256, 64), ("persistent", 128, 64),
                 ("split_kv", 128, 16), ("persistent", 128, 16), ("decode", 128, 16), ("prefill", 128, 16)}
    for family in ("decode", "split_kv", "persistent", "prefill"):
        for head in (64, 96, 128, 256):
            for page in (16, 64):
                out.append(Variant(family, head, page, ci=(family, head, page) in ci_shapes))
    every = "+".join(m for m in MODIFIERS if m != "alibi_sqrt")
    for family in ("decode", "prefill"):
        for mod in MODIFIERS:
            out.append(Variant(family, feature=mod, ci=mod == "alibi_sqrt" or (family, mod) == ("decode", "alibi")))
        out.append(Variant(family, feature=every, ci=family == "decode"))
    # every modifier at once on the prefill kernel at a head that is not a power of 2, on 64-token pages
    out.append(Variant("prefill", 96, 64, feature=every, ci=True))
    out += [Variant("split_kv", feature="sinks"), Variant("persistent", feature="window"),
            Variant("spec", ci=True), Variant("prefill_short", ci=True)]
    for family in ("decode", "split_kv", "persistent", "prefill"):
        out.append(Variant(family, kv_fp8=True, ci=family in ("decode", "prefill")))
    for dtype in ("fp16", "fp32"):
        out += [Variant("decode", dtype=dtype, ci=dtype == "fp32"), Variant("prefill", dtype=dtype, ci=dtype == "fp32")]
    out += [Variant("varlen", head, ci=head == 128) for head in (64, 128, 256)]
    out += [Variant("kv_write", ci=True), Variant("kv_write", kv_fp8=True), Variant("kv_write", 96, 64),
            Variant("merge", ci=True), Variant("mla", ci=True), Variant("mla_split", ci=True),
            Variant("mla", kv_fp8=True, ci=True), Variant("mla_kv_write", ci=True)]
    # every Gluon variant the planner can choose on sm90, each in CI (nine more sm90 kernels, ~15 s
    # on 2 cores): each page size and head size it serves compiles apart, as do both dtypes, the
    # score modifiers and a call without lse (``no_lse``: vLLM's prefill and decode calls);
    # ``split``: MLA decode cut into key segments (partials, then the merge)
    out += [Variant("mla_gluon", ci=True), Variant("mla_gluon", page_size=64, ci=True),
            Variant("mla_gluon", dtype="fp16", ci=True), Variant("mla_gluon", feature="no_lse", ci=True),
            Variant("mla_gluon", feature="split", ci=True),
            Variant("prefill_gluon", ci=True), Variant("prefill_gluon", page_size=64, ci=True),
            Variant("prefill_gluon", 64, ci=True), Variant("prefill_gluon", 256, ci=True),
            Variant("prefill_gluon", dtype="fp16", ci=True), Variant("prefill_gluon", feature="modifiers", ci=True),
            Variant("prefill_gluon", feature="no_lse", ci=True)]
    return out if full else [v for v in out if v.ci]


GLUON_FAMILIES = ("mla_gluon", "prefill_gluon")
GLUON_TARGETS = ("sm90",)  # the Gluon kernels use sm90's wgmma and setmaxnreg


# ---------------------------------------------------------------------------------------------
# Capturing the launches of one call


def _dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _call(v: Variant) -> None:
    """Make ``v``'s call on CPU tensors (launches captured by the caller)."""
    import torch

    import pagedattn
    from pagedattn.mla import mla_decode, write_mla_kv
    from pagedattn.plan import plan_attention
    from pagedattn.testing import feature_kwargs

    g = torch.Generator().manual_seed(0)
    dt = _dtype(v.dtype)
    fp8 = torch.float8_e4m3fn
    hq, hk, d, page = HEADS["num_q_heads"], HEADS["num_kv_heads"], v.head_size, v.page_size
    blocks = 1024  # a cache under 2**31 elements: the int32 offsets of every real-size cache
    if v.family in ("mla", "mla_split"):
        batch = 32 if v.family == "mla" else 1
        cache = torch.empty(blocks, page, 576, dtype=fp8 if v.kv_fp8 else dt)
        mla_decode(torch.empty(batch, 128, 512, dtype=dt), torch.empty(batch, 128, 64, dtype=dt), cache,
                   torch.zeros(batch, 256, dtype=torch.int32), torch.full((batch,), 4096, dtype=torch.int32),
                   torch.arange(batch + 1, dtype=torch.int32), scale=0.1, max_query_len=1, max_seq_len=4096,
                   kv_scale=1.0 if v.kv_fp8 else None)
        return
    if v.family in GLUON_FAMILIES:
        gluon_call(v.family, page_size=page, dtype=dt, head_size=d, modifiers=v.feature == "modifiers",
                   return_lse=v.feature != "no_lse", num_splits=4 if v.feature == "split" else 1)
        return
    if v.family == "mla_kv_write":
        write_mla_kv(torch.empty(64, 512, dtype=dt), torch.empty(64, 64, dtype=dt),
                     torch.empty(blocks, page, 576, dtype=fp8 if v.kv_fp8 else dt), torch.zeros(64, dtype=torch.int64))
        return
    if v.family == "merge":
        t = 64
        pagedattn.merge_attention_states(torch.empty(t, hq, d, dtype=dt), torch.zeros(t, hq),
                                         torch.empty(t, hq, d, dtype=dt), torch.zeros(t, hq))
        return
    cache_dt = fp8 if v.kv_fp8 else dt
    k_cache = torch.empty(blocks, page, hk, d, dtype=cache_dt)
    v_cache = torch.empty_like(k_cache)
    scales = dict(k_scale=1.0, v_scale=1.0) if v.kv_fp8 else {}
    if v.family == "kv_write":
        pagedattn.write_kv(torch.empty(64, hk, d, dtype=dt), torch.empty(64, hk, d, dtype=dt), k_cache, v_cache,
                           torch.zeros(64, dtype=torch.int64), **scales)
        return
    if v.family == "varlen":
        q = torch.empty(1024, hq, d, dtype=dt)
        k = torch.empty(1024, hk, d, dtype=dt)
        cu = torch.tensor([0, 512, 1024], dtype=torch.int32)
        pagedattn.varlen_attention(q, k, torch.empty_like(k), cu, cu, max_query_len=512)
        return
    # (query_len, seq_len) per sequence and the path that the plan is made for
    cases, path, splits = {
        "decode": ([(1, 4096)] * 8, "unified", None),
        "spec": ([(4, 4096)] * 8, "unified", None),
        "split_kv": ([(1, 4096)] * 8, "split_kv", 8),
        "persistent": ([(1, 4096)] * 8, "persistent", None),
        # an extend over a long context: programs of equal work, the 128-row tiles
        "prefill": ([(256, 8192)] * 8, "prefill", None),
        # a short causal prefill: the triangle's last wave, the 64-row tiles at heads 65-128
        "prefill_short": ([(512, 512)] * 2, "prefill", None),
    }[v.family]
    qsl = [0]
    for ql, _ in cases:
        qsl.append(qsl[-1] + ql)
    lens = [kv for _, kv in cases]
    plan = plan_attention(qsl, lens, head_size=d, device="cpu", path=path, num_splits=splits, dtype=dt, **HEADS)
    features = {}
    for part in filter(None, v.feature.split("+")):
        features.update(feature_kwargs(part, hq, len(cases), generator=g))
    max_pages = -(-max(lens) // page)
    pagedattn.paged_attention(torch.empty(qsl[-1], hq, d, dtype=dt), k_cache, v_cache,
                              torch.zeros(len(cases), max_pages, dtype=torch.int32),
                              torch.tensor(lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),
                              plan=plan, **features, **scales)


def gluon_call(family: str, *, page_size: int = 16, dtype=None, head_size: int = 128, config=None,
                num_splits: int = 1, return_lse: bool = True, modifiers: bool = False) -> None:
    """A Gluon kernel's launch through its launcher on CPU tensors (its own default ``config``
    unless given): ``mla_gluon`` for 128 heads of 512 + 64, ``prefill_gluon`` for two 150-token
    causal prefills at 32 / 8 heads (``modifiers``: with every score modifier it computes, a
    window, a softcap, ALiBi, sinks and prefix ranges)."""
    import torch

    dtype = dtype or torch.bfloat16
    if family == "mla_gluon":
        from pagedattn.ops.mla.launch import MLAInputs
        from pagedattn.ops.mla_gluon.launch import GLUON_MLA_CONFIG, launch_mla_decode_gluon
        from pagedattn.plan.workspace import split_partials

        seqs, heads = 2, 128
        q = torch.zeros(seqs, heads, 576, dtype=dtype)
        partials = dict(partial_out=None, partial_lse=None)
        if num_splits > 1:
            partial_out, partial_lse = split_partials(seqs, heads, num_splits, 512, "cpu")  # as mla_decode makes them
            partials = dict(partial_out=partial_out, partial_lse=partial_lse)
        launch_mla_decode_gluon(torch.empty(seqs, heads, 512, dtype=dtype),
                                torch.empty(seqs, heads) if return_lse else None,
                                MLAInputs(q[..., :512], q[..., 512:], torch.zeros(8, page_size, 576, dtype=dtype),
                                          torch.zeros(seqs, 4, dtype=torch.int32), torch.ones(seqs, dtype=torch.int32),
                                          torch.arange(seqs + 1, dtype=torch.int32)),
                                scale=0.07, config=config or GLUON_MLA_CONFIG, num_splits=num_splits, **partials)
        return
    from pagedattn.ops.common.bundles import AttentionArgs
    from pagedattn.ops.prefill_gluon.launch import GLUON_PREFILL_CONFIG, launch_prefill_gluon

    tokens, hq, hk = 300, HEADS["num_q_heads"], HEADS["num_kv_heads"]
    q = torch.zeros(tokens, hq, head_size, dtype=dtype)
    k_cache = torch.zeros(8, page_size, hk, head_size, dtype=dtype)
    args = AttentionArgs(q=q, k_cache=k_cache, v_cache=torch.zeros_like(k_cache),
                         block_table=torch.zeros(2, 4, dtype=torch.int32), seq_lens=torch.full((2,), 150, dtype=torch.int32),
                         query_start_loc=torch.tensor([0, 150, 300], dtype=torch.int32), scale=head_size ** -0.5,
                         causal=True, sliding_window=0, softcap=0.0, alibi_mode=0, alibi_slopes=None, sinks=None,
                         prefix_ranges=None, k_scale=None, v_scale=None)
    if modifiers:
        args = dataclasses.replace(args, sliding_window=100, softcap=30.0, alibi_mode=1, alibi_slopes=torch.ones(hq),
                                   sinks=torch.zeros(hq), prefix_ranges=torch.zeros(2, 2, 2, dtype=torch.int32))
    launch_prefill_gluon(torch.empty_like(q), torch.empty(tokens, hq) if return_lse else None, args,
                         max_query_len=150, config=config or GLUON_PREFILL_CONFIG)


def capture(v: Variant, target: str) -> list[tuple]:
    """The ``(kernel, grid, kwargs)`` of every launch of ``v``'s call planned for ``target``."""
    from pagedattn.ops.common.launching import capturing
    from pagedattn.ops.common.target import props_for, targeting

    with targeting(props_for(target)), capturing() as launched:
        _call(v)
    return launched


# ---------------------------------------------------------------------------------------------
# Compiling and reading what the compiler made


_JIT_OF_INTERPRETED: dict = {}  # InterpretedFunction -> the JITFunction it would have been


def _bind(kernel, kwargs: dict, target: str, interpreted: bool = False):
    """``kernel[grid](**kwargs)`` bound for ``target`` as Triton's launcher binds it (heuristics
    applied): (JITFunction, backend, bound arguments, specialization, options, GPUTarget).
    ``interpreted``: a kernel decorated under TRITON_INTERPRET=1 is bound as the JITFunction it
    would have been (binding compiles nothing)."""
    from triton.compiler import make_backend
    from triton.runtime.autotuner import Heuristics
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from pagedattn.ops.common.target import gpu_target, props_for

    gpu = gpu_target(props_for(target))
    kw = dict(kwargs)
    while not isinstance(kernel, JITFunction):
        if isinstance(kernel, Heuristics):
            kw.update({name: heur(dict(kw)) for name, heur in kernel.values.items()})
        elif interpreted and isinstance(kernel, InterpretedFunction):
            kernel = _JIT_OF_INTERPRETED.setdefault(kernel, JITFunction(kernel.fn, **kernel.kwargs))
            continue
        elif not hasattr(kernel, "fn"):
            raise TypeError(f"kernel {kernel!r} is not a Triton JIT function (the interpreter is on)")
        kernel = kernel.fn
    backend = make_backend(gpu)
    bound, specialization, options = create_function_from_signature(kernel.signature, kernel.params, backend)(**kw)
    return kernel, backend, bound, specialization, options, gpu


def launch_key(kernel, kwargs: dict, target: str) -> tuple[str, str]:
    """(kernel name, the key Triton's launcher finds the compiled kernel under) of
    ``kernel[grid](**kwargs)`` on ``target``: two launches with equal keys share one compile, and
    a launch whose key no earlier launch had compiles."""
    from triton.runtime.jit import compute_cache_key

    fn, _, _, specialization, options, _ = _bind(kernel, kwargs, target, interpreted=True)
    return fn.__name__, compute_cache_key({}, specialization, options)


def compile_launch(kernel, kwargs: dict, target: str):
    """The compiled kernel of ``kernel[grid](**kwargs)`` for ``target``, specialized as
    Triton's launcher would (heuristics applied, arguments bound as the JIT binds them)."""
    import triton
    from triton.compiler import ASTSource

    kernel, backend, bound, specialization, options, gpu = _bind(kernel, kwargs, target)
    options, signature, constexprs, attrs = kernel._pack_args(backend, options, bound, specialization, options)
    if type(kernel).__name__ == "GluonJITFunction":  # a @gluon.jit kernel: Gluon's own front end
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(kernel, signature, constexprs, attrs)
    else:
        src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=gpu, options=dict(options.__dict__))


def _compile_with_ptxas_log(kernel, kwargs: dict, target: str):
    """(compiled kernel, the ``ptxas -v`` log of its compile or None): Triton prints the log
    when asked (an NVIDIA compile that missed Triton's cache), which saves running ptxas again."""
    import contextlib
    import io

    from triton import knobs

    out = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(out):
        knobs.nvidia.dump_ptxas_log = True
        compiled = compile_launch(kernel, kwargs, target)
    log = out.getvalue()
    return compiled, log if "ptxas info" in log else None


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def parse_nvidia_usage(res_usage: str) -> dict:
    """``cuobjdump -res-usage`` text -> registers, stack and local bytes a thread (the kernel's
    first function line: ``REG:151 STACK:0 SHARED:1024 LOCAL:0 ...``)."""
    def field(name):
        m = re.search(rf"\b{name}:(\d+)", res_usage)
        return int(m.group(1)) if m else None

    return dict(regs=field("REG"), stack=field("STACK"), local=field("LOCAL"))


def parse_ptxas_spills(log: str) -> int:
    """Bytes of spill stores that ``ptxas -v`` reports (0 when it reports none)."""
    return sum(int(m) for m in re.findall(r"(\d+) bytes spill stores", log))


def _ptxas_spill_bytes(compiled, props) -> int:
    """Run the ptxas Triton ships (``-v``) on the kernel's PTX for its spill stores."""
    import triton

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = os.path.join(bindir, "ptxas-blackwell" if int(props.arch) >= 100 else "ptxas")
    arch = f"sm_{props.arch}a" if int(props.arch) >= 90 else f"sm_{props.arch}"
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True).stderr
    return parse_ptxas_spills(log)


def parse_amdgcn(asm: str) -> dict:
    """An AMD code object's assembly -> VGPRs, AGPRs, SGPRs, spills, LDS bytes and the waves per
    SIMD the compiler reports (its ``; Occupancy:`` comment)."""
    def field(pattern):
        m = re.search(pattern, asm)
        return int(m.group(1)) if m else None

    return dict(vgprs=field(r"\.vgpr_count:\s+(\d+)"), agprs=field(r"\.agpr_count:\s+(\d+)"),
                sgprs=field(r"\.sgpr_count:\s+(\d+)"), vgpr_spills=field(r"\.vgpr_spill_count:\s+(\d+)"),
                sgpr_spills=field(r"\.sgpr_spill_count:\s+(\d+)"),
                lds=field(r"\.group_segment_fixed_size:\s+(\d+)"), occupancy=field(r";\s*Occupancy:\s+(\d+)"))


def nvidia_programs_per_sm(regs: int, shared: int, num_warps: int, props) -> int:
    """Programs of one kernel an SM holds at once: registers (allocated per warp in units of
    256), shared memory (1 KB of it reserved per program on sm80+) and threads."""
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = (props.regs_per_sm // regs_per_warp) // num_warps
    by_shared = props.shared_per_sm // (shared + 1024)
    by_threads = props.max_threads_per_sm // (32 * num_warps)
    return max(0, min(by_regs, by_shared, by_threads, 32))


def usage(compiled, target: str, ptxas_log: str | None = None) -> dict:
    """What the compiler made of one kernel for ``target``: registers, spills, shared memory,
    occupancy, and the problems that fail the row (a spill, shared memory over the limit).
    ``ptxas_log``: the ``ptxas -v`` output of its compile, if at hand (else ptxas runs again
    where the cubin has a stack frame or local memory)."""
    from pagedattn.ops.common.target import props_for

    props = props_for(target)
    md = compiled.metadata
    row = dict(kernel=compiled.name, num_warps=md.num_warps, num_stages=md.num_stages, shared=md.shared)
    if props.backend == "cuda":
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            text = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True).stdout
        u = parse_nvidia_usage(text)
        # a stack frame or local memory is where spills go; ptxas -v says how much of it is
        # spills (a few bytes of frame without spill stores happen on sm100)
        if not (u["stack"] or u["local"]):
            spill = 0
        elif ptxas_log is not None:
            spill = parse_ptxas_spills(ptxas_log)
        else:
            spill = _ptxas_spill_bytes(compiled, props)
        row.update(regs=u["regs"], spill_bytes=spill, stack=u["stack"], local=u["local"])
        row["occupancy"] = nvidia_programs_per_sm(u["regs"] or 0, md.shared, md.num_warps, props)
    else:
        u = parse_amdgcn(compiled.asm["amdgcn"])
        # SGPR spills go to VGPR lanes (v_writelane / v_readlane, no memory traffic); VGPR spills
        # go to scratch memory: only those count as spills
        row.update(regs=u["vgprs"], agprs=u["agprs"], sgprs=u["sgprs"], spill_bytes=u["vgpr_spills"] or 0,
                   sgpr_spills=u["sgpr_spills"] or 0, occupancy=u["occupancy"])
        row["shared"] = max(md.shared, u["lds"] or 0)
    problems = []
    if row["spill_bytes"]:
        problems.append(f"spills {row['spill_bytes']}" + (" B" if props.backend == "cuda" else " registers"))
    if row["shared"] > props.max_shared:
        problems.append(f"shared memory {row['shared']} B over the {props.max_shared} B limit")
    row["problems"] = problems
    return row


def _tiles_of(kwargs: dict) -> str:
    """The tile shape a launch carries: rows x keys, warps, stages and ptxas's register budget
    where the planner gives one (the attention kernels)."""
    cfg = kwargs.get("CFG")
    m = getattr(cfg, "BLOCK_M", None)
    n = getattr(cfg, "TILE_N", None)
    shape = f"{m}x{n} " if m and n else ""
    budget = f" r{kwargs['maxnreg']}" if kwargs.get("maxnreg") else ""
    return f"{shape}w{kwargs.get('num_warps', 4)} s{kwargs.get('num_stages', 3)}{budget}"


def _dump(compiled, folder: str, stem: str) -> None:
    """Write a compiled kernel's TTGIR, PTX and SASS (NVIDIA) or AMDGCN (AMD) into ``folder``."""
    os.makedirs(folder, exist_ok=True)
    texts = {ext: compiled.asm[ext] for ext in ("ttgir", "ptx", "amdgcn") if ext in compiled.asm}
    if "cubin" in compiled.asm:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            texts["sass"] = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True).stdout
    for ext, text in texts.items():
        with open(os.path.join(folder, f"{stem}.{ext}"), "w") as f:
            f.write(text)


def compile_variant(v: Variant, target: str, dump: str | None = None) -> list[dict]:
    """The rows of ``v`` on ``target``: one per kernel its call launches (``dump``: a folder
    that receives each kernel's TTGIR, PTX/SASS or AMDGCN, per target)."""
    from pagedattn.ops.common.target import UnsupportedOnTarget

    if v.family in GLUON_FAMILIES and target not in GLUON_TARGETS:  # never planned there: nothing to compile
        return [dict(variant=v.name, target=target, kernel="(not for this target)", elsewhere=True, problems=[])]
    try:
        launched = capture(v, target)
    except UnsupportedOnTarget as e:  # the API refuses this input on this GPU: nothing to compile
        return [dict(variant=v.name, target=target, kernel="(refused)", refused=str(e), problems=[])]
    except Exception as e:  # noqa: BLE001 - the planner or a launcher failed: the row says why
        return [dict(variant=v.name, target=target, kernel="?", problems=[f"capture: {_short(e)}"])]
    return compile_launches(launched, v.name, target, dump)


def compile_gluon(family: str, target: str = "sm90", **call) -> dict:
    """The row of a Gluon kernel compiled for ``target`` from ``gluon_call(family, **call)``'s
    launch (its other launches, a merge of splits, are not compiled here)."""
    from pagedattn.ops.common.launching import capturing

    with capturing() as launched:
        gluon_call(family, **call)
    gluon = [launch for launch in launched if type(launch[0]).__name__ == "GluonJITFunction"]
    (row,) = compile_launches(gluon, family, target)
    return row


def compile_launches(launched: list, variant: str, target: str, dump: str | None = None) -> list[dict]:
    """One row per captured launch ``(kernel, grid, kwargs)``, compiled for ``target``. A
    warp-specialized kernel (``PRODUCER_REGS`` among its arguments) also gets
    ``partition_regs`` (``partition_registers``)."""
    rows = []
    t0 = time.perf_counter()
    for kernel, _grid, kwargs in launched:
        name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
        row = dict(variant=variant, target=target, kernel=name, tiles=_tiles_of(kwargs))
        try:
            compiled, log = _compile_with_ptxas_log(kernel, kwargs, target)
            row.update(usage(compiled, target, log))
            if "PRODUCER_REGS" in kwargs and "cubin" in compiled.asm:
                caps = {"producer": kwargs["PRODUCER_REGS"]}
                if kwargs.get("NUM_CONSUMERS", 1) > 1:
                    caps["consumer"] = kwargs["CONSUMER_REGS"]
                row["partition_regs"] = partition_registers(compiled, caps)
            if dump:
                _dump(compiled, os.path.join(dump, target), f"{variant.replace(' ', '_').replace('/', '-')}_{name}")
        except Exception as e:  # noqa: BLE001 - a compile error is the finding
            row["problems"] = [f"compile: {_short(e)}"]
        rows.append(row)
    for r in rows:
        r["seconds"] = round((time.perf_counter() - t0) / max(len(rows), 1), 2)
    return rows


def partition_registers(compiled, caps: dict[str, int]) -> dict:
    """Registers of a warp-specialized kernel's partitions: ``{"default": (cap, used), name:
    (cap, used) for each worker partition named in caps}``. The SASS is cut at its
    ``USETMAXREG`` instructions; a stretch belongs to the worker whose cap (``caps[name]``, the
    caps the kernel was given, all different) was set before it, else to the default partition
    (its code before and after the fork included). ``used``: the highest register a stretch
    names, plus one (a lower bound: a 64-bit operand also takes the register after it); ``cap``:
    the ``setmaxnreg`` cap of the stretch that uses the most (0 where none is set: the kernel's
    register count bounds it)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True).stdout
    parts = {"default": (0, 0), **{name: (0, 0) for name in caps}}
    owner = {c: name for name, c in caps.items()}
    cap = 0
    for line in sass.splitlines():
        m = re.search(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d, )?0x([0-9a-f]+)", line)
        if m:
            cap = int(m.group(1), 16)
            continue
        regs = [int(r) for r in re.findall(r"\bR(\d+)\b", line.split(";")[0])]
        name = owner.get(cap, "default")
        if regs and max(regs) + 1 > parts[name][1]:
            parts[name] = (cap, max(regs) + 1)
    return parts


def _short(e: Exception) -> str:
    while e.__cause__ is not None:  # Triton wraps the failing frame's error in CompilationErrors
        e = e.__cause__
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:200]


_INFLIGHT_DIR: str | None = None


def _worker(task):
    """Compile one task in a pool worker; a marker file names the task while it runs, so that a
    compiler that aborts the process (an LLVM assertion) is traced to its task."""
    index, (v, target, dump) = task
    marker = os.path.join(_INFLIGHT_DIR, str(os.getpid())) if _INFLIGHT_DIR else None
    if marker:
        with open(marker, "w") as f:
            f.write(str(index))
    rows = compile_variant(v, target, dump)
    if marker:
        os.remove(marker)
    return rows


def _worker_init(inflight_dir: str | None = None) -> None:
    global _INFLIGHT_DIR
    os.environ["TRITON_INTERPRET"] = "0"
    _INFLIGHT_DIR = inflight_dir


def _crash_rows(task) -> list[dict]:
    v, target, _ = task
    return [dict(variant=v.name, target=target, kernel="?",
                 problems=["compile: the compiler aborted the process (an assertion or a signal; its message "
                           "is on stderr)"])]


def _run_batch(tasks: list, indices: list, jobs: int, progress, results: dict) -> tuple[bool, list]:
    """Run ``tasks[i]`` for ``indices`` in ``jobs`` fresh processes into ``results``; (whether a
    worker was aborted, the indices that were running then)."""
    import concurrent.futures as cf
    import multiprocessing
    import shutil

    # fresh processes: kernels decorated while TRITON_INTERPRET=1 are interpreter functions
    ctx = multiprocessing.get_context("spawn")
    inflight = tempfile.mkdtemp(prefix="pagedattn-inflight-")
    broken = False
    try:
        with cf.ProcessPoolExecutor(max(1, jobs), mp_context=ctx, initializer=_worker_init,
                                    initargs=(inflight,)) as pool:
            futures = {pool.submit(_worker, (i, tasks[i])): i for i in indices}
            try:
                for f in cf.as_completed(futures):
                    results[futures[f]] = f.result()
                    if progress:
                        progress(results[futures[f]])
            except cf.process.BrokenProcessPool:
                broken = True
        suspects = []
        for name in os.listdir(inflight):
            with open(os.path.join(inflight, name)) as f:
                suspects.append(int(f.read()))
    finally:
        shutil.rmtree(inflight, ignore_errors=True)
    return broken, suspects


def _run_pool(tasks: list, jobs: int, progress, results: dict) -> None:
    """Run every task in ``jobs`` fresh processes into ``results``. When a compiler aborts a
    worker, the tasks that were running are run again one at a time: one that aborts alone gets
    a failed row; then the rest go on."""
    pending = list(range(len(tasks)))
    while pending:
        broken, suspects = _run_batch(tasks, pending, jobs, progress, results)
        if broken:
            for i in suspects:
                if i not in results and _run_batch(tasks, [i], 1, progress, results)[0]:
                    results[i] = _crash_rows(tasks[i])
        pending = [i for i in pending if i not in results]


# ---------------------------------------------------------------------------------------------
# The table


def _cell(row: dict | None, base: dict | None) -> str:
    if row is None:
        return "-"
    if row.get("refused"):
        return "refused"
    if row.get("elsewhere"):
        return "/".join(GLUON_TARGETS) + " only"
    if not row.get("kernel") or row.get("kernel") == "?" or "regs" not in row:
        return "FAIL"
    regs = f"R{row['regs']}" if row.get("sgprs") is None else f"V{row['regs']}/S{row['sgprs']}"
    text = f"{regs} {row['shared'] / 1024:.0f}K"
    if row.get("occupancy") is not None:
        text += f" x{row['occupancy']}"
    if row.get("spill_bytes"):
        text += " spill" if row.get("spill_as_sm90") or row["target"] == "sm90" else " SPILL"
    if any("over" in p for p in row.get("problems", ())):
        text += " >LIM"
    if base is not None and row.get("tiles") != base.get("tiles"):
        text += "*"
    return text


def format_table(rows: list[dict], targets) -> str:
    """One line per (variant, kernel), one column per target; see ``LEGEND``."""
    from pagedattn.ops.common.target import props_for

    by_key: dict = {}
    order: list = []
    refused: dict = {}  # (variant, target) -> row: shown in each of the variant's kernel lines
    for r in rows:
        if r.get("refused") or r.get("elsewhere"):
            refused[(r["variant"], r["target"])] = r
            continue
        key = (r["variant"], r["kernel"])
        if key not in by_key:
            by_key[key] = {}
            order.append(key)
        by_key[key][r["target"]] = r
    width = 20
    head = f"{'variant':<34} {'kernel':<26}" + "".join(
        f" {t + (' (timed)' if props_for(t).tuned else ''):<{width}}" for t in targets)
    lines = [head, "-" * len(head)]
    seen_secondary = set()
    for key in order:
        cells = by_key[key]
        # a merge kernel behind several variants: listed once unless it fails somewhere
        secondary = key[1] in ("reduce_splits_kernel", "persistent_reduce_kernel")
        if secondary and key[1] in seen_secondary and all(c.get("ok") for c in cells.values()):
            continue
        seen_secondary.add(key[1])
        base = cells.get("sm90")
        lines.append(f"{key[0]:<34} {key[1][:26]:<26}" + "".join(
            f" {_cell(cells.get(t) or refused.get((key[0], t)), base if t != 'sm90' else None):<{width}}"
            for t in targets))
    return "\n".join(lines)


LEGEND = """\
cells: R = registers a thread (NVIDIA), V/S = VGPRs/SGPRs a lane (AMD); shared memory (LDS) in KB;
x = programs per SM from registers, shared memory and threads (NVIDIA), waves per SIMD as the
AMD compiler reports; * = tiles fitted to the target (differ from sm90's); spill = a spill sm90
has too at the tiles timed on the H200; SPILL (one sm90 does not have), >LIM (shared memory over
the target's limit) and FAIL (did not compile) fail the run; refused = the API refuses the input on
that GPU with an error naming the argument (nothing to compile); sm90 only = a Gluon kernel, which
the planner never picks on another target. Tiles were timed on
sm90 (H200) only: the other columns are compiled, never run."""


def run_matrix(targets=TARGETS, *, full: bool = False, only=None, jobs: int | None = None,
               progress=None, dump: str | None = None) -> list[dict]:
    """Compile every variant (``full``) or the CI subset for every target; rows as dicts.

    Parameters
    ----------
    targets : names of ``pagedattn.ops.common.target.KNOWN_TARGETS``.
    full : the whole list of :func:`variants`, else the CI subset.
    only : keep variants whose name contains one of these texts.
    jobs : worker processes per target (default: the CPUs, at most 8); 1 with one target
        compiles in this process.
    progress : called with each finished (variant, target)'s rows.
    dump : a folder for each compiled kernel's TTGIR, PTX and SASS or AMDGCN (one folder a target).
    """
    from pagedattn.ops.common.target import props_for

    for t in targets:
        props_for(t)  # raises ValueError naming the target
    chosen = [v for v in variants(full) if not only or any(text in v.name for text in only)]
    tasks = [(v, t, dump) for v in chosen for t in targets]
    jobs = jobs or min(8, os.cpu_count() or 1)
    results: dict = {}
    if jobs <= 1 and len(targets) == 1 and not _interpreted():
        for i, task in enumerate(tasks):
            results[i] = _worker((i, task))
            if progress:
                progress(results[i])
    else:
        # one target's processes compile for that target only: Triton 3.6's AMD backend keeps
        # LLVM state across compiles, and a gfx942 kernel compiled after a gfx950 one in the same
        # process came out with gfx950's fp8 conversions (v_cvt_scalef32_pk_f16_fp8) and failed
        # to link, or aborted on an LLVM assertion
        for target in targets:
            indices = [i for i, task in enumerate(tasks) if task[1] == target]
            part: dict = {}
            _run_pool([tasks[i] for i in indices], jobs, progress, part)
            results.update({indices[k]: rows for k, rows in part.items()})
    return judge([r for i in range(len(tasks)) for r in results[i]])


def judge(rows: list[dict]) -> list[dict]:
    """Set each row's ``ok``: no compile error, shared memory within the limit, and no spill,
    except a spill that sm90 also has at that variant and kernel. The sm90 tiles were timed on
    the H200 with their spills (32-112 B of stack in the paged prefill kernel's 128-row tiles,
    where spill-free tiles ran slower: docs/perf-notes.md); a target that inherits the same
    tiles inherits the spill (``spill_as_sm90``); a spill sm90 does not have fails."""
    sm90 = {(r["variant"], r["kernel"]): r for r in rows if r["target"] == "sm90"}
    for r in rows:
        problems = [p for p in r.get("problems", ()) if not p.startswith("spills")]
        if r.get("spill_bytes"):
            base = sm90.get((r["variant"], r["kernel"]))
            if base is not None and base.get("spill_bytes"):
                r["spill_as_sm90"] = True
            else:
                problems.append(next(p for p in r["problems"] if p.startswith("spills")))
        r["failures"] = problems
        r["ok"] = not problems
    return rows


def _interpreted() -> bool:
    """Whether this process decorated the kernels under TRITON_INTERPRET=1 (then they cannot be
    compiled here: the work goes to fresh processes)."""
    from triton.runtime.autotuner import Heuristics
    from triton.runtime.jit import JITFunction

    from pagedattn.ops.unified.kernel import unified_attention_kernel

    k = unified_attention_kernel
    while isinstance(k, Heuristics):
        k = k.fn
    return not isinstance(k, JITFunction)


def summary(rows: list[dict], targets) -> dict:
    """Counts for the closing line and the JSON: rows, compiled, failures by kind."""
    failed = [r for r in rows if not r.get("ok")]
    return dict(rows=len(rows), variants=len({r["variant"] for r in rows}), targets=list(targets),
                refused=sum(bool(r.get("refused")) for r in rows),
                elsewhere=sum(bool(r.get("elsewhere")) for r in rows),
                failed=len(failed),
                compile_errors=sum(any(p.startswith(("compile", "capture")) for p in r["failures"]) for r in failed),
                spills=sum(bool(r.get("spill_bytes")) and not r.get("spill_as_sm90") and r["target"] != "sm90"
                           for r in rows),
                spills_as_sm90=sum(bool(r.get("spill_bytes")) and (bool(r.get("spill_as_sm90")) or r["target"] == "sm90")
                                   for r in rows),
                over_limit=sum(any("over" in p for p in r["failures"]) for r in rows))


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="pagedattn check --compile")
    p.add_argument("--targets", default=",".join(TARGETS),
                   help=f"comma-separated compile targets (default: all of {','.join(TARGETS)})")
    p.add_argument("--full", action="store_true", help="every variant (default: the CI subset)")
    p.add_argument("--only", action="append", metavar="TEXT", help="keep variants whose name contains TEXT")
    p.add_argument("--jobs", type=int, default=None, help="worker processes (default: the CPUs, at most 8)")
    p.add_argument("--json", metavar="PATH", help="also write the rows to this JSON file")
    p.add_argument("--dump", metavar="DIR", help="write each kernel's TTGIR, PTX, SASS or AMDGCN under DIR/<target>/")
    return p


def main(args) -> int:
    """Run the matrix for parsed ``args`` (``build_parser``); 1 when a row fails, 2 on bad input."""
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    try:
        from pagedattn.ops.common.target import props_for

        for t in targets:
            props_for(t)
    except ValueError as e:
        print(f"pagedattn check --compile: --targets: {e}", file=sys.stderr)
        return 2
    subset = "every variant" if args.full else "the CI subset (--full: every variant)"
    print(f"compiling {subset} for {', '.join(targets)}; nothing is run", flush=True)
    start = time.perf_counter()
    per_target = len([v for v in variants(args.full) if not args.only or any(t in v.name for t in args.only)])
    done: dict = {}

    def progress(rows):  # a line per finished target (CI logs show the run advancing)
        target = rows[0]["target"]
        done[target] = done.get(target, 0) + 1
        if done[target] == per_target:
            print(f"  {target}: {per_target} variants compiled ({time.perf_counter() - start:.0f} s)", flush=True)

    rows = run_matrix(targets, full=args.full, only=args.only, jobs=args.jobs, progress=progress,
                      dump=getattr(args, "dump", None))
    seconds = time.perf_counter() - start
    print(format_table(rows, targets))
    for r in rows:
        if not r["ok"]:
            print(f"FAIL {r['target']:<8} {r['variant']} {r['kernel']}: {'; '.join(r['failures'])}")
    print(LEGEND)
    s = summary(rows, targets)
    print(f"{s['variants']} variants x {len(targets)} targets: {s['rows'] - s['refused'] - s['elsewhere']} kernels "
          f"compiled in "
          f"{seconds:.0f} s; "
          f"{s['failed']} failed ({s['compile_errors']} compile errors, {s['spills']} spills, "
          f"{s['over_limit']} over a shared-memory limit); {s['spills_as_sm90']} spills as timed on sm90; "
          f"{s['refused']} refused by the API")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(summary=s, seconds=round(seconds, 1), full=args.full, rows=rows), f, indent=1)
        print(f"results: {args.json}")
    if not rows:
        print("no variants matched", file=sys.stderr)
        return 2
    return 1 if s["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
