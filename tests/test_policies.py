"""drafttree.policies: the one place a best-first stream is cut (fixed budget, CaDDTree's greedy stop)."""
import math

import pytest
import torch

from drafttree import costmodel, policies
from drafttree.costmodel import ConvexCost, VerifyCostModel
from drafttree.policies import build_best_first_tree, build_caddtree, caddtree_select, caddtree_select_reference, fixed_budget_cut
from drafttree.tree import best_first_nodes


def test_fixed_budget_cut_is_ddtree_prefix():
    torch.manual_seed(0)
    marg = torch.randn(5, 30).log_softmax(-1)
    assert fixed_budget_cut(best_first_nodes(marg, 40), 0) == []
    for budget in (1, 7, 40):
        cut = fixed_budget_cut(best_first_nodes(marg, 40), budget)
        assert cut == list(best_first_nodes(marg, 40))[:budget]  # best-first streams are prefix-stable
        assert build_best_first_tree(0, marg, budget).num_nodes == budget + 1
    assert len(fixed_budget_cut(iter(best_first_nodes(marg, 3)), 10)) == 3  # a short stream ends the cut
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError):
            fixed_budget_cut(iter(()), bad)


def test_greedy_stop_matches_brute_force_and_lives_only_here():
    torch.manual_seed(1)
    model = VerifyCostModel([0], [ConvexCost((1, 16, 128), (10.0, 13.0, 60.0))], 3.0)
    marg = torch.randn(6, 50).mul(2).log_softmax(-1)
    nodes = list(best_first_nodes(marg, 200))
    sel = caddtree_select(iter(nodes), model, 0, 200)
    assert len(sel.nodes) == caddtree_select_reference([math.exp(n.path_logprob) for n in nodes], model, 0, 200)
    tree, sel2 = build_caddtree(3, marg, model, 0, 200)
    assert sel2.nodes == sel.nodes and math.isclose(sel.throughput, sel.expected_tokens / sel.round_ms)
    assert not hasattr(costmodel, "caddtree_select") and not hasattr(costmodel, "build_caddtree")
    assert policies.CaddSelection is type(sel)


def test_batch_selection_merges_streams_and_matches_brute_force():
    """caddtree_select_batch: the most probable next node of any request while the turn's rate improves."""
    torch.manual_seed(2)
    curve = ConvexCost((1, 8, 32, 128), (10.0, 11.0, 16.0, 60.0))
    for trial in range(20):
        k = 1 + trial % 5
        margs = [torch.randn(5, 40).mul(1 + trial % 3).log_softmax(-1) for _ in range(k)]
        streams = [list(best_first_nodes(m, 64)) for m in margs]
        caps = [int(c) for c in torch.randint(0, 64, (k,))]
        scales = [float(s) for s in torch.rand(k) * 1.5 + 0.3]
        fixed, base = 2.0 + trial, k + trial % 3
        sel = policies.caddtree_select_batch([iter(s) for s in streams], curve, fixed, base, k, caps, scales)
        want = policies.caddtree_select_batch_reference([[math.exp(n.path_logprob) for n in s] for s in streams],
                                                        curve, fixed, base, k, caps, scales)
        assert [len(c) for c in sel.nodes] == want
        assert all(c == s[:len(c)] for c, s in zip(sel.nodes, streams))  # each request's cut is its best-first prefix
        assert math.isclose(sel.turn_ms, fixed + curve(base + sum(want)))


def test_batch_selection_of_one_is_caddtree():
    torch.manual_seed(3)
    model = VerifyCostModel([0], [ConvexCost((1, 16, 128), (10.0, 13.0, 60.0))], 3.0)
    for scale in (0.5, 1.0, 1.7):
        marg = torch.randn(6, 50).mul(2).log_softmax(-1)
        nodes = list(best_first_nodes(marg, 200))
        alone = caddtree_select(iter(nodes), model, 0, 200, overhead_ms=0.7, accept_scale=scale)
        batch = policies.caddtree_select_batch([iter(nodes)], model.verify_curve(0), 3.7, 1, 1, [200], [scale])
        assert batch.nodes == [alone.nodes] and math.isclose(batch.turn_ms, alone.round_ms)


def test_batch_selection_is_stingier_in_a_busy_turn():
    """Eight requests' roots already in the forward: each node must pay against eight tokens' rate."""
    torch.manual_seed(4)
    model = VerifyCostModel([0], [ConvexCost((1, 8, 16, 64), (3.5, 4.5, 6.0, 18.0))], 1.0)
    marg = torch.randn(6, 50).mul(3).log_softmax(-1)
    nodes = list(best_first_nodes(marg, 64))
    alone = policies.caddtree_select_batch([iter(nodes)], model.verify_curve(0), 1.0, 1, 1, [64], [1.0])
    busy = policies.caddtree_select_batch([iter(nodes)] + [iter(())] * 7, model.verify_curve(0), 1.0, 8, 8,
                                          [64] * 8, [1.0] * 8)
    assert 0 < len(busy.nodes[0]) < len(alone.nodes[0])
    with pytest.raises(ValueError):
        policies.caddtree_select_batch([iter(nodes)], model.verify_curve(0), 1.0, 1, 1, [64, 3], [1.0])


def test_cost_aware_policy_builds_a_turns_trees_together():
    """CostAwarePolicy.build_many: the batch selection over the requests' marginals; a turn of one with the profiled
    draft cost is CaDDTree alone; recalibrating requests record the turn's modelled time and their own Φ."""
    from drafttree.proposers import CostAwarePolicy
    from drafttree.protocols import BatchTurn

    torch.manual_seed(5)
    model = VerifyCostModel([0], [ConvexCost((1, 8, 64), (4.0, 5.0, 20.0))], 1.5)
    margs = [torch.randn(4, 30).mul(3).log_softmax(-1) for _ in range(3)]
    policy = CostAwarePolicy(model, 24)
    alone = policy.build(None, 7, margs[0], 10)
    assert policy.build_many([None], [7], margs[:1], [10], None, BatchTurn(1, 1.5))[0].tokens.tolist() == \
        alone.tokens.tolist()
    trees = policy.build_many([None] * 3, [1, 2, 3], margs, [10, 20, 30], None, BatchTurn(5, 2.0))
    want = policies.caddtree_select_batch([best_first_nodes(m, 24) for m in margs], model.verify_curve(20), 2.0, 5, 5,
                                          [24] * 3, [1.0] * 3)
    assert [t.num_draft_nodes for t in trees] == [len(n) for n in want.nodes]
    assert [t.tokens[0] for t in trees] == [1, 2, 3] and sum(len(n) for n in want.nodes) > 0
    online = CostAwarePolicy(model, 24, recalibrate=True)
    states = [online.new_state(lambda: 0.0) for _ in margs]
    online.build_many(states, [1, 2, 3], margs, [10, 20, 30], None, BatchTurn(5, 2.0))
    for s, nodes in zip(states, want.nodes):
        assert math.isclose(s.last_round[1], want.turn_ms)  # no overhead learnt yet: the turn's modelled ms
        assert math.isclose(s.last_round[2], sum(math.exp(n.path_logprob) for n in nodes))
