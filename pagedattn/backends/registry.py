"""The backend registry and the selector.

Selection order: an explicit ``name`` argument, else the environment variable
``PAGEDATTN_BACKEND`` (read at each selection, never at import), else the automatic choice.

* A backend named explicitly (argument or environment) that cannot serve the configuration
  raises ValueError listing its reasons: the caller asked for it, a silent fallback would hide
  the problem.
* The automatic choice walks :data:`AUTO_PRIORITY` and returns the first backend that can
  serve; each one it skips is logged (logger ``pagedattn.backends``, level INFO) with its
  reasons.
"""

from __future__ import annotations

import logging
import os

from pagedattn.backends.base import AttentionBackend, BackendConfig

__all__ = [
    "ENV_VAR",
    "AUTO_PRIORITY",
    "register_backend",
    "get_backend",
    "list_backends",
    "select_backend",
]

logger = logging.getLogger("pagedattn.backends")

ENV_VAR = "PAGEDATTN_BACKEND"
# The automatic choice, best first. "mla" (MLA layers' latent cache) and "helion" are chosen by name only.
AUTO_PRIORITY = ["triton", "flashinfer", "sdpa", "flex", "torch"]

_REGISTRY: dict[str, AttentionBackend] = {}
_BUILTINS_LOADED = False


def _load_builtins() -> None:
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    from pagedattn.backends.flashinfer import FlashInferBackend
    from pagedattn.backends.flex import FlexBackend
    from pagedattn.backends.helion_backend import HelionBackend
    from pagedattn.backends.mla import MLABackend
    from pagedattn.backends.sdpa import SdpaBackend
    from pagedattn.backends.torch_backend import TorchBackend
    from pagedattn.backends.triton_backend import TritonBackend

    for cls in (TritonBackend, TorchBackend, SdpaBackend, FlexBackend, FlashInferBackend, MLABackend, HelionBackend):
        if cls.name not in _REGISTRY:
            _REGISTRY[cls.name] = cls()


def register_backend(backend: AttentionBackend, *, priority: int | None = None, replace: bool = False) -> None:
    """Add ``backend`` (an instance) under ``backend.name``.

    ``priority``: its index in the automatic order (None: chosen by name only). ``replace``:
    allow overriding a backend of the same name.
    """
    _load_builtins()
    if not isinstance(backend, AttentionBackend):
        raise TypeError(f"backend must be an AttentionBackend instance, got {type(backend).__name__}")
    if not backend.name:
        raise ValueError("backend.name must be a non-empty string")
    if backend.name in _REGISTRY and not replace:
        raise ValueError(f"a backend named {backend.name!r} is already registered (pass replace=True)")
    _REGISTRY[backend.name] = backend
    if priority is not None:
        if backend.name in AUTO_PRIORITY:
            AUTO_PRIORITY.remove(backend.name)
        AUTO_PRIORITY.insert(priority, backend.name)


def unregister_backend(name: str) -> None:
    """Remove a backend (and its place in the automatic order)."""
    _load_builtins()
    _REGISTRY.pop(name, None)
    if name in AUTO_PRIORITY:
        AUTO_PRIORITY.remove(name)


def list_backends() -> list[str]:
    """Names of the registered backends (available here or not)."""
    _load_builtins()
    return sorted(_REGISTRY)


def get_backend(name: str) -> AttentionBackend:
    """The backend registered as ``name`` (no capability check); ValueError for an unknown name."""
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; registered: {list_backends()}") from None


def _reasons(backend: AttentionBackend, config: BackendConfig | None) -> list[str]:
    if config is None:
        missing = backend.unavailable_reason()
        return [missing] if missing else []
    return backend.validate(config)


def select_backend(config: BackendConfig | None = None, name: str | None = None) -> AttentionBackend:
    """The backend to use for ``config``.

    Parameters
    ----------
    config : BackendConfig, optional
        What the layers need. Without it only availability (installed packages) is checked.
    name : str, optional
        Use this backend; else ``$PAGEDATTN_BACKEND``; else the first of :data:`AUTO_PRIORITY`
        that can serve ``config``.

    Raises
    ------
    ValueError
        The requested backend is unknown or cannot serve ``config`` (the message lists why), or
        no backend can (the message lists every backend's reasons).

    Examples
    --------
    >>> cfg = BackendConfig("cuda", torch.bfloat16, 128, 32, 8, features={"causal", "sinks"})
    >>> backend = select_backend(cfg)               # triton on a GPU
    >>> md = backend.plan(block_table, seq_lens, query_start_loc, cfg)
    >>> out = backend.forward(q, k_cache, v_cache, md, sinks=sinks)
    """
    source = "argument"
    if name is None:
        env = os.environ.get(ENV_VAR, "").strip()
        if env:
            name, source = env, f"${ENV_VAR}"
    if name is not None:
        backend = get_backend(name)
        reasons = _reasons(backend, config)
        if reasons:
            raise ValueError(
                f"attention backend {name!r} (requested by {source}) cannot serve {config}: " + "; ".join(reasons)
            )
        return backend

    _load_builtins()
    skipped = []
    for candidate in AUTO_PRIORITY:
        backend = _REGISTRY.get(candidate)
        if backend is None:
            continue
        reasons = _reasons(backend, config)
        if not reasons:
            if skipped:
                logger.info("selected attention backend %r after skipping %s", candidate,
                            ", ".join(n for n, _ in skipped))
            return backend
        skipped.append((candidate, reasons))
        logger.info("skipping attention backend %r: %s", candidate, "; ".join(reasons))
    detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in skipped)
    raise ValueError(f"no attention backend can serve {config} ({detail})")
