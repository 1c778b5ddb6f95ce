"""The shipped DFlash drafter as llama.cpp's `draft-dflash` reads it: exported through llama.cpp's own converter
(`convert_hf_to_gguf.py --target-model-dir`, from the pinned sdist's source), so `drafttree bench-peers` can run
llama.cpp's DFlash loop with the same drafter weights.

What cannot be carried over as it is, and what is done instead:
- SmolLM2 has no spare vocabulary row for the mask token, so drafttree's drafter keeps a learned `mask_embedding`
  beside the published tensors (`mask_token_id: null`). llama.cpp's converter accepts a draft-provided mask vector
  for an existing id (it patches the draft's own copy of the embedding table; the target's stays as it is): the id
  used is `<gh_stars>`, a special token a chat reply never contains, so no anchor is ever embedded as the mask.
- drafttree scores a reduced draft vocabulary (the `draft_vocab` ids); llama.cpp's converter writes DFlash with the
  target's whole LM head, so there the drafter scores every id. The rows it shares are the same rows of the same
  head, so the scores on the reduced ids are the same; llama.cpp's drafter may also propose ids drafttree's never does.
- The converter reads the mask vector from a `mask_embedding.pt` file (torch's format, its own `torch.load(...,
  weights_only=True)`): that one file is written here for it, and drafttree itself never reads it.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

MASK_TOKEN = "<gh_stars>"  # never in a chat reply: the draft's embedding row for it becomes the mask vector


def hf_layout(drafter_dir: Path, tokenizer, out: Path) -> int:
    """The drafter as the converter reads a DFlash checkpoint (config.json, model.safetensors, mask_embedding.pt);
    returns the mask token id."""
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    if not isinstance(mask_id, int) or mask_id == tokenizer.unk_token_id:
        raise ValueError(f"the target's tokenizer has no {MASK_TOKEN} token to carry the drafter's mask vector")
    config = json.loads((drafter_dir / "config.json").read_text())
    config["dflash_config"] = {**config["dflash_config"], "mask_token_id": mask_id}
    config["dflash_config"].pop("draft_vocab_size", None)  # the converter writes the whole head (module docstring)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    with safe_open(str(drafter_dir / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k not in ("mask_embedding", "draft_vocab")}
        mask = f.get_tensor("mask_embedding").float()
    save_file(tensors, str(out / "model.safetensors"))
    torch.save({"mask_token_id": mask_id, "embedding": mask}, out / "mask_embedding.pt")
    return mask_id


def export_drafter_gguf(drafter_dir: str | Path, target_dir: str | Path, out_file: str | Path,
                        outtype: str = "f16") -> Path:
    """Write `out_file` (a DFlash GGUF for llama.cpp) from a drafttree drafter and its target's HF directory."""
    from transformers import AutoTokenizer

    from .llama_tools import converter_script

    drafter_dir, target_dir, out_file = Path(drafter_dir), Path(target_dir), Path(out_file)
    script = converter_script()
    staging = out_file.parent / (out_file.name + ".hf")
    partial = out_file.with_name(out_file.name + ".partial")
    try:
        hf_layout(drafter_dir, AutoTokenizer.from_pretrained(str(target_dir)), staging)
        done = subprocess.run([sys.executable, str(script), str(staging), "--target-model-dir", str(target_dir),
                               "--outtype", outtype, "--outfile", str(partial)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"llama.cpp's converter failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        partial.rename(out_file)
    finally:
        partial.unlink(missing_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
    return out_file


def drafter_gguf(drafter_dir: str | Path, target_dir: str | Path, outtype: str = "f16") -> Path:
    """The drafter's DFlash GGUF, exported once per weights file and type and cached beside llama.cpp's tools."""
    from .llama_tools import tool_dir

    weights = Path(drafter_dir) / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()[:12]
    out = tool_dir() / "drafters" / f"{Path(drafter_dir).name}-{digest}-{outtype}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        export_drafter_gguf(drafter_dir, target_dir, out, outtype)
    return out
