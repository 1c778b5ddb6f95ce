"""bench/scale.py's random files: a Qwen3-shaped Q4_K_M-typed model with random weights that drafttree loads with
the shape asked for and decodes losslessly (lookup = AR), and whose K-quant bytes have the weight std asked for."""
import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
from drafttree.apps.bench.random_gguf import Q4_K_M, random_k_quant, write_random_qwen3  # noqa: E402
from drafttree.engine import generate_ar  # noqa: E402
from drafttree.load import load_target  # noqa: E402
from drafttree.methods import generate  # noqa: E402

SHAPE = (2, 256, 512, 4, 2, 49408)  # layers, hidden, intermediate, heads, kv heads, vocab (> the tokenizer's 49,152)


def test_k_quant_bytes_have_the_std_asked_for():
    from gguf.quants import dequantize
    import gguf

    for type_name in ("Q4_K", "Q6_K"):
        raw = random_k_quant(type_name, 64, 512, np.random.default_rng(0), 0.02)
        w = dequantize(raw, gguf.GGMLQuantizationType[type_name])
        assert w.shape == (64, 512) and abs(float(w.std()) - 0.02) < 0.002, type_name


def test_a_random_qwen3_file_loads_at_its_shape_and_decodes_losslessly(tmp_path):
    path = write_random_qwen3(tmp_path / "random.gguf", SHAPE)
    target = load_target(str(path), compute="q4", threads=1)
    cfg = target.model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.vocab_size) == SHAPE
    assert Q4_K_M["attn_v"] == "Q6_K"
    ids = torch.tensor([1, 100, 200, 300] * 4)
    ar = generate_ar(target, ids, 16, stop_token_ids=()).tokens
    assert generate("lookup", target, ids, 16, stop_token_ids=()).tokens == ar


def test_the_published_4b_drafter_layout_has_its_parameter_count():
    """537,427,200 parameters besides the target's embedding and head (the anchors' count for z-lab's
    Qwen3-4B-DFlash-b16), counted on the meta device."""
    from drafttree.apps.bench.random_gguf import QWEN3_4B_DFLASH
    from drafttree.drafter.model import DFlashConfig, DFlashDrafter

    with torch.device("meta"):
        drafter = DFlashDrafter(DFlashConfig(**QWEN3_4B_DFLASH))
    assert sum(p.numel() for p in drafter.parameters()) == 537_427_200
