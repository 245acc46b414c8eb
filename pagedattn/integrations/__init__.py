"""Integrations with other libraries (optional dependencies, imported on use).

``pagedattn.integrations.transformers``: ``attn_implementation="pagedattn"`` for Hugging Face
transformers (``pip install -e ".[integrations]"`` from a checkout; docs/transformers.md).

``pagedattn.integrations.vllm``: an out-of-tree attention backend for vLLM (``pip install -e ".[vllm]"``,
then ``vllm serve MODEL --attention-backend CUSTOM``; docs/vllm.md).
"""
