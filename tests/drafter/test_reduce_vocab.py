"""A reduced draft vocabulary after training: the same hidden states, the head restricted to the
chosen ids (others -inf), and a save/load round trip."""
import torch

from drafttree.drafter.checkpoint import load_drafter, save_drafter
from drafttree.drafter.model import DFlashConfig, DFlashDrafter
from drafttree.drafter.reduce_vocab import with_draft_vocab


def test_reduced_head_scores_only_the_top_ids(tmp_path):
    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=50, target_layer_ids=[0, 1])
    full = DFlashDrafter(cfg).eval()
    counts = torch.arange(50).flip(0) * 3  # id 0 most frequent
    reduced, coverage = with_draft_vocab(full, counts, 10)
    assert 0.3 < coverage < 1.0
    head = torch.randn(50, 32)
    hidden = torch.randn(4, 32)
    a, b = full.draft_logits(hidden, head), reduced.draft_logits(hidden, head)
    torch.testing.assert_close(b[:, :10], a[:, :10])
    assert torch.isinf(b[:, 10:]).all()
    save_drafter(reduced, tmp_path / "r")
    back = load_drafter(tmp_path / "r")
    assert torch.equal(back.draft_vocab, torch.arange(10))
    assert torch.equal(back.draft_logits(hidden, head), b)


# ---- decoding on the reduced ids: no widening back to the full vocabulary -------------------------------

import math  # noqa: E402

import pytest  # noqa: E402

from drafttree.costmodel import ConvexCost, VerifyCostModel  # noqa: E402
from drafttree.lookup import SuffixIndex, merged_best_first  # noqa: E402
from drafttree.proposers import BestFirstPolicy, ChainPolicy, CostAwarePolicy  # noqa: E402


def reduced_and_widened(seed, depth=5, vocab=40, kept=12):
    """Scores over a random draft vocabulary [depth, kept], its ids, and the same scores widened to
    [depth, vocab] with -inf elsewhere (what decoding did before)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=g)[:kept].sort().values
    small = torch.randn(depth, kept, generator=g) * 3
    wide = torch.full((depth, vocab), float("-inf")).index_copy_(1, ids, small)
    return small, ids, wide


def cost_model():
    return VerifyCostModel(context_lens=(0,), curves=(ConvexCost(knots=(1.0, 8.0, 64.0), values=(10.0, 11.0, 30.0)),),
                           draft_ms=2.0)


def same_tree(a, b):
    return (torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
            and torch.allclose(a.path_logprobs, b.path_logprobs, equal_nan=True))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", [ChainPolicy(), BestFirstPolicy(9), CostAwarePolicy(cost_model(), 24),
                                    CostAwarePolicy(cost_model(), 24, recalibrate=True)], ids=lambda p: p.name)
def test_policies_on_reduced_ids_build_the_widened_tree(policy, seed):
    small, ids, wide = reduced_and_widened(seed)
    clock = iter(range(1000)).__next__
    reduced_tree = policy.build(policy.new_state(clock), 7, small, 30, ids)
    wide_tree = policy.build(policy.new_state(clock), 7, wide, 30)
    assert same_tree(reduced_tree, wide_tree)
    assert set(reduced_tree.tokens[1:].tolist()) <= set(ids.tolist())


@pytest.mark.parametrize("seed", range(3))
def test_merged_stream_on_reduced_ids_equals_widened(seed):
    small, ids, wide = reduced_and_widened(seed, vocab=12, kept=6)
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, 12, (40,), generator=g).tolist()  # trie tokens inside and outside the draft vocabulary
    cont = SuffixIndex(3, seq).continuations(seq[-1], 6, max_matches=8, rates=[0.6] * 8)
    a = list(merged_best_first(cont, small.log_softmax(-1), 30, drafter_scale=0.7, token_ids=ids))
    b = list(merged_best_first(cont, wide.log_softmax(-1), 30, drafter_scale=0.7))
    assert [(n.parent, n.token, n.depth) for n in a] == [(n.parent, n.token, n.depth) for n in b]
    for x, y in zip(a, b):
        assert x.path_logprob == pytest.approx(y.path_logprob, abs=1e-5)
        assert (x.drafter_logprob == y.drafter_logprob == -math.inf
                or x.drafter_logprob == pytest.approx(y.drafter_logprob, abs=1e-5))


def test_reduced_drafter_decodes_losslessly(tiny_checkpoint):
    """A drafter with a reduced vocabulary drafts on its own ids (DFlashProposer never widens) and greedy
    speculative decoding still equals AR token for token."""
    from drafttree.engine import generate_ar, generate_speculative
    from drafttree.load import load_target
    from drafttree.proposers import DFlashProposer
    from spec_helpers import random_drafter_for

    target = load_target(str(tiny_checkpoint[0]))
    vocab = target.model.config.vocab_size
    full = random_drafter_for(target.model)
    reduced, _ = with_draft_vocab(full, torch.arange(vocab).flip(0).float(), vocab // 2)
    ids = torch.tensor([1, 5, 9, 2, 7, 3])
    ar = generate_ar(target, ids, 24, stop_token_ids=()).tokens
    for policy in (ChainPolicy(), BestFirstPolicy(8), CostAwarePolicy(cost_model(), 16, recalibrate=True)):
        proposer = DFlashProposer(reduced, target.model, policy)
        assert proposer.draft_token_ids is not None
        assert generate_speculative(target, ids, proposer, 24, stop_token_ids=()).tokens == ar


def test_reduced_head_is_prepared_when_the_proposer_is_made(tiny_checkpoint):
    """Nothing but decoding in a decode: the head's draft rows are sliced when the proposer is made, and no
    round slices them again (on the int8 path that was ~0.2 s charged to the first round)."""
    from drafttree.engine import generate_speculative
    from drafttree.load import load_target
    from drafttree.proposers import DFlashProposer
    from spec_helpers import random_drafter_for

    target = load_target(str(tiny_checkpoint[0]))
    vocab = target.model.config.vocab_size
    reduced, _ = with_draft_vocab(random_drafter_for(target.model), torch.arange(vocab).flip(0).float(), vocab // 2)
    proposer = DFlashProposer(reduced, target.model, BestFirstPolicy(8))
    prepared = reduced._head_cache
    assert prepared is not None
    generate_speculative(target, torch.tensor([1, 5, 9, 2]), proposer, 12, stop_token_ids=())
    assert reduced._head_cache is prepared
