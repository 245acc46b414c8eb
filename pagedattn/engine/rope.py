"""RoPE tables from transformers' own initialisers (``transformers.modeling_rope_utils``).

Every RoPE type a config names (default, linear, dynamic, YaRN, Llama-3) is computed by the
function transformers' models call, on the transformers config of the model: the folder's, or
for a preset one built from its shape (:meth:`ModelConfig.hf_kwargs`). The default type goes
through the linear initialiser with factor 1, which is the same formula. ``dynamic`` is
computed once for ``max_len`` positions (transformers recomputes it per forward call once a
sequence passes ``max_position_embeddings``; below that both are the unscaled table).
"""

from __future__ import annotations

import copy

import torch

from pagedattn.engine.config import ModelConfig

SUPPORTED = ("default", "linear", "dynamic", "yarn", "llama3")


def hf_config(cfg: ModelConfig):
    """The transformers config the initialisers read: the folder's, else one built for the preset."""
    if cfg.hf is not None:
        return cfg.hf
    from transformers import AutoConfig

    return AutoConfig.for_model(cfg.model_type, **cfg.hf_kwargs())


def inv_freq_and_scaling(cfg: ModelConfig, layer_type: str, max_len: int) -> tuple[torch.Tensor, float]:
    """(``[head_size // 2]`` fp32 inverse frequencies, attention scaling of cos/sin) of the layers
    of ``layer_type``, from transformers' initialiser of the config's RoPE type."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = copy.deepcopy(hf_config(cfg))
    config.standardize_rope_params()
    nested = layer_type in (config.rope_parameters or {})
    params = config.rope_parameters[layer_type] if nested else config.rope_parameters
    kind = params.get("rope_type", "default")
    if kind not in SUPPORTED:
        raise ValueError(f"rope type {kind!r} is not supported; expected one of {SUPPORTED}")
    if kind == "default":  # linear with factor 1 is the unscaled formula
        params.update(rope_type="linear", factor=1.0)
        kind = "linear"
    kwargs = {"layer_type": layer_type} if nested else {}
    if kind == "dynamic":
        kwargs["seq_len"] = max_len
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, "cpu", **kwargs)
    if inv_freq.shape != (cfg.head_size // 2,):
        raise ValueError(f"RoPE of {inv_freq.shape[0] * 2} dims for head_size {cfg.head_size}: partial rotary "
                         "embeddings are not supported")
    return inv_freq.float(), float(scaling)
