"""Attention backends: one interface, several implementations, a registry that picks one.

>>> from pagedattn.backends import BackendConfig, select_backend
>>> cfg = BackendConfig("cuda", torch.bfloat16, head_size=128, num_q_heads=32, num_kv_heads=8)
>>> backend = select_backend(cfg)                       # or name="sdpa", or $PAGEDATTN_BACKEND
>>> md = backend.plan(block_table, seq_lens, query_start_loc, cfg)   # once per step
>>> out = backend.forward(q, k_cache, v_cache, md)                   # per layer

Backends: ``triton`` (default), ``sdpa``, ``flex``,
``torch`` (the reference in float32), ``flashinfer`` (FlashInfer's paged wrappers, through
:mod:`pagedattn.adapters.flashinfer`) and ``mla``
(MLA layers over a latent cache, by name). See
docs/backends.md.
"""

from pagedattn.backends.base import (
    FEATURES,
    AttentionBackend,
    BackendConfig,
    BatchMetadata,
    features_of_call,
)
from pagedattn.backends.registry import (
    AUTO_PRIORITY,
    ENV_VAR,
    get_backend,
    list_backends,
    register_backend,
    select_backend,
    unregister_backend,
)

__all__ = [
    "FEATURES",
    "AttentionBackend",
    "BackendConfig",
    "BatchMetadata",
    "features_of_call",
    "AUTO_PRIORITY",
    "ENV_VAR",
    "get_backend",
    "list_backends",
    "register_backend",
    "select_backend",
    "unregister_backend",
]
