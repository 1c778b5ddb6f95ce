"""Hugging Face tensor names of qwen3_next / qwen3_5 checkpoints -> the hybrid runtime's names.

The GDN input projections of both families become one flat [q | k | v | z | b | a] matmul:
qwen3_next stores them grouped per key head (`in_proj_qkvz`, `in_proj_ba`), qwen3_5 flat and split.
MoE experts are accepted per expert (hub checkpoints) or already fused (transformers v5 in memory).
"""
from __future__ import annotations

import re

import torch

from .hybrid_config import HybridConfig
from .weights import split_checkpoint

_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_IGNORED_PREFIXES = ("mtp.", "model.visual.", "visual.")  # multi-token-prediction head, vision tower
_RENAME = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_norm.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "self_attn.o_proj.bias": "attn.o_proj.bias",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "linear_attn.dt_bias": "gdn.dt_bias",
    "linear_attn.A_log": "gdn.A_log",
    "linear_attn.norm.weight": "gdn.norm.weight",
    "linear_attn.out_proj.weight": "gdn.out_proj.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.experts.gate_up_proj": "mlp.gate_up_proj",
    "mlp.experts.down_proj": "mlp.down_proj",
    "mlp.shared_expert.down_proj.weight": "mlp.shared_expert.down.weight",
    "mlp.shared_expert_gate.weight": "mlp.shared_expert_gate.weight",
}
_FUSED = {  # runtime name: checkpoint parts, concatenated on dim 0 in this order
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.shared_expert.gate_up.weight": ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
    # qwen3_5: already flat
    "gdn.in_proj.weight": (
        "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
        "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight",
    ),
}


def _flatten_qwen3_next_gdn(qkvz: torch.Tensor, ba: torch.Tensor, cfg: HybridConfig) -> torch.Tensor:
    """Per key head h the rows are [q_h (dk), k_h (dk), v (r·dv), z (r·dv)] and [b (r), a (r)]."""
    Hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // Hk
    D = qkvz.shape[-1]
    if qkvz.shape[0] != Hk * (2 * dk + 2 * r * dv) or ba.shape[0] != Hk * 2 * r:
        raise ValueError(f"in_proj_qkvz {tuple(qkvz.shape)} / in_proj_ba {tuple(ba.shape)} do not match the config's GDN heads")
    q, k, v, z = qkvz.view(Hk, -1, D).split([dk, dk, r * dv, r * dv], dim=1)
    b, a = ba.view(Hk, 2 * r, D).split([r, r], dim=1)
    return torch.cat([t.reshape(-1, D) for t in (q, k, v, z, b, a)], dim=0)


def to_hybrid_state_dict(hf: dict[str, torch.Tensor], cfg: HybridConfig) -> dict[str, torch.Tensor]:
    text = "model.language_model."  # qwen3_5 multimodal layout
    hf = {("model." + name[len(text):] if name.startswith(text) else name): t for name, t in hf.items()}
    hf = {name: t for name, t in hf.items() if not name.startswith(_IGNORED_PREFIXES)}
    out, per_layer = split_checkpoint(hf, cfg.tie_word_embeddings, cfg.family)
    for i, parts in sorted(per_layer.items()):
        if i >= cfg.num_layers:
            raise ValueError(f"checkpoint has layer {i} but config.num_hidden_layers is {cfg.num_layers}")
        pre = f"layers.{i}."
        if "linear_attn.in_proj_qkvz.weight" in parts:
            out[pre + "gdn.in_proj.weight"] = _flatten_qwen3_next_gdn(
                parts.pop("linear_attn.in_proj_qkvz.weight"), parts.pop("linear_attn.in_proj_ba.weight"), cfg
            )
        if "linear_attn.conv1d.weight" in parts:
            out[pre + "gdn.conv_weight"] = parts.pop("linear_attn.conv1d.weight").squeeze(1)  # [C, 1, K] -> [C, K]
        if "linear_attn.conv1d.bias" in parts:
            raise ValueError(f"layer {i}: GDN conv1d bias is not supported (Qwen checkpoints have none)")
        experts = {}
        for n in [n for n in parts if _EXPERT.fullmatch(n)]:
            e, kind = _EXPERT.fullmatch(n).groups()
            experts.setdefault(kind, {})[int(e)] = parts.pop(n)
        if experts:
            E = cfg.num_experts
            for kind in ("gate_proj", "up_proj", "down_proj"):
                if sorted(experts.get(kind, {})) != list(range(E)):
                    raise ValueError(f"layer {i}: expected {kind} for experts 0..{E - 1}")
            stack = {kind: torch.stack([experts[kind][e] for e in range(E)]) for kind in experts}
            out[pre + "mlp.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
            out[pre + "mlp.down_proj"] = stack["down_proj"]
        for fused, names in _FUSED.items():
            present = [n for n in names if n in parts]
            if present and len(present) != len(names):
                raise ValueError(f"layer {i}: found {present} but not all of {names}")
            if present:
                out[pre + fused] = torch.cat([parts.pop(n) for n in names], dim=0)
        for n, t in parts.items():
            if n not in _RENAME:
                raise ValueError(f"unexpected tensor 'model.layers.{i}.{n}' in a {cfg.family} checkpoint")
            out[pre + _RENAME[n]] = t
    return out
