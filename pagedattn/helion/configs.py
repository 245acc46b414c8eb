"""Kernel configs: the ones stored in ``configs.json`` (autotuned on a GPU), else defaults.

``configs.json`` maps ``"<kernel>/d<head_size>/bs<block_size>"`` (``"merge/d<head_size>"`` for
the merge, which never reads the cache) to a ``helion.Config`` as a dict. A call whose shape
has no stored entry uses :func:`default_config`. ``PAGEDATTN_HELION_CONFIGS`` names another file.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

__all__ = ["CONFIGS_PATH", "config_key", "stored_configs", "default_config", "config_for"]

CONFIGS_PATH = Path(__file__).with_name("configs.json")
ENV_VAR = "PAGEDATTN_HELION_CONFIGS"


def config_key(name: str, head_size: int, block_size: int) -> str:
    return f"merge/d{head_size}" if name == "merge" else f"{name}/d{head_size}/bs{block_size}"


@functools.lru_cache(maxsize=8)
def _read(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        return {}
    data = json.loads(p.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of kernel configs, got {type(data).__name__}")
    return {k: v for k, v in data.items() if not k.startswith("_")}  # "_"-keys: notes on how they were tuned


def stored_configs() -> dict:
    """The configs of ``configs.json`` (or of ``$PAGEDATTN_HELION_CONFIGS``), by key."""
    return _read(os.environ.get(ENV_VAR) or str(CONFIGS_PATH))


def default_config(name: str, block_size: int) -> dict:
    """Hand-picked configs for shapes nothing was tuned for (GPU only; reference mode has none).

    Decode: 64-key K/V tiles, 4 warps, 3 stages: the tile and depth that keep loads in flight
    in a memory-bound loop with a 16-row Q block. Prefill: 64 queries by 64 keys, 4 warps, 2
    stages: the FlashAttention-2 shape that fits head size 128 in registers without spilling.
    """
    pages = max(1, 64 // block_size)
    if name == "decode":
        return {"block_sizes": [pages], "num_warps": 4, "num_stages": 3}
    if name == "prefill":
        return {"block_sizes": [64, pages], "num_warps": 4, "num_stages": 2}
    if name == "merge":
        return {"block_sizes": [8, 16], "num_warps": 4, "num_stages": 1}
    raise KeyError(name)


def config_for(name: str, head_size: int, block_size: int) -> str:
    """The config of kernel ``name`` for this shape, as ``helion.Config`` JSON (read per call:
    the lookup is cached, so it costs a dict access)."""
    return _config_json(name, head_size, block_size, os.environ.get(ENV_VAR) or str(CONFIGS_PATH))


@functools.lru_cache(maxsize=64)
def _config_json(name: str, head_size: int, block_size: int, path: str) -> str:
    cfg = _read(path).get(config_key(name, head_size, block_size))
    return json.dumps(cfg if cfg is not None else default_config(name, block_size), sort_keys=True)
