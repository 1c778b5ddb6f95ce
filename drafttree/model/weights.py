"""Reading Hugging Face safetensors checkpoints into the dense runtime (never unpickling)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig
from .transformer import Transformer


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or sharded with an index)."""
    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}: drafttree loads weights from safetensors (or GGUF) only")
    tensors = {}
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"checkpoint shard {f.name} listed in the index is missing from {path}")
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    tensors[k] = sf.get_tensor(k)
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise ValueError(f"cannot read {f}: {e} (is the file complete and in safetensors format?)") from e
    return tensors


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_RENAME = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_norm.weight",
    "self_attn.o_proj.weight": "attn.o.weight",
    "self_attn.o_proj.bias": "attn.o.bias",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
    "mlp.down_proj.bias": "mlp.down.bias",
}
# Checkpoint tensors that the runtime fuses into one matmul: (fused name, parts in order).
_FUSED = {
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.gate_up.bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
}


def split_checkpoint(hf: dict[str, torch.Tensor], tie_word_embeddings: bool,
                     family: str) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """A Hugging Face checkpoint's tensors split into the top-level ones under the runtime's names and each
    layer's under its name inside the layer; RoPE tables are skipped (derived from the config)."""
    out: dict[str, torch.Tensor] = {}
    per_layer: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in hf.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "model.embed_tokens.weight":
            out["embed_tokens.weight"] = t
        elif name == "model.norm.weight":
            out["norm.weight"] = t
        elif name == "lm_head.weight":
            if not tie_word_embeddings:
                out["lm_head.weight"] = t
        elif m := _LAYER.fullmatch(name):
            per_layer.setdefault(int(m.group(1)), {})[m.group(2)] = t
        else:
            raise ValueError(f"unexpected tensor {name!r} in a {family} checkpoint")
    return out, per_layer


def to_runtime_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename (and fuse) Hugging Face llama/qwen3 tensor names into the runtime's."""
    out, per_layer = split_checkpoint(hf, cfg.tie_word_embeddings, cfg.model_type)
    for i, parts in sorted(per_layer.items()):
        if i >= cfg.num_layers:
            raise ValueError(f"checkpoint has layer {i} but config.num_hidden_layers is {cfg.num_layers}")
        for fused, names in _FUSED.items():
            present = [n for n in names if n in parts]
            if present and len(present) != len(names):
                raise ValueError(f"layer {i}: found {present} but not all of {names}")
            if present:
                out[f"layers.{i}.{fused}"] = torch.cat([parts.pop(n) for n in names], dim=0)
        for n, t in parts.items():
            if n not in _RENAME:
                raise ValueError(f"unexpected tensor 'model.layers.{i}.{n}' in a {cfg.model_type} checkpoint")
            out[f"layers.{i}.{_RENAME[n]}"] = t
    return out


def load_checked(model_cls, cfg, state: dict[str, torch.Tensor], dtype: torch.dtype):
    """Build `model_cls(cfg)` on the meta device and assign `state`, naming missing, unexpected and
    mis-shaped tensors; shared by the dense and the hybrid builders."""
    with torch.device("meta"):
        model = model_cls(cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} tensors the config does not use, e.g. {unexpected[:3]}")
    for k, t in state.items():
        if tuple(t.shape) != tuple(expected[k].shape):
            raise ValueError(f"shape mismatch for {k}: checkpoint {tuple(t.shape)}, config expects {tuple(expected[k].shape)}")
    model.load_state_dict({k: t.to(dtype) for k, t in state.items()}, assign=True, strict=True)
    model.init_rope()
    return model


def build_dense_model(hf_config, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> Transformer:
    cfg = ModelConfig.from_hf(hf_config)
    return load_checked(Transformer, cfg, to_runtime_state_dict(tensors, cfg), dtype).eval()
