"""Self-distillation data: the packed generator equals per-prompt AR with prefill features; the
length-sorted order keeps every prompt and sorts only within windows."""
import torch

from drafttree.training.datagen import generate_packed, length_sorted
from drafttree.engine import generate_ar
from drafttree.load import load_target
from drafttree.sampling import SamplingParams


def test_packed_generation_equals_ar_and_prefill_features(tiny_checkpoint):
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    model, layers = target.model, (0, target.model.config.num_layers - 1)
    prompts = [torch.tensor([5, 9, 2, 33]), torch.tensor([7]), torch.tensor([1, 2, 3, 4, 5, 6])]
    ars = [generate_ar(target, p, max_new_tokens=10, stop_token_ids=()).tokens for p in prompts]
    out = generate_packed(model, prompts, 10, SamplingParams(), layers, stop_ids=set())
    for p, ar, (tokens, feats, plen, _, _) in zip(prompts, ars, out):
        assert plen == p.numel() and tokens.tolist() == p.tolist() + ar  # at the length cap the last token was fed too
        ref = model.prefill(model.new_state(256), tokens, capture_layers=layers).features
        torch.testing.assert_close(feats, ref, atol=1e-4, rtol=1e-4)


def test_length_sorted_windows():
    prompts = [f"p{i}" for i in range(10)]
    lengths = [5, 3, 9, 1, 7, 2, 8, 6, 4, 0]
    got = length_sorted(prompts, lengths, window=4)
    assert sorted(got) == sorted(prompts)
    assert got[:4] == ["p3", "p1", "p0", "p2"] and got[4:8] == ["p5", "p7", "p4", "p6"] and got[8:] == ["p9", "p8"]


def test_package_code_prompts_from_a_licence_checked_package():
    """--code-packages draws HumanEval-shaped prompts (the code instruction, a signature, its docstring) from a
    listed package installed here (pluggy: pytest's own dependency); a package off the licence-checked list is
    refused by name."""
    import pytest

    from drafttree.datasets import CODE_INSTRUCTION
    from drafttree.training.datagen import CODE_PACKAGES, stdlib_code_prompts
    from drafttree.validate import InputError

    assert CODE_PACKAGES["pluggy"] == "MIT"
    prompts = stdlib_code_prompts(10_000, 0, ("pluggy",))
    assert prompts and all(p.startswith(CODE_INSTRUCTION + "def ") and '"""' in p for p in prompts)
    with pytest.raises(InputError, match="not among the licence-checked packages"):
        stdlib_code_prompts(10, 0, ("leftpad",))


def test_sharegpt_followups_keep_the_conversation_before_a_later_turn(monkeypatch):
    """--sharegpt-followups: a later user turn with the alternating turns before it (ChatGPT's replies as the
    assistant's); conversations without a later turn, with a broken alternation before one, or too long are left
    out."""
    from drafttree.training import datagen

    def turn(who, text):
        return {"from": who, "value": text}

    convs = [
        {"conversations": [turn("human", "Write a haiku about rain."), turn("gpt", "Rain on the roof..."),
                           turn("human", "Now make it about snow, please.")]},
        {"conversations": [turn("human", "Only one turn here, nothing after it.")]},
        {"conversations": [turn("gpt", "A reply first."), turn("human", "Then a question that is long enough.")]},
        {"conversations": [turn("human", "x" * 2000), turn("gpt", "y" * 1500), turn("human", "z" * 40)]},
    ]
    monkeypatch.setattr(datagen, "sharegpt_conversations", lambda: iter(convs))
    got = datagen.sharegpt_followups(10, seed=0)
    assert len(got) == 1
    conv = got[0]
    assert conv.turns == (("user", "Write a haiku about rain."), ("assistant", "Rain on the roof..."),
                          ("user", "Now make it about snow, please."))
    assert datagen.prompt_messages(conv)[-1] == {"role": "user", "content": "Now make it about snow, please."}
    assert datagen.answered_turn(conv) == "Now make it about snow, please."
    assert datagen.prompt_messages("plain") == "plain" and datagen.user_turns("plain") == ["plain"]
    assert {conv: "sharegpt-followups"}[got[0]] == "sharegpt-followups"  # hashable: it keys like a prompt string


def test_manifest_digests_every_user_turn_of_a_conversation(tmp_path):
    from drafttree.training.datagen import Conversation, user_turns
    from drafttree.training.manifest import DataManifest, prompt_digest

    conv = Conversation((("user", "First question?"), ("assistant", "An answer."), ("user", "A follow-up?")))
    m = DataManifest(tmp_path, {"engine": "test"}, {"method": "none", "checked": {}, "dropped_prompts": 0})
    m.add(user_turns(conv), "sharegpt-followups", 30, 10, sampled=False)
    assert m.data["prompt_digests"] == [prompt_digest("First question?"), prompt_digest("A follow-up?")]
    assert m.data["sources"]["sharegpt-followups"]["prompts"] == 1
    assert m.data["sources"]["sharegpt-followups"]["user_turns"] == 2
