"""Weaver checkpoints: config.json + model.safetensors, loaded strictly (every tensor named and shaped as
the config says, nothing extra). Only safetensors are read: nothing is ever unpickled."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..atomic import atomic_path, atomic_write_text
from ..validate import InputError, read_json
from .model import Weaver, WeaverConfig

FORMAT = "drafttree-weaver"
VERSION = 1


class WeaverCheckpointError(InputError):
    """A Weaver directory that cannot be loaded."""


def save_weaver(weaver: Weaver, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {n: (t.detach().to(dtype) if dtype is not None and t.is_floating_point() else t.detach()).contiguous().cpu()
               for n, t in weaver.state_dict().items()}
    # weights first, then the config: a config.json never points at missing weights
    with atomic_path(path / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_text(path / "config.json",
                      json.dumps({"format": FORMAT, "version": VERSION, **weaver.config.to_dict()}, indent=2) + "\n")
    return path


def load_weaver_config(path: str | Path) -> WeaverConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise WeaverCheckpointError(f"{path}: no config.json (expected a Weaver directory from `drafttree train weaver`)")
    d = read_json(cfg_file, "the Weaver config")
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise WeaverCheckpointError(f"{cfg_file}: not a Weaver config (format {d.get('format') if isinstance(d, dict) else None!r}, "
                                    f"expected {FORMAT!r})")
    if d.get("version") != VERSION:
        raise WeaverCheckpointError(f"{cfg_file}: unsupported Weaver config version {d.get('version')!r} (expected {VERSION})")
    fields = {k: v for k, v in d.items() if k not in ("format", "version")}
    unknown = sorted(set(fields) - set(WeaverConfig.__dataclass_fields__))
    if unknown:
        raise WeaverCheckpointError(f"{cfg_file}: unknown Weaver config keys {unknown}")
    try:
        return WeaverConfig(**fields)
    except TypeError as e:  # a required key missing
        raise WeaverCheckpointError(f"{cfg_file}: {e}") from None
    except ValueError as e:
        raise WeaverCheckpointError(f"{cfg_file}: {e}") from None


def load_weaver(path: str | Path, dtype: torch.dtype = torch.float32) -> Weaver:
    path = Path(path)
    cfg = load_weaver_config(path)
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise WeaverCheckpointError(f"{path}: no model.safetensors")
    try:
        with safe_open(str(weights), framework="pt") as sf:
            tensors = {n: sf.get_tensor(n) for n in sf.keys()}
    except (SafetensorError, OSError) as e:
        raise WeaverCheckpointError(f"{weights}: unreadable, perhaps truncated ({e}); copy or train the Weaver again") from None
    weaver = Weaver(cfg)
    expected = weaver.state_dict()
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise WeaverCheckpointError(f"{path}: tensors do not match the config: missing {missing}, unexpected {unexpected}")
    bad = [f"{n}: checkpoint {tuple(tensors[n].shape)} vs config {tuple(t.shape)}"
           for n, t in expected.items() if tensors[n].shape != t.shape]
    if bad:
        raise WeaverCheckpointError(f"{path}: shape mismatches: " + "; ".join(bad))
    weaver.load_state_dict({n: t.to(dtype) for n, t in tensors.items()})
    return weaver.to(dtype).eval()


def check_weaver_fits(cfg: WeaverConfig, drafter_config, target_config, where: str = "the Weaver") -> None:
    """One-line errors when a Weaver was trained for another drafter or target."""
    depth = drafter_config.block_size - 1
    problems = []
    if cfg.vocab_size != target_config.vocab_size:
        problems.append(f"vocabulary {cfg.vocab_size} vs the target's {target_config.vocab_size}")
    if cfg.embed_size != target_config.hidden_size:
        problems.append(f"embedding width {cfg.embed_size} vs the target's {target_config.hidden_size}")
    if cfg.drafter_hidden_size != drafter_config.hidden_size:
        problems.append(f"drafter width {cfg.drafter_hidden_size} vs the drafter's {drafter_config.hidden_size}")
    if cfg.max_depth < depth:
        problems.append(f"max depth {cfg.max_depth} < the drafter's {depth} drafted positions")
    if problems:
        raise WeaverCheckpointError(f"{where} does not fit this drafter and target: " + "; ".join(problems))
