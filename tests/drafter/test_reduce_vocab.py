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


# ---- a narrower draft vocabulary at load time: the top-ranked ids of the drafter's own -------------------

from drafttree.drafter.checkpoint import save_drafter as _save  # noqa: E402
from drafttree.drafter.reduce_vocab import RANK_FILE, load_rank, narrow_draft_vocab, save_rank  # noqa: E402
from drafttree.training.text_vocab import rank_draft_vocab  # noqa: E402
from drafttree.engine import generate_ar, generate_speculative  # noqa: E402
from drafttree.load import load_target  # noqa: E402
from drafttree.methods import load_drafter_for  # noqa: E402
from drafttree.proposers import DFlashProposer  # noqa: E402
from spec_helpers import prompts, random_drafter_for  # noqa: E402


def test_ranked_narrowing_keeps_the_most_counted_ids_and_their_scores(tmp_path):
    torch.manual_seed(1)
    cfg = DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=50, target_layer_ids=[0, 1])
    wide, _ = with_draft_vocab(DFlashDrafter(cfg).eval(), torch.arange(50), 20)  # ids 30..49
    counts = torch.randint(0, 100, (50,))
    ranked = rank_draft_vocab(wide.draft_vocab, counts)
    assert sorted(ranked.tolist()) == list(range(30, 50))
    assert counts[ranked].tolist() == sorted(counts[30:].tolist(), reverse=True)
    save_rank(ranked, tmp_path / RANK_FILE)
    assert torch.equal(load_rank(tmp_path / RANK_FILE), ranked)
    head, hidden = torch.randn(50, 32), torch.randn(3, 32)
    before = wide.draft_logits(hidden, head)
    narrow = narrow_draft_vocab(wide, ranked, 6)
    assert narrow.config.draft_vocab_size == 6 and torch.equal(narrow.draft_vocab, ranked[:6].sort().values)
    after = narrow.draft_logits(hidden, head)
    kept = narrow.draft_vocab
    torch.testing.assert_close(after[:, kept], before[:, kept])
    others = torch.ones(50, dtype=torch.bool).index_fill_(0, kept, False)
    assert torch.isinf(after[:, others]).all()


def test_narrowing_refuses_a_ranking_of_other_ids_and_bad_sizes():
    cfg = DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=50, target_layer_ids=[0, 1])
    d, _ = with_draft_vocab(DFlashDrafter(cfg).eval(), torch.arange(50), 20)
    with pytest.raises(ValueError, match="does not list the drafter's draft vocabulary"):
        narrow_draft_vocab(d, torch.arange(20), 5)
    with pytest.raises(ValueError, match="1..20 ids"):
        narrow_draft_vocab(d, d.draft_vocab, 21)
    with pytest.raises(ValueError, match="no draft vocabulary to narrow"):
        narrow_draft_vocab(DFlashDrafter(cfg).eval(), torch.arange(50), 5)


def test_a_narrowed_drafter_loads_by_default_and_stays_lossless(tiny_checkpoint, tmp_path):
    """load_drafter_for narrows a drafter whose directory ranks its draft vocabulary (to --draft-vocab, default
    DEFAULT_DRAFT_VOCAB; 0 keeps it all); a narrowed head decodes exactly as AR; asking without a ranking fails."""
    target = load_target(str(tiny_checkpoint[0]), compute="q4")
    vocab = target.model.config.vocab_size
    drafter, _ = with_draft_vocab(random_drafter_for(target.model), torch.arange(vocab).flip(0), vocab // 2)
    _save(drafter, tmp_path / "d")
    with pytest.raises(FileNotFoundError, match="--draft-vocab 8 needs"):
        load_drafter_for(target, tmp_path / "d", 8)
    assert load_drafter_for(target, tmp_path / "d").config.draft_vocab_size == vocab // 2  # no ranking: as saved
    save_rank(rank_draft_vocab(drafter.draft_vocab, torch.arange(vocab)), tmp_path / "d" / RANK_FILE)
    assert load_drafter_for(target, tmp_path / "d", 0).config.draft_vocab_size == vocab // 2
    narrow = load_drafter_for(target, tmp_path / "d", 8)
    assert narrow.config.draft_vocab_size == 8 and narrow.draft_vocab.tolist() == list(range(vocab // 2 - 8, vocab // 2))
    for policy in (ChainPolicy(), BestFirstPolicy(6), CostAwarePolicy(cost_model())):
        proposer = DFlashProposer(narrow, target.model, policy)
        for ids in prompts(2, vocab, seed=4):
            res = generate_speculative(target, ids, proposer, 20, stop_token_ids=())
            assert res.tokens == generate_ar(target, ids, 20, stop_token_ids=()).tokens
