"""Weights: random initialization on the target device, or a Hugging Face folder's *.safetensors."""

from __future__ import annotations

import glob
import os
import re

import torch

from pagedattn.engine.config import MLAModelConfig, ModelConfig
from pagedattn.engine.model import DecoderModel

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def random_model(cfg: ModelConfig, *, device="cpu", dtype=torch.float32, seed: int = 0,
                 std: float | None = None) -> DecoderModel:
    """A model with N(0, std) matrices (default ``hidden_size ** -0.5``) and unit norms, generated
    directly on ``device`` in ``dtype``; an MLA config gives :func:`pagedattn.engine.mla_model.random_mla_model`'s."""
    if isinstance(cfg, MLAModelConfig):
        from pagedattn.engine.mla_model import random_mla_model

        if std is not None:
            raise ValueError("std: an MLA model's random matrices are scaled by their fan-in; leave std None")
        return random_mla_model(cfg, device=device, dtype=dtype, seed=seed)
    std = cfg.hidden_size ** -0.5 if std is None else std
    model = DecoderModel(cfg, device=device, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    unit = 0.0 if cfg.norm == "gemma" else 1.0  # Gemma's norms scale by 1 + weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(unit)
            else:
                p.normal_(0.0, std, generator=g)
    return model


_PREFIXES = ("model.language_model.", "language_model.model.", "model.")  # Gemma3 multimodal, then causal LMs
_SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _target(model: DecoderModel, name: str):
    """(parameter, first row, last row) that the checkpoint tensor ``name`` fills, or None to skip."""
    cfg = model.config
    if name.startswith(_SKIPPED):
        return None
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if name == "embed_tokens.weight":
        return model.embed, None
    if name == "norm.weight":
        return model.norm.weight, None
    if name == "lm_head.weight":
        return (model.lm_head, None) if model.lm_head is not None else None
    m = _LAYER.match(name)
    if m is None:
        return None
    layer = model.layers[int(m.group(1))]
    rest = m.group(2)
    q_rows, kv_rows = cfg.num_q_heads * cfg.head_size, cfg.num_kv_heads * cfg.head_size
    qkv = {"q_proj": (0, q_rows), "k_proj": (q_rows, q_rows + kv_rows),
           "v_proj": (q_rows + kv_rows, q_rows + 2 * kv_rows)}
    inter = cfg.intermediate_size
    attn, mlp = layer.attn, layer.mlp
    simple = {
        "input_layernorm.weight": layer.input_norm.weight,
        "post_attention_layernorm.weight": layer.post_norm.weight,
        "self_attn.o_proj.weight": attn.o_weight,
        "self_attn.o_proj.bias": attn.o_bias,
        "self_attn.sinks": attn.sinks,
    }
    if layer.sandwich:
        simple["pre_feedforward_layernorm.weight"] = layer.pre_mlp_norm.weight
        simple["post_feedforward_layernorm.weight"] = layer.post_mlp_norm.weight
    if attn.q_norm is not None:
        simple["self_attn.q_norm.weight"] = attn.q_norm.weight
        simple["self_attn.k_norm.weight"] = attn.k_norm.weight
    if cfg.num_experts:
        simple.update({
            "mlp.router.weight": mlp.router_weight, "mlp.router.bias": mlp.router_bias,
            "mlp.experts.gate_up_proj": mlp.gate_up, "mlp.experts.gate_up_proj_bias": mlp.gate_up_bias,
            "mlp.experts.down_proj": mlp.down, "mlp.experts.down_proj_bias": mlp.down_bias,
        })
    else:
        simple["mlp.down_proj.weight"] = mlp.down_weight
    if rest in simple:
        return (simple[rest], None) if simple[rest] is not None else None
    parts = rest.split(".")
    if len(parts) == 3 and parts[0] == "self_attn" and parts[1] in qkv:
        param = attn.qkv_weight if parts[2] == "weight" else attn.qkv_bias
        return (param, qkv[parts[1]]) if param is not None else None
    if rest == "mlp.gate_proj.weight" and not cfg.num_experts:
        return mlp.gate_up_weight, (0, inter)
    if rest == "mlp.up_proj.weight" and not cfg.num_experts:
        return mlp.gate_up_weight, (inter, 2 * inter)
    return None


def load_safetensors(model: DecoderModel, folder: str) -> DecoderModel:
    """Fill ``model`` from ``folder/*.safetensors`` (Hugging Face names; q/k/v and gate/up are
    written into the fused matrices). Raises ValueError for a missing file, a tensor of the wrong
    shape or a parameter the checkpoint does not cover."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"model folder {folder!r} has no *.safetensors files")
    filled = {id(p): 0 for p in model.parameters()}
    with torch.no_grad():
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    target = _target(model, name)
                    if target is None:
                        continue
                    param, rows = target
                    dest = param if rows is None else param[rows[0]:rows[1]]
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(dest.shape):
                        raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}; "
                                         f"the config implies {tuple(dest.shape)}")
                    dest.copy_(tensor)
                    filled[id(param)] += dest.numel()
    missing = [n for n, p in model.named_parameters() if filled[id(p)] != p.numel()]
    if missing:
        raise ValueError(f"checkpoint in {folder!r} does not cover {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")
    return model


def load_model(cfg: ModelConfig, folder: str | None, *, device="cpu", dtype=torch.float32,
               seed: int = 0) -> DecoderModel:
    """From ``folder`` when given, else random weights (a preset)."""
    if folder is None:
        return random_model(cfg, device=device, dtype=dtype, seed=seed)
    if isinstance(cfg, MLAModelConfig):
        raise ValueError(f"folder {folder!r}: the MLA model runs as a preset with random weights only")
    return load_safetensors(DecoderModel(cfg, device=device, dtype=dtype), folder)
