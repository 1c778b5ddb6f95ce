"""Start a drafter from the target's own top decoder layers instead of random weights.

The draft layers have the target's shapes, so copying its last layers (plus its final norm, whose
output the shared LM head expects) gives the drafter a working language-model head start; `fc`
starts as the identity on the deepest captured layer, so the context begins as that layer's state.
"""
from __future__ import annotations

import argparse
import sys

import torch

from ..model.weights import read_safetensors_dir
from ..drafter.checkpoint import save_drafter
from .data import FeatureDataset
from ..drafter.model import DFlashDrafter
from .train import drafter_config_from_target, load_target_head


def drafter_from_target_layers(target: str, target_layer_ids: list[int], num_layers: int, block_size: int) -> DFlashDrafter:
    from ..gguf_convert import EMBEDDED, convert_embedded
    from pathlib import Path

    embed, _, norm, cfg = load_target_head(target)
    path = convert_embedded(target) if target in EMBEDDED else Path(target)
    tensors = read_safetensors_dir(path)
    dcfg = drafter_config_from_target(cfg, target_layer_ids, num_layers, block_size)
    drafter = DFlashDrafter(dcfg).float()
    drafter.reset_parameters()
    first_src = cfg["num_hidden_layers"] - num_layers
    state = drafter.state_dict()
    with torch.no_grad():
        for i in range(num_layers):
            src = f"model.layers.{first_src + i}."
            for name in [k for k in state if k.startswith(f"layers.{i}.")]:
                key = src + name.removeprefix(f"layers.{i}.")
                if key in tensors:  # q_norm/k_norm do not exist in llama targets: they stay at ones
                    state[name].copy_(tensors[key])
        if norm is not None:
            state["norm.weight"].copy_(norm)
        h = dcfg.hidden_size
        fc = torch.zeros_like(state["fc.weight"])
        deepest = max(range(len(target_layer_ids)), key=lambda j: target_layer_ids[j])
        fc[:, deepest * h:(deepest + 1) * h] = torch.eye(h)
        state["fc.weight"].copy_(fc)
        if "mask_embedding" in state:
            state["mask_embedding"].copy_(embed.float().mean(0))
    return drafter


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--data", required=True, help="feature shards (for their target_layer_ids)")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    ids = FeatureDataset(a.data).target_layer_ids
    save_drafter(drafter_from_target_layers(a.target, ids, a.layers, a.block_size), a.out)
    print(f"initial drafter from the target's top {a.layers} layers: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
