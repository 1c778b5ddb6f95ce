"""Retrieval branches (drafttree.lookup): the suffix index and the merged best-first stream against brute force,
the lookup's calibration, and every lookup method's greedy output equal to AR's token for token (fp32, tiny models)."""
import copy
import math

import pytest
import torch

from drafttree.engine import Sequence, generate_ar, generate_speculative
from drafttree.load import load_target
from drafttree.lookup import (LookupCalibrator, LookupConfig, LookupDFlashProposer, LookupProposer, SuffixIndex,
                              merged_best_first)
from drafttree.proposers import BestFirstPolicy, CostAwarePolicy, DFlashProposer
from drafttree.tree import best_first_nodes
from spec_helpers import random_drafter_for, synthetic_cost_model



# ---- the suffix index -------------------------------------------------------------------------------------


def brute_matches(seq, root, max_ngram, match_cap):
    """(n, {position after the occurrence: its real match length}) of the longest suffix of seq + [root], n <= max_ngram,
    that occurred before; None when none did."""
    v, L = list(seq) + [root], len(seq)
    for n in range(min(max_ngram, L + 1), 0, -1):
        hits = [p for p in range(n, L + 1) if v[p - n:p] == v[L + 1 - n:]]
        if hits:
            lengths = {}
            for p in hits:
                m = n
                if n == max_ngram:
                    while m < match_cap and p - m - 1 >= 0 and v[p - m - 1] == v[L - m]:
                        m += 1
                lengths[p] = m
            return n, lengths
    return None


def trie_paths(cont):
    """{token path: count} over every node of the continuation trie."""
    out = {}

    def visit(node, prefix):
        for c in cont.children(node):
            path = prefix + (c.token,)
            out[path] = c.count
            visit(c, path)

    visit(cont.root, ())
    return out


@pytest.mark.parametrize("seed", range(6))
def test_suffix_index_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    vocab = 3 + seed % 3
    seq = torch.randint(0, vocab, (60,), generator=g).tolist()
    index = SuffixIndex(4)
    i = 0
    while i < len(seq):  # grown in uneven chunks, as rounds commit them
        k = int(torch.randint(1, 6, (1,), generator=g))
        index.extend(torch.tensor(seq[i:i + k]))
        i += k
    batch = SuffixIndex(4, seq)
    for n in range(1, 5):
        for start in range(0, len(seq) - n + 1, 7):
            gram = seq[start:start + n]
            assert index.positions(gram) == batch.positions(gram) == [
                p for p in range(n, len(seq) + 1) if seq[p - n:p] == gram]
    for root in range(vocab):
        cont = index.continuations(root, max_depth=5, max_matches=1000, match_cap=12, rates=[0.5] * 8)
        want = brute_matches(seq, root, 4, 12)
        if want is None:
            assert cont is None
            continue
        n, lengths = want
        assert dict(zip(cont.positions, cont.match_lens)) == lengths
        assert cont.match_len == max(lengths.values())
        v = seq + [root]
        conts = [tuple(v[p:p + 5]) for p in lengths]
        want_paths = {}
        for c in conts:
            for d in range(1, len(c) + 1):
                want_paths[c[:d]] = want_paths.get(c[:d], 0) + 1
        assert trie_paths(cont) == want_paths


def test_continuations_prefer_longer_matches_then_recent():
    #           0  1  2  3  4  5  6  7  8  9 10 11 12 13
    index = SuffixIndex(2, [5, 1, 2, 7, 9, 1, 2, 8, 5, 1, 2, 6, 1])
    cont = index.continuations(2, max_depth=3, max_matches=2, match_cap=8, rates=[0.5] * 4)
    # the context ends "6 1 2": "1 2" occurred three times before, each a 2-token match, so the two most
    # recent occurrences are kept
    assert cont.match_len == 2 and cont.positions == [11, 7]
    assert [c.token for c in cont.children(cont.root)] == [6, 8]
    assert cont.best_path() == [6, 1, 2]  # the last token of a continuation may be the root itself
    # a 2-gram index measures matches longer than 2 at query time
    index = SuffixIndex(2, [4, 5, 1, 2, 7, 9, 1, 2, 8, 4, 5, 1])
    cont = index.continuations(2, max_depth=2, max_matches=1, match_cap=8, rates=[0.5] * 8)
    assert cont.positions == [4] and cont.match_lens == [4]
    (child,) = cont.children(cont.root)
    assert (child.token, child.bucket, child.frac) == (7, 4, 1.0)
    assert math.exp(child.log_q) == pytest.approx(0.5)


def test_continuations_none_without_a_match():
    assert SuffixIndex(4, [1, 2, 3]).continuations(9, max_depth=4) is None
    assert SuffixIndex(4, []).continuations(9, max_depth=4) is None
    assert SuffixIndex(4, [9]).continuations(9, max_depth=4).best_path() == [9]


# ---- the merged stream --------------------------------------------------------------------------------------


def test_merged_stream_without_lookup_is_ddtree():
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        m = (torch.randn(6, 40, generator=g) * 3).log_softmax(-1)
        want = list(best_first_nodes(m, 48))
        got = list(merged_best_first(None, m, 48))
        assert [(n.parent, n.token, n.depth) for n in got] == [(n.parent, n.token, n.depth) for n in want]
        assert [n.path_logprob for n in got] == pytest.approx([n.path_logprob for n in want], abs=1e-5)
        assert all(n.lookup is None and n.drafter_logprob == n.path_logprob for n in got)


def brute_weights(cont, marginals, scale, max_depth, vocab):
    """{token path: weight} for every path up to max_depth with weight max(s·drafter, lookup) > 0."""
    lookup = {}

    def visit(node, prefix, lp):
        for c in cont.children(node):
            path = prefix + (c.token,)
            lookup[path] = lp + c.log_q
            visit(c, path, lookup[path])

    if cont is not None:
        visit(cont.root, (), 0.0)
    probs = None if marginals is None else marginals.exp().tolist()
    out = {}

    def paths(prefix):
        if prefix:
            d = 0.0
            if probs is not None and len(prefix) <= len(probs):
                d = scale * math.prod(probs[i][t] for i, t in enumerate(prefix))
            w = max(d, math.exp(lookup[prefix]) if prefix in lookup else 0.0)
            if w <= 0:
                return
            out[prefix] = w
        if len(prefix) < max_depth:
            for t in range(vocab):
                paths(prefix + (t,))

    paths(())
    return out


def node_paths(nodes):
    paths = [()]
    for n in nodes:
        paths.append(paths[n.parent] + (n.token,))
    return paths[1:]


@pytest.mark.parametrize("scale", [1.0, 0.6, 1.8])
@pytest.mark.parametrize("with_drafter", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_merged_stream_is_exact_best_first(seed, with_drafter, scale):
    g = torch.Generator().manual_seed(seed)
    vocab, depth, look_depth = 4, 3, 5  # lookup paths run deeper than the drafter's rows
    seq = torch.randint(0, vocab, (30,), generator=g).tolist()
    rates = (0.3 + 0.6 * torch.rand(8, generator=g)).tolist()
    cont = SuffixIndex(3, seq).continuations(seq[-1], look_depth, max_matches=8, rates=rates)
    marginals = (torch.randn(depth, vocab, generator=g) * 2).log_softmax(-1) if with_drafter else None
    budget = 40
    nodes = list(merged_best_first(cont, marginals, budget, drafter_scale=scale))
    weights = brute_weights(cont, marginals, scale, look_depth, vocab)
    best = sorted(weights.values(), reverse=True)[:budget]
    assert len(nodes) == len(best)
    assert [math.exp(n.path_logprob) for n in nodes] == pytest.approx(best, rel=1e-5)
    paths = node_paths(nodes)
    assert len(set(paths)) == len(paths)  # a path both sources propose is one node
    for n, path in zip(nodes, paths):
        assert math.exp(n.path_logprob) == pytest.approx(weights[path], rel=1e-5)
        assert n.depth == len(path) and 0 <= n.parent < len(paths) + 1
        if marginals is not None and n.depth <= depth:
            assert n.drafter_logprob == pytest.approx(sum(float(marginals[i, t]) for i, t in enumerate(path)), abs=1e-5)
        else:
            assert n.drafter_logprob == -math.inf
    assert all(a.path_logprob >= b.path_logprob - 1e-9 for a, b in zip(nodes, nodes[1:]))  # non-increasing
    siblings = {}
    for i, n in enumerate(nodes):  # distinct sibling tokens (DraftTree checks it too)
        assert n.parent <= i
        assert n.token not in siblings.setdefault(n.parent, set())
        siblings[n.parent].add(n.token)


def test_merged_stream_arguments():
    m = torch.zeros(2, 5).log_softmax(-1)
    with pytest.raises(ValueError):
        list(merged_best_first(None, m, 0))
    with pytest.raises(ValueError):
        list(merged_best_first(None, m, 4, drafter_scale=0.0))
    assert list(merged_best_first(None, None, 4)) == []


# ---- calibration ----------------------------------------------------------------------------------------------


def test_calibrator_learns_its_rate_per_bucket():
    cal = LookupCalibrator(buckets=4)
    assert cal.rates() == (0.5,) * 4
    for i in range(300):
        cal.observe(4, 1.0, i % 10 != 0)  # long matches: 90% accepted
        cal.observe(1, 0.5, i % 10 == 0)  # one-token matches: 10% of half-shares
    assert cal.rate(4) == pytest.approx(0.9, abs=0.06)
    assert cal.rate(9) == cal.rate(4)  # the last bucket takes every longer match
    assert cal.rate(1) == pytest.approx(0.2, abs=0.06)
    assert cal.rate(2) == 0.5
    for _ in range(300):
        cal.observe(3, 1.0, True)
    assert cal.rate(3) <= 0.99


def test_lookup_state_calibrates_on_tried_nodes():
    proposer = LookupProposer(budget=8, min_prob=1e-3, config=LookupConfig(buckets=8, forget=1.0))
    state = proposer.begin(torch.tensor([1, 2, 3, 9, 1, 2, 3, 8, 1, 2]))
    cont = proposer.draft(state, 3, 10)  # "1 2 3" occurred twice: continuations 8 1 2 3 ... and 9 1 2 3 ...
    tree = proposer.build_tree(state, 3, cont, 10)
    assert sorted(int(tree.tokens[i]) for i in tree.children(0)) == [8, 9] and tree.num_draft_nodes == 8
    cal = state.calibrator
    proposer.advance(state, torch.tensor([3, 8, 1]), None, 10)  # 8 and 1 accepted, then the walk left the tree
    # tried: both root children (8 hit, 9 missed; half a share each), 1 under 8 (hit), 2 under 1 (missed)
    assert sum(cal._hits) == pytest.approx(2.0)
    assert sum(cal._trials) == pytest.approx(0.5 + 0.5 + 1.0 + 1.0)
    assert len(state.index) == 13 and state.index.tokens[-3:] == [3, 8, 1]
    with pytest.raises(ValueError, match="advance must see every committed token"):
        proposer.advance(state, torch.tensor([5]), None, 99)


# ---- whole decodes on tiny models -------------------------------------------------------------------------------


def make_proposers(target):
    drafter = random_drafter_for(target.model)
    model = target.model

    def dflash(policy):
        return DFlashProposer(drafter, model, policy)

    return {
        "lookup": LookupProposer(budget=12),
        "lookup-strict": LookupProposer(budget=6, min_prob=0.3),
        "lookup-ddtree": LookupDFlashProposer(dflash(BestFirstPolicy(12))),
        "lookup-caddtree": LookupDFlashProposer(dflash(CostAwarePolicy(synthetic_cost_model(), max_tree_nodes=32))),
        "lookup-caddtree-online": LookupDFlashProposer(dflash(CostAwarePolicy(synthetic_cost_model(), max_tree_nodes=32,
                                                                              recalibrate=True))),
        "lookup-caddtree-online-gated": LookupDFlashProposer(  # the method: plain (lookup-only) rounds by the gate
            DFlashProposer(drafter, model, CostAwarePolicy(synthetic_cost_model(), max_tree_nodes=32, recalibrate=True),
                           gate=True)),
        "lookup-caddtree-always-draft": LookupDFlashProposer(
            dflash(CostAwarePolicy(synthetic_cost_model(), max_tree_nodes=32)), skip_drafter=False),
    }


def repetitive_prompts(vocab, n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).repeat(3)
            for _ in range(n)]


@pytest.fixture(scope="session")
def cycling_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny model with its attention outputs zeroed: the next token is a function of the current one, so
    replies fall into cycles that the lookup then predicts (deep accepted lookup paths, partial acceptance
    where a cycle is entered). Everything else (tree verify, walk, commit) runs as for any model."""
    _, hf = tiny_checkpoint
    hf = copy.deepcopy(hf)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    path = tmp_path_factory.mktemp("cycling")
    hf.save_pretrained(path)
    return path


def accepted_drafts(res) -> int:
    return sum(res.stats.accept_lengths) - len(res.stats.accept_lengths)


def test_greedy_equals_ar_on_repetitive_prompts(tiny_checkpoint):
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    proposers = make_proposers(target)
    for ids in repetitive_prompts(target.model.config.vocab_size):
        ar = generate_ar(target, ids, max_new_tokens=32, stop_token_ids=()).tokens
        for name, proposer in proposers.items():
            assert generate_speculative(target, ids, proposer, max_new_tokens=32, stop_token_ids=()).tokens == ar, name


def test_lookup_is_accepted_and_lossless_on_a_cycling_model(cycling_checkpoint):
    target = load_target(str(cycling_checkpoint))
    proposers = make_proposers(target)
    accepted = dict.fromkeys(proposers, 0)
    deepest = dict.fromkeys(proposers, 0)
    for ids in repetitive_prompts(target.model.config.vocab_size, seed=1):
        ar = generate_ar(target, ids, max_new_tokens=48, stop_token_ids=()).tokens
        for name, proposer in proposers.items():
            res = generate_speculative(target, ids, proposer, max_new_tokens=48, stop_token_ids=())
            assert res.tokens == ar, name
            accepted[name] += accepted_drafts(res)
            deepest[name] = max(deepest[name], max(res.stats.accept_lengths))
    assert all(a > 0 for a in accepted.values()), accepted
    assert deepest["lookup"] > 4 and deepest["lookup-caddtree"] > 4, deepest


def test_lookup_caddtree_skips_the_drafter_when_lookup_alone_pays(cycling_checkpoint):
    """A drafter that costs more than a verify: once the lookup copies a cycle, rounds skip the drafter's forward."""
    target = load_target(str(cycling_checkpoint))
    proposer = LookupDFlashProposer(DFlashProposer(random_drafter_for(target.model), target.model,
                                                   CostAwarePolicy(synthetic_cost_model(draft_ms=30.0), 32)))
    calls = []
    inner = proposer.dflash.draft
    proposer.dflash.draft = lambda *a: calls.append(1) or inner(*a)
    ids = repetitive_prompts(target.model.config.vocab_size, n=1, seed=1)[0]
    ar = generate_ar(target, ids, max_new_tokens=48, stop_token_ids=()).tokens
    res = generate_speculative(target, ids, proposer, max_new_tokens=48, stop_token_ids=())
    assert res.tokens == ar
    assert 0 < len(calls) < res.stats.rounds


def test_interleaved_sequences_equal_each_alone(cycling_checkpoint):
    """Per-request state lives in the sequence: two requests stepped alternately through one proposer decode as alone."""
    target = load_target(str(cycling_checkpoint))
    for name, proposer in make_proposers(target).items():
        prompts = repetitive_prompts(target.model.config.vocab_size, seed=2)
        alone = [generate_speculative(target, ids, proposer, max_new_tokens=30, stop_token_ids=()).tokens for ids in prompts]
        seqs = [Sequence(target, ids, proposer, 30, stop_token_ids=()) for ids in prompts]
        while not all(s.done for s in seqs):
            for s in seqs:
                s.step()
        assert [s.tokens for s in seqs] == alone, name
