"""Input validation shared by the public functions.

Every check runs on tensor metadata only (shape, dtype, device, strides): none reads device
memory, so validation never synchronizes with the host. Each error names the argument.
"""

from __future__ import annotations

import torch

from pagedattn.ops.common.target import UnsupportedOnTarget, target_override, target_props

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn,)
MIN_HEAD_SIZE = 8
MAX_HEAD_SIZE = 256


def check_tensor(
    name: str,
    x,
    *,
    ndim: int | None = None,
    dtypes: tuple | None = None,
    device: torch.device | None = None,
    last_dim_contiguous: bool = True,
) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}; got {str(x.dtype).replace('torch.', '')}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}; all tensors must share a device")
    if last_dim_contiguous and x.dim() > 0 and x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {x.stride(-1)})")


def check_shape(name: str, x: torch.Tensor, expected: tuple) -> None:
    """expected entries of None match any size."""
    ok = x.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, x.shape))
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(x.shape)}")


def check_paged_metadata(block_table, seq_lens, query_start_loc, device: torch.device) -> int:
    """The paged batch's metadata: ``block_table [num_seqs, max_blocks]``, ``seq_lens [num_seqs]``
    and ``query_start_loc [num_seqs + 1]``, int32 on ``device``; returns num_seqs."""
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=device)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=device)
    num_seqs = seq_lens.shape[0]
    check_shape("block_table", block_table, (num_seqs, None))
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=device)
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    return num_seqs


def head_size_supported(head_size: int) -> bool:
    """Multiples of 8 from MIN_HEAD_SIZE to MAX_HEAD_SIZE (padded to a power of two in the kernels)."""
    return MIN_HEAD_SIZE <= head_size <= MAX_HEAD_SIZE and head_size % 8 == 0


def check_head_size(name: str, head_size: int) -> None:
    if not head_size_supported(head_size):
        raise ValueError(
            f"{name}: head_size {head_size} is not supported; use a multiple of 8 "
            f"from {MIN_HEAD_SIZE} to {MAX_HEAD_SIZE}"
        )


def check_scale_arg(name: str, x, device: torch.device) -> None:
    if x is None or isinstance(x, (float, int)):
        return
    check_tensor(name, x, dtypes=(torch.float32,), device=device, last_dim_contiguous=False)
    if x.numel() != 1:
        raise ValueError(f"{name} must be a float or a 1-element float32 tensor, got shape {list(x.shape)}")


def check_per_head(name: str, x, num_q_heads: int, device: torch.device) -> None:
    if x is None:
        return
    check_tensor(name, x, ndim=1, dtypes=(torch.float32,), device=device)
    check_shape(name, x, (num_q_heads,))


def check_optional_int(name: str, x, *, minimum: int) -> None:
    if x is None:
        return
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be an int or None, got {type(x).__name__}")
    if x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")


def refuse_autograd(fn: str, **tensors) -> None:
    """Raise if autograd would record through ``fn``: the kernels have no backward pass, so a
    gradient through them would be silently missing or wrong."""
    if not torch.is_grad_enabled():
        return
    for name, x in tensors.items():
        if isinstance(x, torch.Tensor) and x.requires_grad:
            raise RuntimeError(
                f"{fn}: {name} requires grad, but pagedattn's kernels are inference-only (no backward pass). "
                f"Call it under torch.no_grad() or torch.inference_mode(), or detach the inputs; for training "
                f"use an attention with a backward pass (e.g. torch's scaled_dot_product_attention)."
            )


def interpreted(kernel) -> bool:
    """Whether a ``@triton.jit`` kernel (or a wrapper of one) was made for Triton's interpreter,
    which Triton decides once, when the kernel's module is imported (``TRITON_INTERPRET=1``)."""
    while type(kernel).__name__ not in ("InterpretedFunction", "JITFunction") and hasattr(kernel, "fn"):
        kernel = kernel.fn  # autotuner / heuristics wrappers
    return type(kernel).__name__ == "InterpretedFunction"


def check_runs_on(name: str, x: torch.Tensor, kernels_interpreted: bool) -> None:
    """Raise RuntimeError before any launch when ``x`` is on the CPU and the kernels were not made
    for Triton's interpreter (they would fail inside Triton with "0 active drivers"). Planning for a
    target that is not here (the compile matrix: launches are captured, not made) passes."""
    if x.device.type == "cpu" and not kernels_interpreted and target_override() is None:
        raise RuntimeError(
            f"{name} is on the CPU, where pagedattn's Triton kernels run only in Triton's interpreter; "
            "set TRITON_INTERPRET=1 in the environment before pagedattn is imported (e.g. "
            "`TRITON_INTERPRET=1 python app.py`; Triton fixes the mode when it compiles the kernels at "
            "import), or move the tensors to a GPU"
        )


def check_fp8_cache(name: str, cache: torch.Tensor, device) -> None:
    """UnsupportedOnTarget (a ValueError) naming ``name`` when ``cache`` is float8_e4m3fn and ``device``'s GPU cannot
    compile it (NVIDIA before sm89: Triton has no e4m3 type there)."""
    if cache.dtype not in FP8_DTYPES:
        return
    props = target_props(device)
    if not props.fp8e4nv:
        raise UnsupportedOnTarget(f"{name} is {cache.dtype}, which Triton compiles for NVIDIA GPUs of sm89 or newer; "
                                  f"this device is {props.name} ({props.chip}): use a 16-bit cache")
