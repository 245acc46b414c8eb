"""One module per outside attention library: what pagedattn knows about calling it.

* :mod:`pagedattn.adapters.sdpa`: ``torch.nn.functional.scaled_dot_product_attention``, its
  kernels by name (cuDNN, FlashAttention-2, memory-efficient, math) and the masks it takes.
* :mod:`pagedattn.adapters.flashinfer`: FlashInfer's paged wrappers (decode, prefill, MLA) on
  pagedattn's cache tensors, and the page lists they read.
* :mod:`pagedattn.adapters.cudnn`: cuDNN's paged SDPA graph (cudnn-frontend) on the same tensors.

The ``flashinfer`` backend, the engine's attentions and the benchmark's providers all call these;
none of them calls the libraries directly. Nothing here imports ``flashinfer`` or ``cudnn`` at
import time: each function imports its library when called, and ``availability()`` says why
it cannot run (package missing, no CUDA device, no JIT toolchain) without raising.
"""
