"""A synthetic drafter training set (counting sequences with token-derived features) and a tiny drafter config
for the drafter, data and Weaver tests."""
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from drafttree.drafter import DFlashConfig
from drafttree.training.data import FeatureShardWriter


V, H, LAYER_IDS = 64, 32, [0, 1, 2]


def synthetic(tmp_path: Path, n_seq=24, T=40):
    """Counting sequences (next = cur + 1 mod V) with features derived from the tokens, and a tied
    'target' embedding/head: a drafter can learn block index i -> anchor + i."""
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(V, H, generator=g)
    mix = torch.randn(H, 3 * H, generator=g) / H ** 0.5
    with FeatureShardWriter(tmp_path / "data", LAYER_IDS, tokens_per_shard=300) as w:
        for _ in range(n_seq):
            ids = (torch.randint(0, V, (1,), generator=g) + torch.arange(T)) % V
            feats = embed[ids] @ mix + 0.1 * torch.randn(T, 3 * H, generator=g)
            mask = torch.arange(T) >= 8
            w.add(ids, feats, mask)
    target = tmp_path / "target"
    target.mkdir()
    save_file({"model.embed_tokens.weight": embed}, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": H, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": V, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": True}))
    return tmp_path / "data", target, embed


def tiny_cfg(**kw):
    base = dict(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, vocab_size=V, target_layer_ids=LAYER_IDS, block_size=4, rope_theta=10000.0,
                max_position_embeddings=128, rms_norm_eps=1e-5, num_target_layers=4)
    base.update(kw)
    return DFlashConfig(**base)


def synthetic_paths(tmp):
    from safetensors.torch import load_file as lf
    return Path(tmp) / "data", lf(str(Path(tmp) / "target" / "model.safetensors"))["model.embed_tokens.weight"]
