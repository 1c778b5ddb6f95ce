"""Training data manifests: the shipped drafter's lists the digest of every prompt it was trained on, and not one
is an evaluation prompt; the digest folds the instructions drafttree adds, case and spacing."""
import json
from pathlib import Path

import pytest

from drafttree.datasets import CODE_INSTRUCTION, MATH_INSTRUCTION, load_prompts
from drafttree.training.datagen import parse_part
from drafttree.training.manifest import evaluation_digests, prompt_digest
from drafttree.validate import InputError

WEIGHTS = Path(__file__).resolve().parents[2] / "drafttree" / "weights"
MANIFESTS = sorted(WEIGHTS.glob("*/data-manifest*.json"))


def test_prompt_digest_folds_instructions_case_and_spacing():
    q = "Tom has 3 apples.  How many?"
    assert prompt_digest(f"{q}\n{MATH_INSTRUCTION}") == prompt_digest("tom has 3 apples. how many?")
    assert prompt_digest(CODE_INSTRUCTION + "def f(x):\n    pass") == prompt_digest("def f(x): pass")
    assert prompt_digest("a b") != prompt_digest("a c")


def test_evaluation_digests_cover_every_set():
    digests = evaluation_digests()
    for name in ("humaneval", "gsm8k", "mtbench"):
        assert {prompt_digest(p) for p in load_prompts(name)} <= digests
    assert len(digests) >= 164 + 100 + 80


@pytest.mark.parametrize("manifest", MANIFESTS, ids=[m.parent.name for m in MANIFESTS])
def test_shipped_training_data_has_no_evaluation_prompt(manifest):
    data = json.loads(manifest.read_text())
    digests = data["prompt_digests"]
    # a digest per user turn: one per prompt, every user turn of a conversation (sources that have them count them)
    assert digests and len(digests) == sum(s.get("user_turns", s["prompts"]) for s in data["sources"].values())
    assert not set(digests) & evaluation_digests(), f"{manifest}: trained on an evaluation prompt"


def test_manifest_check_catches_a_contaminated_prompt():
    assert prompt_digest(load_prompts("gsm8k")[3]) in evaluation_digests()


def test_parse_part():
    assert parse_part("0/1") == (0, 1) and parse_part("1/2") == (1, 2)
    for bad in ("2/2", "x", "1/0", "-1/2"):
        with pytest.raises(InputError, match="--part"):
            parse_part(bad)


def test_merge_reads_manifests_and_recovers_digests_from_older_shards(tmp_path):
    import torch
    from transformers import AutoTokenizer

    from drafttree.training.data import FeatureShardWriter
    from drafttree.training.manifest import DataManifest, merge, user_turn
    from drafttree.gguf_convert import convert_embedded

    tok = AutoTokenizer.from_pretrained(str(convert_embedded("smollm2-135m-instruct")))
    questions = ["What is 2 + 2?", f"Tom has 3 apples.\n{MATH_INSTRUCTION}"]
    with FeatureShardWriter(tmp_path / "old", [0], tokens_per_shard=10) as w:  # shards of an older run: no manifest
        for q in questions:
            prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
            ids = torch.tensor(prompt + tok.encode("Four.", add_special_tokens=False))
            w.add(ids, torch.zeros(ids.numel(), 4), torch.arange(ids.numel()) >= len(prompt))
    new = DataManifest(tmp_path / "new", {"engine": "test"}, {"method": "none", "checked": {}, "dropped_prompts": 0})
    new.add(["Name a colour."], "sharegpt", 20, 5, sampled=False)
    new.save()
    merged = merge([tmp_path / "new", tmp_path / "old"], tmp_path / "m.json", tok)
    assert merged["prompt_digests"] == [prompt_digest(q) for q in ["Name a colour.", *questions]]
    assert merged["sources"]["sharegpt"]["prompts"] == 1 and merged["sources"]["recovered-from-shards"]["prompts"] == 2
    assert merged["sources"]["sharegpt"]["user_turns"] == 1  # counted where made; a prompt each before conversations
    assert json.loads((tmp_path / "m.json").read_text()) == merged
    with pytest.raises(ValueError, match="user turn"):
        user_turn("plain text")
    with pytest.raises(InputError, match="no manifest.json"):
        merge([tmp_path / "old"], tmp_path / "m2.json", None)
    # a fine-tuning round: the parent's merged manifest plus the new directory
    again = merge([tmp_path / "m.json", tmp_path / "new"], tmp_path / "m3.json", None)
    assert again["prompt_digests"] == merged["prompt_digests"] + [prompt_digest("Name a colour.")]
    assert again["sources"]["sharegpt"]["prompts"] == 2 and len(again["parts"]) == 3
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(InputError, match="not a merged data manifest"):
        merge([tmp_path / "bad.json"], tmp_path / "m4.json", None)
