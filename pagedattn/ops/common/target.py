"""The properties of the GPU a launch is planned for (host side): what the planner's tile, warp
and stage choices are checked against.

A :class:`TargetProps` is built once per device (:func:`target_props`, from the driver's
properties) or from a compile target without a device (:func:`props_for`, from the table of
known chips below). The planner sizes its choices against it: a tile whose shared memory
exceeds ``max_shared`` is made smaller, warp counts are read against ``warp_size``. The tile
tables were measured on the H200 (sm90, ``tuned``); elsewhere they are the H200's choice fitted
into the target's limits, compiled for it (``pagedattn check --compile``) but not timed.

``targeting(props)`` makes every device report ``props`` inside its ``with`` block: the compile
matrix plans and captures launches for a GPU that is not present.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, replace

import torch


class UnsupportedOnTarget(ValueError):
    """An input the target's GPU cannot take (its message names the argument)."""


@dataclass(frozen=True)
class TargetProps:
    """What the planner needs to know of a GPU.

    ``name``: "sm90", "gfx942", ... or "interpreter" (the CPU); ``backend``: "cuda", "hip" or
    "cpu"; ``arch``: Triton's ``GPUTarget.arch`` (an int for CUDA, the gfx name for HIP);
    ``num_sms``: SMs (CUs on AMD); ``max_shared``: shared memory one program may hold (LDS on
    AMD), bytes; ``shared_per_sm``: all programs of one SM together; ``regs_per_sm``: 32-bit
    registers of one SM (NVIDIA) or VGPRs of one SIMD lane (AMD: 512); ``max_threads_per_sm``;
    ``warp_size``: 32, or 64 (CDNA wavefronts); ``has_mma``: tensor-core / MFMA / WMMA dot
    instructions; ``tuned``: the planner's constants were timed on this chip.
    """

    name: str
    backend: str
    arch: int | str
    chip: str
    num_sms: int
    max_shared: int
    shared_per_sm: int
    regs_per_sm: int = 65536
    max_threads_per_sm: int = 2048
    warp_size: int = 32
    has_mma: bool = True
    tuned: bool = False
    # register bounds of the attention tiles, where the compiler spills VGPRs to scratch at the
    # H200's tiles (compiled for the target by pagedattn check --compile; None: no bound)
    max_tile_elems: int | None = None  # block_m x tile_n of one program, at head 128 and 16 bits
    max_block_m: int | None = None
    max_tile_n: int | None = None
    max_warps: int | None = None
    max_stages: int | None = None
    fp32_warps: int | None = None  # warps of fp32 tiles where the dot has no matrix instruction
    fp8_max_tile_n: int | None = None  # prefill keys per tile with an fp8 cache (its up-conversion's registers)
    qblock_max_tile_n: int | None = None  # keys per tile of the Q-block kernels' decode tiles (< 64 rows)
    persistent_tile_n: int | None = None  # keys per tile of the persistent kernel
    persistent_stages: int | None = None
    # decode tiles (fewer than 64 rows) of the unified, split-KV and persistent kernels: ptxas's
    # register budget at heads 65-128 and past 128 (NVIDIA), warps past head 128 (the persistent
    # kernel's own count, it holds more state a lane)
    decode_registers: int | None = None
    wide_decode_registers: int | None = None
    wide_decode_warps: int | None = None
    wide_persistent_warps: int | None = None
    # shared memory the compiler adds beyond the tiles (barriers, reduction scratch, layout
    # conversions): the 128 x 128 prefill tiles at head 128 and 3 stages take 225 KB on sm90 and
    # 229 KB on sm100
    shared_overhead: int = 2 * 1024
    mla_max_rows: int = 64  # rows of an MLA decode program (pagedattn.plan.mla.pick_mla_config)
    # the shared-memory bound's model (tiles_shared_bytes): NVIDIA counts a K/V buffer per stage
    # and the Q block; the AMD backend keeps one buffer fewer than its stages and Q in VGPRs
    # (gfx942: 128 x 64 tiles at 2 stages take 33 KB of LDS, one 32 KB K/V buffer)
    q_in_shared: bool = True
    buffers_below_stages: int = 0

    @property
    def is_cuda(self) -> bool:
        return self.backend == "cuda"

    @property
    def fp8e4nv(self) -> bool:
        """Whether Triton compiles float8_e4m3fn values for this target (NVIDIA from sm89; the
        AMD targets convert them in software where they lack the instructions)."""
        return self.backend != "cuda" or int(self.arch) >= 89

    @property
    def sm90_or_newer(self) -> bool:
        """An NVIDIA GPU of compute capability 9.0 or newer (TMA descriptors, dependent launch)."""
        return self.backend == "cuda" and int(self.arch) >= 90


KB = 1024
# Chips the compile matrix targets (one per Triton target). Shared memory per block is the
# opt-in maximum of each architecture (CUDA programming guide; AMD ISA guides for the LDS).
KNOWN_TARGETS: dict[str, TargetProps] = {
    t.name: t
    for t in (
        # sm80 (mma.sync, operands in registers): the prefill kernel's 128-row tiles spill 36-60 B
        # at 64 or 128 keys, 64 x 64 on 4 warps none; the decode tiles of the split-KV and 2D
        # kernels spill 4-28 B at 16 x 64 (ptxas holds them to 168 registers, 3 programs per
        # SM), none at 16 x 32
        # ptxas aims the decode kernels at 4 programs an SM where their shared memory allows it
        # (128 registers) and spills 16 B with linear ALiBi; given 168 it keeps 3 (as it picks
        # for the other modifiers) and none. At head 256 ptxas held the persistent kernel (its first
        # item read before the item count) to 168 registers and spilled 20 B on 16-token pages;
        # given 255 it takes what the 64-token pages take uncapped
        TargetProps("sm80", "cuda", 80, "A100", num_sms=108, max_shared=163 * KB, shared_per_sm=164 * KB,
                    max_block_m=64, max_tile_n=64, qblock_max_tile_n=32, decode_registers=168,
                    wide_decode_registers=255),
        TargetProps("sm90", "cuda", 90, "H100/H200", num_sms=132, max_shared=227 * KB, shared_per_sm=228 * KB,
                    tuned=True),
        # sm100: the prefill kernel's 128 x 128 tiles spill 12-36 B, 128 x 64 at 3 stages none; the
        # persistent kernel at 16 x 64 is compiled to 168 registers and 4-12 B of spill (3
        # programs per SM), at 16 x 32 and 2 stages to 116-144 and none; the MLA kernel's 64-row configs take 230-370 KB of
        # shared memory and 1 KB of spills (sm90: 148-222 KB), 32 rows compile as on sm90 (76 KB).
        # At head 256 ptxas holds the decode kernels to 168 registers and spills 16-32 B; given
        # 255 they take 188-198, 2 programs an SM, as sm90 compiles them
        TargetProps("sm100", "cuda", 100, "B200", num_sms=148, max_shared=227 * KB, shared_per_sm=228 * KB,
                    shared_overhead=6 * KB, max_tile_n=64, persistent_tile_n=32, persistent_stages=2, mla_max_rows=32,
                    wide_decode_registers=255),
        # sm120 (99 KB): prefill tiles of 64 keys spill 32-580 B (64 or 128 rows, 4 or 8 warps),
        # 32 keys none (with an fp8 cache 12-472 B, at 128 x 16 none); decode at 16 x 64 with an
        # fp8 cache spills 4 B, 16 x 32 none; the persistent kernel at 3 stages 8-16 B, and at 2
        # stages on 64-token pages 8 B at ptxas's 128 registers (none given 168, 3 programs an
        # SM); at head 256 the decode kernels 16-32 B at 168 (none given 255: 185-193)
        TargetProps("sm120", "cuda", 120, "RTX 50", num_sms=170, max_shared=99 * KB, shared_per_sm=100 * KB,
                    max_threads_per_sm=1536, max_tile_n=32, fp8_max_tile_n=16, persistent_stages=2,
                    decode_registers=168, wide_decode_registers=255),
        # CDNA: the prefill kernel's 128 x 128 tiles on 8 warps spill 217-613 VGPRs; 128 x 64 on
        # 4 warps compile without on gfx950 (422-432 VGPRs, AGPRs included), with ALiBi's sqrt
        # form to 476 and a spill on gfx942; 128 x 32 there to 360-388 and none
        TargetProps("gfx942", "hip", "gfx942", "MI300X", num_sms=304, max_shared=64 * KB, shared_per_sm=64 * KB,
                    regs_per_sm=512, warp_size=64, max_tile_elems=128 * 32, max_warps=4, q_in_shared=False, buffers_below_stages=1),
        TargetProps("gfx950", "hip", "gfx950", "MI355X", num_sms=256, max_shared=160 * KB, shared_per_sm=160 * KB,
                    regs_per_sm=512, warp_size=64, max_tile_elems=128 * 64, max_warps=4, q_in_shared=False, buffers_below_stages=1),
        # RDNA3 (wave32, 256 VGPRs a lane, no direct-to-LDS copies: a pipeline stage is held in
        # VGPRs): decode tiles of 16 x 64 spill, 16 x 32 on 4 warps at one stage do not; its WMMA
        # takes 16-bit operands only, and fp32 dots on FMAs spill 145 VGPRs at 16 x 16 on 4
        # warps, none on 8. At head 256 (16 x 16 tiles) the Q-block kernels spill 1-5 VGPRs on 4
        # warps, none on 8; the persistent kernel 94-124 on 4, 27-85 on 8, none on 16
        TargetProps("gfx1100", "hip", "gfx1100", "RX 7900 XTX", num_sms=96, max_shared=64 * KB,
                    shared_per_sm=128 * KB, regs_per_sm=1536, max_threads_per_sm=2048, warp_size=32,
                    max_tile_elems=16 * 32, max_warps=4, max_stages=1, fp32_warps=8, q_in_shared=False, buffers_below_stages=1,
                    wide_decode_warps=8, wide_persistent_warps=16),
    )
}
# Triton's interpreter on the CPU: no limits that matter, and a few programs are plenty.
INTERPRETER = TargetProps("interpreter", "cpu", "cpu", "CPU", num_sms=4, max_shared=1 << 30, shared_per_sm=1 << 30,
                          has_mma=False)
H200 = KNOWN_TARGETS["sm90"]

_OVERRIDE: contextvars.ContextVar = contextvars.ContextVar("pagedattn_target", default=None)


def props_for(target) -> TargetProps:
    """The :class:`TargetProps` of a compile target: a name of ``KNOWN_TARGETS`` ("sm90",
    "gfx942"), or a ``triton.backends.compiler.GPUTarget`` of a known architecture.

    Raises ValueError naming ``target`` when the architecture is not in the table.
    """
    if isinstance(target, TargetProps):
        return target
    if isinstance(target, str):
        name = target
    else:
        name = f"sm{target.arch}" if target.backend == "cuda" else str(target.arch)
    if name not in KNOWN_TARGETS:
        raise ValueError(f"target {target!r} is not one of the known targets {sorted(KNOWN_TARGETS)}")
    return KNOWN_TARGETS[name]


def gpu_target(props: TargetProps):
    """The ``triton.backends.compiler.GPUTarget`` that compiles for ``props``."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget(props.backend, props.arch, props.warp_size)


@contextlib.contextmanager
def targeting(props: TargetProps):
    """Inside the block every device's :func:`target_props` is ``props`` (planning for a GPU
    that is not here: the compile matrix)."""
    token = _OVERRIDE.set(props)
    try:
        yield props
    finally:
        _OVERRIDE.reset(token)


def target_props(device) -> TargetProps:
    """The :class:`TargetProps` of ``device`` (a torch device or its name): read from the
    driver once per GPU; :data:`INTERPRETER` for the CPU; the ``targeting`` override if one is
    active."""
    override = _OVERRIDE.get()
    if override is not None:
        return override
    device = torch.device(device)
    if device.type != "cuda":
        return INTERPRETER
    return _device_props(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _device_props(index: int) -> TargetProps:
    p = torch.cuda.get_device_properties(index)
    if torch.version.hip is not None:
        arch = str(getattr(p, "gcnArchName", "")).split(":")[0]
        base = KNOWN_TARGETS.get(arch)
        backend = "hip"
    else:
        arch = p.major * 10 + p.minor
        base = KNOWN_TARGETS.get(f"sm{arch}") or KNOWN_TARGETS.get(f"sm{p.major * 10}")
        backend = "cuda"
    warp = int(getattr(p, "warp_size", 32))
    shared_block = int(getattr(p, "shared_memory_per_block_optin", 0) or getattr(p, "shared_memory_per_block", 0))
    shared_sm = int(getattr(p, "shared_memory_per_multiprocessor", 0) or shared_block)
    fallback = base or TargetProps(f"sm{arch}" if backend == "cuda" else arch, backend, arch, p.name,
                                   num_sms=p.multi_processor_count, max_shared=shared_block or 48 * KB,
                                   shared_per_sm=shared_sm or 48 * KB, warp_size=warp)
    return replace(
        fallback, arch=arch, chip=p.name, num_sms=p.multi_processor_count,
        max_shared=shared_block or fallback.max_shared, shared_per_sm=shared_sm or fallback.shared_per_sm,
        regs_per_sm=int(getattr(p, "regs_per_multiprocessor", 0) or fallback.regs_per_sm),
        max_threads_per_sm=int(getattr(p, "max_threads_per_multi_processor", 0) or fallback.max_threads_per_sm),
        warp_size=warp,
        # sm90 decisions were timed on the H200 (and hold for the H100: same SM, same limits)
        tuned=backend == "cuda" and p.major == 9,
    )


def target_override() -> TargetProps | None:
    """The props of the active ``targeting`` block, or None (the device's own)."""
    return _OVERRIDE.get()


def tiles_shared_bytes(tiles, head_size_pad: int, q_bytes: int, kv_bytes: int, overhead: int = 2 * KB,
                       target: TargetProps | None = None) -> int:
    """An upper bound of the shared memory of an attention kernel at ``tiles``: ``num_stages``
    K and V tiles (``tile_n x head_size_pad`` at ``kv_bytes``) and the Q block (``block_m x
    head_size_pad`` at ``q_bytes``), and ``overhead`` (the target's ``shared_overhead``). Against what
    Triton allocates for sm90, bf16, head 128: the 16 x 64 decode tiles at 3 stages compile to
    70 KB (102 KB here), the 128 x 128 prefill tiles at 3 stages to 225 KB (226 KB here)."""
    kv_tile = tiles.tile_n * head_size_pad * 2 * kv_bytes
    buffers, q_block = tiles.num_stages, tiles.block_m * head_size_pad * q_bytes
    if target is not None:  # the target's model (TargetProps.q_in_shared, buffers_below_stages)
        buffers = max(1, tiles.num_stages - target.buffers_below_stages)
        q_block = q_block if target.q_in_shared else 0
    return buffers * kv_tile + q_block + overhead


def fit_tiles(tiles, target: TargetProps, head_size_pad: int, q_bytes: int, kv_bytes: int | None = None):
    """``tiles`` (a choice of the H200 tables) fitted into ``target``: rows (with the warps) and
    keys per tile down to ``target.max_block_m`` and ``target.max_tile_n`` (``qblock_max_tile_n``
    for decode tiles of fewer than 64 rows, ``fp8_max_tile_n`` with a 1-byte cache,
    ``kv_bytes``); warps and stages
    down to ``target.max_warps`` and ``target.max_stages``, fp32 tiles on ``target.fp32_warps``;
    keys per tile, then Q rows, halved until the
    tile's area (weighted by head size over 128 and element bytes over 2) is within
    ``target.max_tile_elems`` (the targets whose compiler spills at the H200's tiles); then while
    :func:`tiles_shared_bytes` exceeds ``target.max_shared``: stages down to 2, then keys per
    tile down to 16, then stages down to 1, then Q rows down to 16 (``block_q`` in proportion).
    Unchanged on every target without register bounds where it fits (the sm90 tables always
    do, at head sizes up to 256).

    The warp count is not halved on 64-lane warps: at the same tiles, CDNA compiles 4 warps to
    fewer VGPRs a lane and more waves per SIMD than 2 (decode 16 x 64: 204 against 292, 2
    waves against 1)."""
    kv_bytes = q_bytes if kv_bytes is None else kv_bytes
    while target.max_block_m and tiles.block_m > target.max_block_m and tiles.block_q > 1:
        # half the rows on half the warps (at least 4): each warp keeps its rows
        tiles = replace(tiles, block_m=tiles.block_m // 2, block_q=tiles.block_q // 2,
                        num_warps=max(min(4, tiles.num_warps), tiles.num_warps // 2))
    if target.max_tile_n and tiles.tile_n > target.max_tile_n:
        tiles = replace(tiles, tile_n=target.max_tile_n)
    if target.qblock_max_tile_n and tiles.block_m < 64 and tiles.tile_n > target.qblock_max_tile_n:
        tiles = replace(tiles, tile_n=target.qblock_max_tile_n)
    if kv_bytes == 1 and target.fp8_max_tile_n and tiles.tile_n > target.fp8_max_tile_n:
        tiles = replace(tiles, tile_n=target.fp8_max_tile_n)
    if target.max_warps and tiles.num_warps > target.max_warps:
        tiles = replace(tiles, num_warps=target.max_warps)
    if target.fp32_warps and q_bytes == 4:
        tiles = replace(tiles, num_warps=target.fp32_warps)
    if target.max_stages and tiles.num_stages > target.max_stages:
        tiles = replace(tiles, num_stages=target.max_stages)
    if tiles.block_m < 64 and q_bytes < 4:  # 16-bit decode tiles: the target's register budget and warps
        wide = head_size_pad > 128
        # head 64 keeps ptxas's choice: nothing spilled there, and a budget only moved it from 4-5
        # programs an SM to 3-4
        budget = target.wide_decode_registers if wide else target.decode_registers if head_size_pad == 128 else None
        if budget:
            tiles = replace(tiles, max_registers=budget)
        if wide and target.wide_decode_warps:
            tiles = replace(tiles, num_warps=target.wide_decode_warps)
    # registers a lane grow with the head and the element width as with the tile's area
    weight = max(head_size_pad, 128) * max(q_bytes, 2) // 256
    while target.max_tile_elems and tiles.block_m * tiles.tile_n * weight > target.max_tile_elems:
        if tiles.tile_n > 16 and tiles.tile_n >= tiles.block_m // 2:
            tiles = replace(tiles, tile_n=tiles.tile_n // 2)
        elif tiles.block_m > 16 and tiles.block_q > 1:
            tiles = replace(tiles, block_m=tiles.block_m // 2, block_q=tiles.block_q // 2)
        elif tiles.tile_n > 16:
            tiles = replace(tiles, tile_n=tiles.tile_n // 2)
        else:
            break

    def over(t) -> bool:
        return tiles_shared_bytes(t, head_size_pad, q_bytes, kv_bytes, target.shared_overhead, target) > target.max_shared

    while over(tiles):
        if tiles.num_stages > 2:
            tiles = replace(tiles, num_stages=tiles.num_stages - 1)
        elif tiles.tile_n > 16:
            tiles = replace(tiles, tile_n=tiles.tile_n // 2)
        elif tiles.num_stages > 1:
            tiles = replace(tiles, num_stages=1)
        elif tiles.block_m > 16 and tiles.block_q > 1:
            tiles = replace(tiles, block_m=tiles.block_m // 2, block_q=tiles.block_q // 2)
        else:
            break
    return tiles
