"""bench/drafter_tau.py replays the chain's and DDTree's rounds exactly as decoding runs them (fp32, tiny models)."""
import sys
from pathlib import Path

import pytest
import torch

from drafttree.engine import generate_ar, generate_speculative
from drafttree.load import load_target
from drafttree.marginals import dense_logits
from drafttree.proposers import BestFirstPolicy, ChainPolicy, DFlashProposer
from spec_helpers import random_drafter_for
from spec_helpers import prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from drafter_tau import accepted_per_position, round_lengths  # noqa: E402

MAX_NEW = 30


class PartlyRightDrafts(DFlashProposer):
    """A random DFlash drafter whose marginals are made right for the first (start mod 5) depths, so rounds
    accept 0-4 drafts: a replay that got positions or depths wrong would disagree with decoding."""

    def __init__(self, drafter, model, policy, sequence: torch.Tensor):
        super().__init__(drafter, model, policy)
        self.sequence = sequence

    def draft(self, state, root, start):
        logits = dense_logits(super().draft(state, root, start)).clone()
        for d in range(min(start % 5, logits.shape[0], self.sequence.numel() - start - 1)):
            logits[d, int(self.sequence[start + 1 + d])] = 50.0
        return logits


@pytest.mark.parametrize("seed", [0, 1])
def test_replayed_rounds_equal_decoded_rounds(tiny_checkpoint, seed):
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    drafter = random_drafter_for(target.model, seed=seed)
    for ids in prompts(2, target.model.config.vocab_size, seed=5 + seed):
        ar = generate_ar(target, ids, MAX_NEW, stop_token_ids=()).tokens
        seq = torch.cat([ids, torch.tensor(ar)])
        acc = accepted_per_position(target, PartlyRightDrafts(drafter, target.model, ChainPolicy(), seq), ids, ar, [4, 16])
        assert acc["chain"].max() >= 3
        for name, policy in (("chain", ChainPolicy()), ("ddtree-4", BestFirstPolicy(4)), ("ddtree-16", BestFirstPolicy(16))):
            real = generate_speculative(target, ids, PartlyRightDrafts(drafter, target.model, policy, seq), MAX_NEW,
                                        stop_token_ids=()).stats
            rep = round_lengths(acc[name], len(ar))
            # the last round may accept drafts past max_new_tokens, which a replay of AR's reply cannot see
            assert rep[:-1] == real.accept_lengths[:-1], name
            assert rep[-1] <= real.accept_lengths[-1]
            assert max(rep) >= 3


def test_a_second_turn_follows_the_targets_own_first_answer(monkeypatch):
    """mtbench-turn2: the conversation measured is (first turn, the target's own greedy answer, second turn)."""
    import drafter_tau
    from drafttree.engine import GenerationResult

    class FakeTarget:
        stop_token_ids = (0,)
        seen: list = []

        def encode_chat(self, messages):
            self.seen.append(messages)
            return torch.tensor([1, 2, 3])

        def decode(self, ids):
            return "answer " + " ".join(map(str, ids))

    calls = []
    monkeypatch.setattr(drafter_tau, "generate_ar", lambda target, ids, n, stop_token_ids: calls.append((ids, n))
                        or GenerationResult([7, 8], None))
    target = FakeTarget()
    assert drafter_tau.prompt_ids(target, "one turn", 5).tolist() == [1, 2, 3] and calls == []
    drafter_tau.prompt_ids(target, ("First?", "Second?"), 5)
    assert calls[0][1] == 5 and target.seen[-1] == [{"role": "user", "content": "First?"},
                                                    {"role": "assistant", "content": "answer 7 8"},
                                                    {"role": "user", "content": "Second?"}]
