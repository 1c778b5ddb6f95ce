"""The shipped drafter in the layout llama.cpp's DFlash converter reads: the published tensors as they are, the
learned mask vector handed over for an id no chat reply contains, the whole head (llama.cpp has no reduced
draft vocabulary for DFlash)."""
import json

import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from drafttree.apps.bench.llama_dflash import MASK_TOKEN, hf_layout
from drafttree.gguf_convert import convert_embedded
from drafttree.methods import SHIPPED_DRAFTERS


def test_hf_layout_keeps_the_weights_and_hands_over_the_mask(tmp_path):
    drafter = SHIPPED_DRAFTERS["smollm2-135m-instruct"]
    tokenizer = AutoTokenizer.from_pretrained(str(convert_embedded("smollm2-135m-instruct")))
    mask_id = hf_layout(drafter, tokenizer, tmp_path)
    assert tokenizer.convert_ids_to_tokens(mask_id) == MASK_TOKEN and tokenizer.added_tokens_decoder[mask_id].special
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["mask_token_id"] == mask_id and "draft_vocab_size" not in config["dflash_config"]
    with safe_open(str(drafter / "model.safetensors"), "pt") as src, safe_open(str(tmp_path / "model.safetensors"), "pt") as out:
        assert set(out.keys()) == set(src.keys()) - {"mask_embedding", "draft_vocab"}
        assert all(torch.equal(out.get_tensor(k), src.get_tensor(k)) for k in out.keys())
        mask = src.get_tensor("mask_embedding")
    handed = torch.load(tmp_path / "mask_embedding.pt", weights_only=True)  # the converter's own reading of it
    assert handed["mask_token_id"] == mask_id and torch.equal(handed["embedding"], mask.float())
