import json

import pytest
import torch
from safetensors.torch import save_file

from drafttree.drafter import CheckpointError, DFlashConfig, DFlashDrafter, load_drafter, save_drafter

H, I, NH, NKV, D, L, K = 32, 48, 4, 2, 8, 2, 3


def published_dir(tmp_path, aliases=False, drop=None, bad_shape=None, extra=None):
    """A drafter directory built by hand exactly as published DFlash checkpoints are laid out."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)
    t = {("encoder.fc.weight" if aliases else "fc.weight"): r(H, K * H),
         ("encoder.output_norm_enc.weight" if aliases else "hidden_norm.weight"): r(H),
         "norm.weight": r(H)}
    for i in range(L):
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": r(H), p + "post_attention_layernorm.weight": r(H),
                  p + "self_attn.q_proj.weight": r(NH * D, H), p + "self_attn.k_proj.weight": r(NKV * D, H),
                  p + "self_attn.v_proj.weight": r(NKV * D, H), p + "self_attn.o_proj.weight": r(H, NH * D),
                  p + "self_attn.q_norm.weight": r(D), p + "self_attn.k_norm.weight": r(D),
                  p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
                  p + "mlp.down_proj.weight": r(H, I)})
    if drop:
        del t[drop]
    if bad_shape:
        t[bad_shape] = r(3)
    if extra:
        t[extra] = r(2)
    save_file(t, str(tmp_path / "model.safetensors"))
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H, "intermediate_size": I,
           "num_hidden_layers": L, "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": D,
           "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 512, "vocab_size": 100,
           "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "block_size": 8, "num_target_layers": 12,
           "dflash_config": {"target_layer_ids": [1, 5, 9], "mask_token_id": 99}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return t


@pytest.mark.parametrize("aliases", [False, True])
def test_published_layout_loads_and_runs(tmp_path, aliases):
    tensors = published_dir(tmp_path, aliases=aliases)
    d = load_drafter(tmp_path, dtype=torch.float32)
    assert d.config.block_size == 8 and d.config.mask_token_id == 99 and d.config.target_layer_ids == [1, 5, 9]
    assert torch.equal(d.fc.weight, tensors["encoder.fc.weight" if aliases else "fc.weight"].float())
    assert torch.equal(d.layers[1].mlp.down_proj.weight, tensors["layers.1.mlp.down_proj.weight"].float())
    emb = torch.randn(100, H)
    ctx = d.new_context()
    d.extend_context(ctx, torch.randn(10, K * H), torch.arange(10))
    h = d.draft(ctx, d.block_embeds(5, emb), 10)
    logits = d.draft_logits(h[1:], emb)
    assert logits.shape == (7, 100) and torch.isfinite(logits).all()
    assert load_drafter(tmp_path).fc.weight.dtype == torch.bfloat16  # keeps the checkpoint dtype by default


def test_save_load_roundtrip_bit_identical(tmp_path):
    cfg = DFlashConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH,
                       num_key_value_heads=NKV, head_dim=D, vocab_size=100, target_layer_ids=[0, 3, 4],
                       num_target_layers=6, block_size=4, mask_token_id=None, draft_vocab_size=20,
                       rope_theta=10000.0, max_position_embeddings=512)
    torch.manual_seed(1)
    d = DFlashDrafter(cfg)
    d.set_draft_vocab(torch.randperm(100)[:20])
    save_drafter(d, tmp_path / "ckpt")
    cfg_json = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg_json["dflash_config"]["mask_token_id"] is None and cfg_json["block_size"] == 4
    back = load_drafter(tmp_path / "ckpt")
    assert back.config == cfg
    sd, sd2 = d.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys()
    for n in sd:
        assert sd[n].dtype == sd2[n].dtype and torch.equal(sd[n], sd2[n]), n
    assert "mask_embedding" in sd and "draft_vocab" in sd


@pytest.mark.parametrize("kind", ["missing", "unexpected", "shape"])
def test_clear_errors(tmp_path, kind):
    published_dir(tmp_path, drop="layers.1.self_attn.k_norm.weight" if kind == "missing" else None,
                  extra="layers.1.self_attn.q_proj.bias" if kind == "unexpected" else None,
                  bad_shape="norm.weight" if kind == "shape" else None)
    with pytest.raises(CheckpointError) as e:
        load_drafter(tmp_path)
    msg = str(e.value)
    assert {"missing": "layers.1.self_attn.k_norm.weight", "unexpected": "q_proj.bias", "shape": "norm.weight: checkpoint (3,)"}[kind] in msg


def test_null_mask_id_requires_mask_embedding(tmp_path):
    published_dir(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["dflash_config"]["mask_token_id"] = None
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="mask_embedding"):
        load_drafter(tmp_path)
