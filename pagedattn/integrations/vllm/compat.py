"""What differs between the vLLM releases the backend serves (0.26.0 through 0.33.0), in one place.

The backend is written against the newest interface; this module supplies, for an older vLLM,
what that interface lacks, by looking at the installed classes (never at version strings):

* ``max_decode_query_len(vllm_config)``: a 0.33 helper (the widest query a full CUDA graph of
  uniform decodes holds). 0.26 has no such function; its builders compute the same value from
  the speculative config (``1 + k``, ``1 + 2k`` with parallel drafting).
* The config vLLM is building a model with: 0.33's ``get_current_vllm_config_or_none``, 0.26's
  module-level ``_current_vllm_config`` (its getter makes a default config when none is set,
  which needs a GPU).
* The KV-cache shape. 0.26 asks each backend for the cache's logical shape
  (``get_kv_cache_shape``, abstract there) and its memory order (``get_kv_cache_stride_order``,
  else memory follows the logical shape); 0.33 builds the same logical view
  ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` itself from the resolved
  ``KVCacheLayout``. :class:`KvCacheShape`, a base of the backend, declares the two methods
  for a vLLM whose base class declares them, with the answers of vLLM's own FLASH_ATTN and
  TRITON_ATTN: the same logical view, in memory ``[num_blocks, block_size, num_kv_heads, 2 * head_size]`` under the
  default NHD layout or the logical order under HND.
"""

from __future__ import annotations

import vllm.v1.attention.backend as _backend
from vllm.v1.attention.backend import AttentionBackend

__all__ = ["KvCacheShape", "current_model_uses_mla", "max_decode_query_len"]


def _max_decode_query_len_0_26(vllm_config) -> int:
    """vLLM 0.26's widest decode query: 1 + k speculative tokens, plus k mask slots with parallel
    drafting (its ``_init_reorder_batch_threshold``)."""
    spec = getattr(vllm_config, "speculative_config", None)
    k = getattr(spec, "num_speculative_tokens", None) if spec is not None else None
    if not k:
        return 1
    return 1 + (2 if getattr(spec, "parallel_drafting", False) else 1) * k


max_decode_query_len = getattr(_backend, "max_decode_query_len", _max_decode_query_len_0_26)


def current_model_uses_mla() -> bool:
    """Whether the model whose config vLLM has made current uses latent attention (False when none is)."""
    import vllm.config.vllm as config_module

    getter = getattr(config_module, "get_current_vllm_config_or_none", None)
    config = getter() if getter is not None else getattr(config_module, "_current_vllm_config", None)
    model_config = getattr(config, "model_config", None)
    return bool(model_config is not None and model_config.use_mla)


def _get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                        cache_dtype_str: str = "auto") -> tuple[int, ...]:
    # K then V in the last dimension: the view the impl splits at head_size
    return (num_blocks, num_kv_heads, block_size, 2 * head_size)


def _get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    layout = get_kv_cache_layout()
    if layout == "HND":
        return (1, 2, 0, 3, 4) if include_num_layers_dimension else (0, 1, 2, 3)
    if layout in (None, "NHD"):
        return (1, 0, 3, 2, 4) if include_num_layers_dimension else (0, 2, 1, 3)
    raise ValueError(f"KV cache layout {layout!r} is not supported; use NHD or HND")


class KvCacheShape:
    """Placed before AttentionBackend among the backend's bases: on a vLLM whose base class
    declares the two shape methods (0.26), it answers them; elsewhere it adds nothing."""

    if hasattr(AttentionBackend, "get_kv_cache_shape"):
        get_kv_cache_shape = staticmethod(_get_kv_cache_shape)
        get_kv_cache_stride_order = staticmethod(_get_kv_cache_stride_order)
