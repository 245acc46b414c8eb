"""pagedattn as an out-of-tree attention backend of vLLM (``--attention-backend CUSTOM``).

>>> pip install -e ".[vllm]"      # from a checkout
>>> vllm serve <model> --attention-backend CUSTOM

Installing the package declares a ``vllm.general_plugins`` entry point, :func:`register`, which
vLLM runs in every process it starts (front end, engine core, each tensor / pipeline parallel
worker). It points vLLM's ``AttentionBackendEnum.CUSTOM`` at
:class:`pagedattn.integrations.vllm.backend.PagedAttnBackend`; the backend module (which imports
vLLM) is loaded only when vLLM resolves the class. Serves vLLM 0.26.0 through 0.33.0
(``compat.py`` holds what differs between them); docs/vllm.md says what is declared and what is
tested where.

Importing this package does not import vLLM.
"""

from __future__ import annotations

import logging

__all__ = ["BACKEND_CLASS_PATH", "register"]

BACKEND_CLASS_PATH = "pagedattn.integrations.vllm.backend.PagedAttnBackend"

logger = logging.getLogger(__name__)


def register() -> None:
    """Register pagedattn as vLLM's ``CUSTOM`` attention backend.

    Safe to run any number of times in one process (vLLM's plugin loader may run it again
    in each process it starts): registering the same class path twice leaves the registry as
    one registration does. If another plugin already registered a different class as
    ``CUSTOM``, pagedattn replaces it and logs a warning naming both, because a user who
    installed pagedattn and asked for ``CUSTOM`` asked for it.

    Raises ImportError when vLLM is not installed.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden():
        current = custom.get_path()
        if current == BACKEND_CLASS_PATH:
            return
        logger.warning("pagedattn replaces the CUSTOM attention backend %s with %s", current, BACKEND_CLASS_PATH)
    register_backend(custom, BACKEND_CLASS_PATH)
