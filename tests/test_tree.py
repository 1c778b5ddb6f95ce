import math

import pytest
import torch

from drafttree.policies import build_best_first_tree
from drafttree.tree import (
    SMALL_TREE,
    DraftTree,
    TreeNode,
    ancestor_mask_by_depth,
    ancestor_mask_reference,
    best_first_nodes,
    best_first_reference,
    build_chain_tree,
    iter_tree_nodes,
    random_tree,
)

SHAPES = ["chain", "star", "deep", "random"]


def _log_marginals(depth, vocab, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(depth, vocab, generator=g) * scale).log_softmax(-1)


def _check_invariants(tree: DraftTree):
    n = tree.num_nodes
    p, d = tree.parents.tolist(), tree.depths.tolist()
    assert p[0] == -1 and d[0] == 0
    for i in range(1, n):
        assert 0 <= p[i] < i
        assert d[i] == d[p[i]] + 1
        assert tree.path_logprobs[i].item() == pytest.approx(
            tree.path_logprobs[p[i]].item() + tree.logprobs[i].item(), abs=1e-5, nan_ok=True)
    for i in range(n):
        kids = tree.children(i)
        assert all(p[c] == i for c in kids)
        assert len({tree.tokens[c].item() for c in kids}) == len(kids)
    assert sum(len(tree.children(i)) for i in range(n)) == n - 1


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("size", [0, 1, 7, 40])
def test_random_tree_invariants_and_mask(shape, size):
    tree = random_tree(size, vocab_size=50, shape=shape, generator=torch.Generator().manual_seed(size))
    _check_invariants(tree)
    mask = tree.ancestor_mask
    assert torch.equal(mask, ancestor_mask_reference(tree.parents))
    # Each node sees exactly itself and its depth ancestors, and the mask is lower-triangular.
    assert torch.equal(mask.sum(1), tree.depths + 1)
    assert not torch.triu(mask, diagonal=1).any()
    assert torch.equal(tree.positions(100), tree.depths + 100)
    for i in range(tree.num_nodes):
        assert torch.equal(mask[i].nonzero().flatten(), tree.path(i))
    if shape == "chain":
        assert torch.equal(tree.depths, torch.arange(size + 1))
    if shape == "star":
        assert tree.depths[1:].eq(1).all()


def test_mask_fast_path_matches_reference_on_many_trees():
    """Both fast forms (the vectorised climb, and a small tree's parent-list rows: DraftTree.ancestor_mask) equal
    the reference."""
    g = torch.Generator().manual_seed(1)
    for trial in range(120):
        size = int(torch.randint(0, 80 if trial % 2 else SMALL_TREE, (1,), generator=g))
        tree = random_tree(size, 1000, SHAPES[trial % 4], g)
        reference = ancestor_mask_reference(tree.parents)
        assert torch.equal(ancestor_mask_by_depth(tree.parents, int(tree.depths.max())), reference)
        assert torch.equal(tree.ancestor_mask, reference)


def test_chain_tree():
    tree = build_chain_tree(7, [3, 4, 5], logprobs=[-0.1, -0.2, -0.3])
    assert tree.tokens.tolist() == [7, 3, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert torch.allclose(tree.path_logprobs, torch.tensor([0.0, -0.1, -0.3, -0.6]))
    assert torch.equal(tree.ancestor_mask, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    unknown = build_chain_tree(7, torch.tensor([1, 2]))
    assert unknown.logprobs[0] == 0 and unknown.logprobs[1:].isnan().all()
    assert build_chain_tree(7, []).num_nodes == 1


def test_root_only_is_from_parents_of_the_root():
    """A plain round's tree (DraftTree.root_only, no checks) has the fields, mask and truncation of the general
    constructor's."""
    fast, general = DraftTree.root_only(42), DraftTree.from_parents([42], [-1])
    for name in ("tokens", "parents", "depths", "logprobs", "path_logprobs"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
        assert getattr(fast, name).dtype == getattr(general, name).dtype, name
    assert torch.equal(fast.ancestor_mask, ancestor_mask_reference(general.parents))
    assert fast.truncated(0, 0) is fast and fast.child_maps == [{}]


def test_from_nodes_roundtrip():
    tree = random_tree(30, 100, "random", torch.Generator().manual_seed(3))
    again = DraftTree.from_nodes(tree.tokens[0].item(), iter_tree_nodes(tree))
    for name in ("tokens", "parents", "depths", "logprobs", "path_logprobs"):
        assert torch.equal(getattr(tree, name), getattr(again, name))


@pytest.mark.parametrize("depth,vocab,seed", [(1, 6, 0), (2, 5, 1), (3, 4, 2), (4, 3, 3), (3, 5, 4)])
def test_best_first_equals_brute_force(depth, vocab, seed):
    m = _log_marginals(depth, vocab, 2.0, seed)
    total = sum(vocab ** d for d in range(1, depth + 1))
    for budget in sorted({1, 2, 3, 5, 8, total // 2, total, total + 5}):
        tree = build_best_first_tree(9, m, budget)
        assert tree.num_draft_nodes == min(budget, total)
        _check_invariants(tree)
        paths = [tuple(tree.tokens[tree.path(i)[1:]].tolist()) for i in range(1, tree.num_nodes)]
        assert paths == best_first_reference(m, budget)  # same nodes and same (pop) order
        # Path weights are the summed marginals and come out non-increasing.
        for i, path in enumerate(paths, start=1):
            expect = sum(m[d, t].item() for d, t in enumerate(path))
            assert tree.path_logprobs[i].item() == pytest.approx(expect, abs=1e-5)
        assert (tree.path_logprobs[2:] <= tree.path_logprobs[1:-1]).all()


def test_best_first_lazy_rank_growth_matches_brute_force():
    # Flat marginals over a vocab far larger than the initial top-k force rows to grow.
    m = _log_marginals(2, 300, 0.05, 5)
    tree = build_best_first_tree(0, m, 150)
    paths = [tuple(tree.tokens[tree.path(i)[1:]].tolist()) for i in range(1, tree.num_nodes)]
    assert paths == best_first_reference(m, 150)


def test_best_first_with_ties_is_valid_and_optimal():
    # All-equal marginals: every order is a tie; nodes must still be distinct, prefix-closed, optimal.
    m = torch.full((3, 40), -math.log(40))
    tree = build_best_first_tree(0, m, 60)
    _check_invariants(tree)
    assert tree.num_draft_nodes == 60
    assert (tree.depths[1:41] == 1).all() and (tree.depths[41:] == 2).all()  # 40 roots' children first


def test_best_first_stops_at_zero_probability():
    m = torch.full((3, 5), -math.inf)
    m[:, 0] = 0.0
    m[1, 1] = -1.0
    m[1, 0] = math.log(1 - math.exp(-1.0))
    tree = build_best_first_tree(0, m, 50)
    assert tree.num_draft_nodes == 5  # 0 ; 0-0, 0-1 ; 0-0-0, 0-1-0: the only finite prefixes
    assert torch.isfinite(tree.path_logprobs).all()


def test_generator_is_incremental_and_consistent():
    m = _log_marginals(15, 1000, 3.0, 7)
    stream = best_first_nodes(m, 64)
    first = [next(stream) for _ in range(10)]
    full = list(best_first_nodes(m, 64))
    assert first == full[:10]
    assert all(isinstance(x, TreeNode) for x in full)
    small = build_best_first_tree(1, m, 10)
    assert small.tokens[1:].tolist() == [x.token for x in first]


def test_realistic_size_runs_and_is_topological():
    m = _log_marginals(15, 49152, 6.0, 8)
    tree = build_best_first_tree(11, m, 256)
    assert tree.num_draft_nodes == 256
    assert (tree.parents[1:] < torch.arange(1, 257)).all()
    assert torch.equal(tree.ancestor_mask, ancestor_mask_reference(tree.parents))


@pytest.mark.parametrize("budget", [0, -3, 2.5, True])
def test_bad_budget(budget):
    with pytest.raises(ValueError, match="budget"):
        build_best_first_tree(0, _log_marginals(3, 10, 1.0, 0), budget)


def test_bad_marginals():
    with pytest.raises(ValueError, match="2-D"):
        build_best_first_tree(0, torch.zeros(10), 4)
    with pytest.raises(ValueError, match="<= 0"):
        build_best_first_tree(0, torch.randn(3, 10) + 5, 4)
    nan = _log_marginals(3, 10, 1.0, 0)
    nan[1, 4] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        build_best_first_tree(0, nan, 4)
    with pytest.raises(TypeError):
        build_best_first_tree(0, [[0.0]], 4)


def test_bad_tree_structure():
    with pytest.raises(ValueError, match="parent must precede child"):
        DraftTree.from_parents([0, 1, 2], [-1, 2, 0])
    with pytest.raises(ValueError, match="root"):
        DraftTree.from_parents([0, 1], [0, 0])
    with pytest.raises(ValueError, match="same token"):
        DraftTree.from_parents([0, 5, 5], [-1, 0, 0])
    good = build_chain_tree(0, [1, 2])
    with pytest.raises(ValueError, match="depths"):
        DraftTree(good.tokens, good.parents, torch.tensor([0, 1, 1]), good.logprobs, good.path_logprobs)
    with pytest.raises(ValueError, match="parent must precede child"):
        DraftTree(good.tokens, torch.tensor([-1, 0, 2]), good.depths, good.logprobs, good.path_logprobs)
    with pytest.raises(ValueError, match="length"):
        DraftTree(good.tokens, good.parents[:2], good.depths, good.logprobs, good.path_logprobs)


def test_overhead_measurement_runs():
    from drafttree.tree_overhead import measure_tree_build_overhead

    rows = measure_tree_build_overhead(budgets=(4, 32), depth=5, vocab=500, repeats=2)
    assert [r["budget"] for r in rows] == [4, 32]
    assert all(r["total_us"] > 0 and r["max_depth"] >= 1 for r in rows)
