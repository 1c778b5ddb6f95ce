"""Drafter checkpoints in the published DFlash layout: config.json + model.safetensors.

config.json is a Qwen3 config plus `block_size`, `num_target_layers` and
`dflash_config = {target_layer_ids, mask_token_id}`; tensor names carry no prefix
(`fc.weight`, `layers.0.self_attn.q_proj.weight`, ...). A published directory loads unchanged.
drafttree additions, ignored by other loaders' configs but present as tensors:
`mask_embedding` [H] (when `mask_token_id` is null) and `draft_vocab` [Vd] (reduced head).
Only safetensors are read: nothing is ever unpickled.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from drafttree.atomic import atomic_path, atomic_write_text
from drafttree.drafter.model import DFlashConfig, DFlashDrafter
from drafttree.validate import InputError, check_drafter_config, read_json

# names used by other drafter families for the same tensors (vLLM maps them the same way)
ALIASES = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}


class CheckpointError(InputError):
    """A drafter directory that cannot be loaded."""


def config_to_dict(cfg: DFlashConfig) -> dict:
    d = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id},
    }
    if cfg.target_hidden_size != cfg.hidden_size:
        d["dflash_config"]["target_hidden_size"] = cfg.target_hidden_size
    if cfg.draft_vocab_size:
        d["dflash_config"]["draft_vocab_size"] = cfg.draft_vocab_size
    return d


def config_from_dict(d: dict) -> DFlashConfig:
    if not isinstance(d, dict):
        raise CheckpointError(f"a drafter config must be a JSON object, got {type(d).__name__}")
    check_drafter_config(d)  # DFlashConfig would quietly int() a float layer id
    dc = dict(d.get("dflash_config") or {})
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"unsupported rope scaling {rope_type!r} in drafter config (only plain RoPE)")
    theta = rope.get("rope_theta", d.get("rope_theta", 1_000_000.0))
    if any(t != "full_attention" for t in d.get("layer_types") or []):
        raise CheckpointError("sliding-window drafter layers are not supported")
    if d.get("attention_bias"):
        raise CheckpointError("drafters with attention biases are not supported")
    block_size = d.get("block_size", dc.get("block_size"))
    if block_size is None:
        raise CheckpointError("drafter config has no block_size (top level or dflash_config)")
    mask_id = dc.get("mask_token_id", d.get("mask_token_id"))
    if mask_id is not None and int(mask_id) < 0:
        mask_id = None
    n_heads = d["num_attention_heads"]
    return DFlashConfig(
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=n_heads,
        num_key_value_heads=d.get("num_key_value_heads") or n_heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
        vocab_size=d["vocab_size"],
        target_layer_ids=list(dc.get("target_layer_ids") or d.get("target_layer_ids") or []),
        num_target_layers=d.get("num_target_layers"),
        block_size=int(block_size),
        mask_token_id=None if mask_id is None else int(mask_id),
        target_hidden_size=dc.get("target_hidden_size"),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position_embeddings=d.get("max_position_embeddings", 32768),
        draft_vocab_size=dc.get("draft_vocab_size"),
    )


def save_drafter(drafter: DFlashDrafter, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in drafter.state_dict().items():
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[name] = t.contiguous().cpu()
    # each file renamed into place when complete, weights first: a config.json never points at missing weights
    with atomic_path(path / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_text(path / "config.json", json.dumps(config_to_dict(drafter.config), indent=2) + "\n")
    return path


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards named by model.safetensors.index.json."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path}: no model.safetensors (or model.safetensors.index.json)")
    from ..validate import check_safetensors

    out = {}
    for f in files:
        check_safetensors(path / f, "the drafter's weights", "copy or train the drafter again")
        with safe_open(str(path / f), framework="pt") as sf:
            for name in sf.keys():
                out[name] = sf.get_tensor(name)
    return out


def load_drafter_config(path: str | Path) -> DFlashConfig:
    """The checked config of a drafter directory (cheap: the CLI calls it before loading any model)."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a DFlash drafter directory)")
    try:
        return config_from_dict(read_json(cfg_file, "the drafter config"))
    except (KeyError, ValueError) as e:  # name the file: the checks themselves only know the field
        msg = f"lacks the key {e}" if isinstance(e, KeyError) else str(e).removeprefix(f"{cfg_file}: ")
        raise CheckpointError(f"{cfg_file}: {msg}") from None


def load_drafter(path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> DFlashDrafter:
    """Load a drafter directory (published DFlash layout or saved by drafttree)."""
    path = Path(path)
    cfg = load_drafter_config(path)
    tensors = {}
    for name, t in read_tensors(path).items():
        name = name.removeprefix("model.")  # tolerate a `model.` prefix from HF-style exports
        tensors[ALIASES.get(name, name)] = t
    drafter = DFlashDrafter(cfg)
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        hint = ""
        if "mask_embedding" in missing:
            hint = " (dflash_config.mask_token_id is null, so a learned `mask_embedding` tensor is required)"
        raise CheckpointError(f"{path}: tensors do not match the config{hint}: missing {missing}, unexpected {unexpected}")
    bad = [f"{n}: checkpoint {tuple(tensors[n].shape)} vs config {tuple(t.shape)}"
           for n, t in expected.items() if tensors[n].shape != t.shape]
    if bad:
        raise CheckpointError(f"{path}: shape mismatches: " + "; ".join(bad))
    target_dtype = dtype or next(t.dtype for n, t in tensors.items() if t.is_floating_point())
    drafter.to(dtype=target_dtype)
    with torch.no_grad():
        for n, t in drafter.state_dict().items():
            t.copy_(tensors[n])  # state_dict() tensors share storage with the parameters/buffers
    drafter._head_cache = None
    return drafter.to(device).eval()
