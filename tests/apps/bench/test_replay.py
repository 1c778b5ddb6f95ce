"""Replay (recorded draft streams) reproduces the real decode loop round for round (fp32, tiny models)."""
import numpy as np
import pytest

from drafttree.apps.bench.replay import CostAware, DraftStreams, FixedBudget, record_draft_streams, replay, summarize
from drafttree.engine import generate_speculative
from drafttree.load import load_target
from drafttree.proposers import BestFirstPolicy, ChainPolicy, CostAwarePolicy, DFlashProposer
from spec_helpers import TargetCopyProposer, random_drafter_for
from spec_helpers import prompts, synthetic_cost_model

MAX_NEW = 30


def proposers(path, target):
    """(recording proposer, factory of a real proposer for a policy): a perfect drafter (deep acceptance)
    and a random DFlash drafter (little acceptance, context features from the target)."""
    drafter = random_drafter_for(target.model)
    return {
        "target-copy": (TargetCopyProposer(path, ChainPolicy()), lambda pol: TargetCopyProposer(path, pol)),
        "dflash": (DFlashProposer(drafter, target.model, ChainPolicy()), lambda pol: DFlashProposer(drafter, target.model, pol)),
    }


@pytest.mark.parametrize("kind", ["target-copy", "dflash"])
def test_replay_matches_real_rounds(tiny_checkpoint, kind):
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    recorder, make = proposers(path, target)[kind]
    cost = synthetic_cost_model()
    cases = [(FixedBudget(b), lambda b=b: BestFirstPolicy(b)) for b in (1, 4, 16)]
    # replay's streams are full-depth blocks: the real CaDDTree it reproduces keeps its block at the cap
    cases.append((CostAware(cost, 32), lambda: CostAwarePolicy(cost, max_tree_nodes=32, follow_depth=False)))
    for ids in prompts(2, target.model.config.vocab_size, seed=3):
        streams = record_draft_streams(target, recorder, ids, MAX_NEW, 32, stop_token_ids=())
        assert len(streams.tokens) == MAX_NEW
        for choose, policy in cases:
            real = generate_speculative(target, ids, make(policy()), MAX_NEW, stop_token_ids=()).stats
            rep = replay(streams, choose, cost)
            assert rep.tree_sizes == real.tree_sizes
            # the last round may accept drafts past max_new_tokens, which replay cannot see
            assert rep.accept_lengths[:-1] == real.accept_lengths[:-1]
            assert rep.accept_lengths[-1] <= real.accept_lengths[-1]


def test_replay_of_nested_budgets(tiny_checkpoint):
    """Best-first trees are nested: a bigger budget never accepts fewer tokens in a round."""
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    recorder, _ = proposers(path, target)["target-copy"]
    streams = record_draft_streams(target, recorder, prompts(1, target.model.config.vocab_size)[0], MAX_NEW, 16,
                                   stop_token_ids=())
    for s in range(len(streams.tokens) - 1):
        acc = [streams.accepted(s, n) for n in range(17)]
        assert acc == sorted(acc) and acc[0] == 0
    fixed = [summarize([replay(streams, FixedBudget(b), synthetic_cost_model())]) for b in (1, 4, 16)]
    assert [f["tau"] for f in fixed] == sorted(f["tau"] for f in fixed)
    assert all(f["tokens"] == MAX_NEW - 1 for f in fixed)


def test_streams_round_trip_and_acceptance_scale(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    recorder, _ = proposers(path, target)["target-copy"]
    streams = record_draft_streams(target, recorder, prompts(1, target.model.config.vocab_size)[0], MAX_NEW, 16,
                                   stop_token_ids=())
    np.savez(tmp_path / "s.npz", **streams.arrays("x/0/"))
    with np.load(tmp_path / "s.npz", allow_pickle=False) as z:
        back = DraftStreams.from_arrays(z, "x/0/")
    cost = synthetic_cost_model()
    assert replay(back, CostAware(cost, 16), cost) == replay(streams, CostAware(cost, 16), cost)
    adaptive = CostAware(cost, 16, adapt_acceptance=True)
    replay(streams, adaptive, cost)
    assert adaptive.calibrator.accept_scale != 1.0  # it heard the rounds


def test_replay_cli_rejects_bad_budgets():
    from drafttree.apps.cli import main

    assert main(["replay", "--budgets", "0,8"]) == 2
    assert main(["replay", "--datasets", "nope"]) == 2
