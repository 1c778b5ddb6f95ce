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
