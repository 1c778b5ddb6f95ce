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
