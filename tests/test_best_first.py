"""The one best-first search (drafttree.best_first) against sorting every node of an explicit tree."""
import math
import random

import pytest
import torch

from drafttree.best_first import Frontier
from drafttree.lookup.merge import merged_best_first
from drafttree.tree import best_first_nodes


class ListChildren:
    """Children of an explicit tree node, ranked by log-prob (ties: list order)."""

    def __init__(self, tree, node, path_logprob):
        self.node, self.path_logprob = node, path_logprob
        self.kids = sorted(tree.get(node, []), key=lambda kid: -kid[1])  # (child id, logprob); stable

    def child_logprob(self, r):
        return self.path_logprob + self.kids[r][1] if r < len(self.kids) else -math.inf


def random_tree(rng, size, tied):
    tree, nodes = {}, [0]
    for child in range(1, size):
        lp = -rng.choice([0.0, 0.5, 1.0, math.inf]) if tied else -rng.expovariate(1.0)
        tree.setdefault(rng.choice(nodes), []).append((child, lp))
        nodes.append(child)
    return tree


def brute_force(tree):
    """Every reachable node as (path log-prob, sibling ranks), sorted best first, ties by ranks."""
    out = []

    def visit(node, w, ranks):
        for r, (kid, lp) in enumerate(sorted(tree.get(node, []), key=lambda kid: -kid[1])):
            if w + lp > -math.inf:
                out.append((w + lp, ranks + (r,), kid))
                visit(kid, w + lp, ranks + (r,))

    visit(0, 0.0, ())
    return sorted(out, key=lambda e: (-e[0], e[1]))


@pytest.mark.parametrize("unranked", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_frontier_pops_every_node_best_first_ties_by_ranks(tied, unranked):
    rng = random.Random(int(tied) * 2 + int(unranked))
    for _ in range(50):
        tree = random_tree(rng, rng.randint(1, 40), tied)
        frontier: Frontier[ListChildren] = Frontier()
        ranked_nodes = []

        def rank(node, w):
            ranked_nodes.append(node)
            return ListChildren(tree, node, w)

        frontier.add(ListChildren(tree, 0, 0.0))
        popped = []
        while (p := frontier.pop()) is not None:
            children, r, w, ranks = p
            kid = children.kids[r][0]
            popped.append((w, ranks, kid))
            if unranked:
                frontier.add_unranked(w, ranks, lambda kid=kid, w=w: rank(kid, w))
            else:
                frontier.add(ListChildren(tree, kid, w), ranks)
        assert popped == brute_force(tree)


def test_unranked_children_are_ranked_only_when_reached():
    tree = {0: [(1, -0.1), (2, -5.0)], 1: [(3, -0.1)], 2: [(4, -0.1)]}
    frontier: Frontier[ListChildren] = Frontier()
    frontier.add(ListChildren(tree, 0, 0.0))
    ranked = []
    for _ in range(2):  # nodes 1 and 3: node 2 (weight -5) is never popped, so its children are never ranked
        children, r, w, ranks = frontier.pop()
        kid = children.kids[r][0]
        frontier.add_unranked(w, ranks, lambda kid=kid, w=w: ranked.append(kid) or ListChildren(tree, kid, w))
    assert ranked == [1]
    assert [c.kids[r][0] for c, r, _, _ in frontier.best(5)] == [2]  # best() leaves unranked entries out


def test_every_source_breaks_ties_alike():
    """Tied marginals: the lookup merge with no trie is DDTree's stream node for node (one tie rule). Budgets
    >= the vocabulary, so both rank whole rows (a top-k of another k may order a tied group differently)."""
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        m = torch.randn(4, 12, generator=g).round().log_softmax(-1)
        for budget in (12, 30):
            want = [tuple(n) for n in best_first_nodes(m, budget)]
            assert [tuple(n.tree_node()) for n in merged_best_first(None, m, budget)] == want
