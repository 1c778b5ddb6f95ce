"""Every method on many prompts, lengths and cost regimes: no exception, and greedy output equal to AR.

The regimes are synthetic cost models that push the policies and gates into their corners (a drafter that
costs more than a verify, a verify that barely grows, one that grows steeply); the prompts are random and
repetitive (so the lookup matches) at random lengths. Issue 34's crash — the merged lookup tree's node estimate
went negative in `LookupDFlashProposer._lookup_alone_wins` — was such a corner."""
import pytest
import torch

from drafttree.costmodel import ConvexCost, VerifyCostModel
from drafttree.engine import generate_ar
from drafttree.load import load_target
from drafttree.methods import METHODS, Decoder
from spec_helpers import random_drafter_for, weaver_for
from tiny_models import make_tiny_checkpoint

REGIMES = {
    "cheap-draft": VerifyCostModel(context_lens=(0,), curves=(ConvexCost((1.0, 8.0, 64.0), (10.0, 12.0, 40.0)),),
                                   draft_ms=1.0),
    "dear-draft": VerifyCostModel(context_lens=(0,), curves=(ConvexCost((1.0, 8.0, 64.0), (10.0, 12.0, 40.0)),),
                                  draft_ms=30.0),
    "steep-verify": VerifyCostModel(context_lens=(0, 64), curves=(ConvexCost((1.0, 2.0, 64.0), (3.0, 9.0, 400.0)),
                                                                  ConvexCost((1.0, 2.0, 64.0), (4.0, 12.0, 600.0))),
                                    draft_ms=2.0, draft_ms_per_context_token=0.01),
}


def prompts(vocab: int, n: int, seed: int) -> list[torch.Tensor]:
    """Random prompts of 1-30 tokens, every other one a repeated phrase (the lookup's matches)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(1, 31, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g)
        if i % 2:
            ids = ids[: max(1, length // 4)].repeat(4)[:length]
        out.append(ids)
    return out


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
    for ids in prompts(vocab, 3, seed=sorted(REGIMES).index(regime)):
        max_new = int(torch.randint(1, 33, (1,), generator=g))
        ar = generate_ar(target, ids, max_new, stop_token_ids=()).tokens
        for method in METHODS[1:]:
            seq = decoder.sequence(method, ids, max_new_tokens=max_new, stop_token_ids=())
            while not seq.done:
                seq.step()
            assert seq.tokens == ar, (method, regime, ids.tolist(), max_new)


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
