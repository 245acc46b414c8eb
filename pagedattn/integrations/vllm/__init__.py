"""pagedattn as an out-of-tree attention backend of vLLM (``--attention-backend CUSTOM``).

>>> pip install -e ".[vllm]"      # from a checkout
>>> vllm serve <model> --attention-backend CUSTOM

Installing the package declares a ``vllm.general_plugins`` entry point, :func:`register`, which
vLLM runs in every process it starts (front end, engine core, each tensor / pipeline parallel
worker). It points vLLM's ``AttentionBackendEnum.CUSTOM`` at this package's ``CustomBackend``,
which vLLM resolves while it builds a model's layers: for a model with latent attention
(``model_config.use_mla``: DeepSeek-V2/V3, Kimi K2) it is
:class:`pagedattn.integrations.vllm.mla.PagedAttnMLABackend`, else
:class:`pagedattn.integrations.vllm.backend.PagedAttnBackend`. vLLM has one ``CUSTOM`` slot
(0.26 has no way to register a second name) and asks every backend whether it serves latent
attention, so one name answers both kinds of model. The backend modules (which import vLLM)
are loaded only when vLLM resolves the class. Serves vLLM 0.26.0 through 0.33.0
(``compat.py`` holds what differs between them); docs/vllm.md says what is declared and what is
tested where.

Importing this package does not import vLLM.
"""

from __future__ import annotations

import logging

__all__ = ["BACKEND_CLASS_PATH", "backend_class", "register"]

BACKEND_CLASS_PATH = "pagedattn.integrations.vllm.CustomBackend"

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


def backend_class() -> type:
    """The backend class for the model vLLM is building now (the MHA one when none is)."""
    from pagedattn.integrations.vllm.compat import current_model_uses_mla

    if current_model_uses_mla():
        from pagedattn.integrations.vllm.mla import PagedAttnMLABackend

        return PagedAttnMLABackend
    from pagedattn.integrations.vllm.backend import PagedAttnBackend

    return PagedAttnBackend


def __getattr__(name: str):
    # ``CustomBackend`` is resolved at each lookup, with the config vLLM has made current
    if name == "CustomBackend":
        return backend_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
