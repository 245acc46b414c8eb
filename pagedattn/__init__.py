"""pagedattn: portable, fast paged attention for LLM inference, in Triton and PyTorch.

The public functions are imported lazily, so that ``TRITON_INTERPRET`` can still be set
(by ``pagedattn check`` on a machine without a GPU) after ``import pagedattn``.
"""

__version__ = "0.1.0"

__all__ = [
    "paged_attention",
    "varlen_attention",
    "write_kv",
    "merge_attention_states",
    "plan_attention",
    "AttentionPlan",
    "validate_metadata",
    "mla_decode",
    "write_mla_kv",
]

_PUBLIC = {
    "paged_attention": "pagedattn.api",
    "varlen_attention": "pagedattn.api",
    "write_kv": "pagedattn.api",
    "merge_attention_states": "pagedattn.api",
    "plan_attention": "pagedattn.plan",
    "AttentionPlan": "pagedattn.plan",
    "validate_metadata": "pagedattn.validate",
    "mla_decode": "pagedattn.mla",
    "write_mla_kv": "pagedattn.mla",
}


def __getattr__(name):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'pagedattn' has no attribute {name!r}")
