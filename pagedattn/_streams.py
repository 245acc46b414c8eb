"""The second CUDA stream a mixed batch's short sequences run on, beside the prefill kernel."""

from __future__ import annotations

import os
import threading

import torch

_LOCAL = threading.local()  # per thread: a capture in one thread never records another's work


def side_stream(device: torch.device):
    """This thread's second stream of ``device``, or None: not a CUDA device,
    ``PAGEDATTN_OVERLAP=0``, or ``device`` is not the current device (Triton launches on the
    current device; a side stream would put the two kernels on two devices).

    :func:`pagedattn.plan_attention` asks for it when it plans such a batch, so that the stream
    exists before a CUDA graph captures the call."""
    if device.type != "cuda" or os.environ.get("PAGEDATTN_OVERLAP", "1") == "0":
        return None
    if device.index is not None and device.index != torch.cuda.current_device():
        return None
    streams = getattr(_LOCAL, "by_device", None)
    if streams is None:
        streams = _LOCAL.by_device = {}
    index = torch.cuda.current_device() if device.index is None else device.index
    stream = streams.get(index)
    if stream is None:
        stream = streams[index] = torch.cuda.Stream(index)
    return stream
