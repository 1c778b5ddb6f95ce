"""Every method on many prompts, lengths and cost regimes: no exception, and greedy output equal to AR.

The regimes are synthetic cost models that push the policies and gates into their corners (a drafter that
costs more than a verify, a verify that barely grows, one that grows steeply); the prompts are random and
repetitive (so the lookup matches) at random lengths. Issue 34's crash — the merged lookup tree's node estimate
went negative in `LookupDFlashProposer._lookup_alone_wins` — was such a corner."""
import pytest
import torch

from drafttree.load import load_target
from drafttree.methods import Decoder
from spec_helpers import REGIMES, assert_every_method_equals_ar, random_drafter_for, repetitive_prompts, weaver_for
from tiny_models import make_tiny_checkpoint





@pytest.mark.parametrize("kind, regime", [("llama", "cheap-draft"), ("qwen3", "dear-draft"),
                                          ("llama_untied_bias", "steep-verify")])
def test_every_method_equals_ar_without_exception(kind, regime, tmp_path):
    make_tiny_checkpoint(kind, tmp_path)  # one model kind a regime: the suite's time goes to the corners
    target = load_target(str(tmp_path))
    drafter = random_drafter_for(target.model)
    decoder = Decoder(target, drafter=drafter, budget=6, max_tree_nodes=24, cost_model=REGIMES[regime],
                      weaver=weaver_for(target, drafter))
    vocab = target.model.config.vocab_size
    g = torch.Generator().manual_seed(7)
    for ids in repetitive_prompts(vocab, 3, seed=sorted(REGIMES).index(regime)):
        assert_every_method_equals_ar(target, decoder, ids, int(torch.randint(1, 33, (1,), generator=g)), regime)


def test_merged_node_estimate_never_negative(tiny_checkpoint):
    """The estimate of the merged tree's size is a count: a negative mean difference cannot make it negative."""
    from drafttree.lookup.proposers import LookupDFlashState
    from drafttree.policies import CaddSelection

    path, _ = tiny_checkpoint
    target = load_target(str(path))
    decoder = Decoder(target, drafter=random_drafter_for(target.model), cost_model=REGIMES["cheap-draft"])
    proposer = decoder.proposer("lookup-caddtree")
    state = LookupDFlashState(dflash=None, lookup=None, extra_phi=0.1, extra_nodes=-5.0)
    alone = CaddSelection(nodes=[], expected_tokens=1.0, round_ms=10.0)
    assert proposer._lookup_alone_wins(state, alone, start=10, overhead=0.0) in (True, False)
