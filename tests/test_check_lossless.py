"""check-lossless on a tiny model: the teacher-forced check accepts AR's own output and rejects a
changed one; the whole check reports zero mismatches for a lossless method."""
import torch

from drafttree.apps.bench import lossless
from drafttree.engine import generate_ar
from drafttree.load import load_target
from drafttree.proposers import BestFirstPolicy, DFlashProposer
from spec_helpers import random_drafter_for


def test_teacher_forced_check(tiny_checkpoint):
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    ids = torch.tensor([3, 9, 27, 4])
    ar = generate_ar(target, ids, max_new_tokens=20, stop_token_ids=()).tokens
    assert lossless.teacher_forced_ok(target, ids, ar, 20, stops=set())
    wrong = ar[:7] + [(ar[7] + 1) % target.model.config.vocab_size] + ar[8:]
    assert not lossless.teacher_forced_ok(target, ids, wrong, 20, stops=set())
    assert not lossless.teacher_forced_ok(target, ids, ar[:-1], 20, stops=set())  # stopped early without a stop token
    assert lossless.teacher_forced_ok(target, ids, ar[:5], 20, stops={ar[4]}) == (ar[4] not in ar[:4])


def test_check_counts_no_mismatch_for_a_lossless_method(tiny_checkpoint, monkeypatch):
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    drafter = random_drafter_for(target.model)
    monkeypatch.setattr(lossless, "make_proposer",
                        lambda m, t, drafter=None, budget=16, cost_model=None:
                        DFlashProposer(drafter, t.model, BestFirstPolicy(budget)))
    monkeypatch.setattr(target, "encode_chat", lambda text: torch.tensor([int(c) % 50 + 1 for c in text.encode()]))
    res = lossless.check(target, ["ddtree"], {"toy": ["ab", "hello", "xyz!"]}, max_new_tokens=16, drafter=drafter,
                         progress=False, budget=8)
    row = res["toy"]["ddtree-8"]
    assert row["prompts"] == 3 and row["mismatches"] == 0 and row["tau"] >= 1.0
    assert "| toy | ddtree-8 | 3 |" in lossless.markdown(res, dict(dtype="float32", max_new_tokens=16))


def test_divergence_gap_measures_ars_own_logits(tiny_checkpoint):
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    ids = torch.tensor([3, 9, 27, 4])
    ar = generate_ar(target, ids, max_new_tokens=12, stop_token_ids=()).tokens
    other = ar[:5] + [(ar[5] + 1) % target.model.config.vocab_size] + ar[6:]
    at, gap = lossless.divergence_gap(target, ids, ar, other)
    model = target.model
    logits = model.forward(model.new_state(16), torch.cat([ids, torch.tensor(ar[:5])])).logits[-1]
    assert at == 5 and gap > 0
    assert abs(gap - float(logits[ar[5]] - logits[other[5]])) < 1e-4
    assert lossless.divergence_gap(target, ids, ar, ar[:7]) == (7, float("inf"))
