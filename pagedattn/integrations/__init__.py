"""Integrations with other libraries (optional dependencies, imported on use).

``pagedattn.integrations.transformers``: ``attn_implementation="pagedattn"`` for Hugging Face
transformers (``pip install -e ".[integrations]"`` from a checkout; docs/transformers.md).
"""
