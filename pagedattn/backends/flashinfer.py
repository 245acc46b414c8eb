"""The ``flashinfer`` backend entry: it says why it cannot serve; the adapter is not written."""

from __future__ import annotations

import importlib

from pagedattn.backends.base import AttentionBackend


class FlashInferBackend(AttentionBackend):
    """Placeholder for FlashInfer's paged kernels.

    ``validate`` reports that the package is missing, or (when it imports) that pagedattn has no
    adapter for it yet, so automatic selection always skips it with a logged reason.
    """

    name = "flashinfer"

    def unavailable_reason(self):
        try:
            importlib.import_module("flashinfer")
        except Exception as e:
            return f"flashinfer is not importable ({type(e).__name__}: {e})"
        return "flashinfer is installed, but pagedattn has no adapter for it yet"

    def forward(self, q, k_cache, v_cache, metadata, **features):
        raise NotImplementedError(self.unavailable_reason())
