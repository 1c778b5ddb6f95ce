import itertools

import pytest
import torch
from scipy.stats import chisquare

from drafttree.sampling import SamplingParams, sampling_probs
from drafttree.tree import DraftTree, build_chain_tree, random_tree
from drafttree.verify import accept_greedy, accept_greedy_reference, accept_sampling

# ---- greedy ------------------------------------------------------------------------------


def _hand_tree():
    #        0(root=9)
    #       /         \
    #     1(5)        2(6)
    #    /    \         \
    #  3(7)   4(8)      5(7)
    #   |
    #  6(1)
    return DraftTree.from_parents([9, 5, 6, 7, 8, 7, 1], [-1, 0, 0, 1, 1, 2, 3])


@pytest.mark.parametrize("argmax,nodes,bonus", [
    ([5, 7, 0, 1, 0, 0, 4], [0, 1, 3, 6], 4),  # full depth, bonus from the leaf
    ([6, 0, 7, 0, 0, 3, 0], [0, 2, 5], 3),  # second branch
    ([5, 8, 0, 0, 2, 0, 0], [0, 1, 4], 2),  # second child of node 1
    ([5, 3, 0, 0, 0, 0, 0], [0, 1], 3),  # nothing matches below node 1
    ([4, 0, 0, 0, 0, 0, 0], [0], 4),  # root's argmax is not drafted
])
def test_greedy_hand_cases(argmax, nodes, bonus):
    tree = _hand_tree()
    argmax = torch.tensor(argmax)
    for acc in (accept_greedy(tree, argmax), accept_greedy(tree, lambda i: argmax[i].item()),
                accept_greedy_reference(tree, argmax)):
        assert acc.nodes.tolist() == nodes and acc.bonus_token == bonus
    acc = accept_greedy(tree, argmax)
    assert acc.committed_tokens(tree).tolist() == tree.tokens[nodes[1:]].tolist() + [bonus]
    assert acc.num_accepted_drafts == len(nodes) - 1


def test_greedy_chain_is_longest_matching_prefix():
    tree = build_chain_tree(1, [2, 3, 4, 5])
    acc = accept_greedy(tree, torch.tensor([2, 3, 9, 9, 9]))
    assert acc.nodes.tolist() == [0, 1, 2] and acc.bonus_token == 9


@pytest.mark.parametrize("shape", ["chain", "star", "deep", "random"])
def test_greedy_matches_reference_on_random_trees(shape):
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        tree = random_tree(int(torch.randint(0, 30, (1,), generator=g)), 6, shape, g)
        if trial % 2:
            argmax = torch.randint(0, 6, (tree.num_nodes,), generator=g)
        else:  # plant a path to a random node so long acceptances happen too
            argmax = torch.randint(0, 6, (tree.num_nodes,), generator=g)
            target = int(torch.randint(0, tree.num_nodes, (1,), generator=g))
            path = tree.path(target).tolist()
            for a, b in zip(path, path[1:]):
                argmax[a] = tree.tokens[b]
        fast, ref = accept_greedy(tree, argmax), accept_greedy_reference(tree, argmax)
        assert fast.nodes.tolist() == ref.nodes.tolist() and fast.bonus_token == ref.bonus_token
        if trial % 2 == 0:
            assert len(fast.nodes) >= len(path)


def test_sampling_with_one_hot_probs_equals_greedy():
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        tree = random_tree(15, 5, "random", g)
        argmax = torch.randint(0, 5, (tree.num_nodes,), generator=g)
        probs = torch.nn.functional.one_hot(argmax, 5).float()
        s, r = accept_sampling(tree, probs, g), accept_greedy(tree, argmax)
        assert s.nodes.tolist() == r.nodes.tolist() and s.bonus_token == r.bonus_token


def test_sampling_queries_only_visited_nodes():
    tree = build_chain_tree(0, [1, 2, 3])
    asked = []

    def probs(i):
        asked.append(i)
        return torch.nn.functional.one_hot(torch.tensor(i + 1 if i < 1 else 4), 5).float()

    acc = accept_sampling(tree, probs, torch.Generator().manual_seed(0))
    assert asked == [0, 1] and acc.nodes.tolist() == [0, 1] and acc.bonus_token == 4


def test_walk_input_errors():
    tree = build_chain_tree(0, [1, 2])
    with pytest.raises(ValueError, match="shape"):
        accept_greedy(tree, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="shape"):
        accept_sampling(tree, torch.ones(2, 5) / 5, torch.Generator())
    with pytest.raises(ValueError, match="1-D"):
        accept_sampling(tree, lambda i: torch.ones(1, 5) / 5, torch.Generator())
    with pytest.raises(TypeError):
        accept_greedy(tree, [1, 2, 3])


# ---- losslessness: chi-squared against the target's own distribution ----------------------
#
# Target: a random trigram model over a tiny vocab, so the probability at each tree node depends
# on the node's own token and its parent's token (a walk that used the wrong row would show).

VOCAB = 5
PREFIX = (1, 3)  # committed context; PREFIX[-1] is the first round's root


def _trigram_probs(params: SamplingParams) -> torch.Tensor:
    logits = torch.randn(VOCAB, VOCAB, VOCAB, generator=torch.Generator().manual_seed(42)) * 0.8
    return sampling_probs(logits, params)  # [prev2, prev1, next]


def _tree_pool(g):
    shapes = ["chain", "star", "deep", "random"]
    return [random_tree(int(torch.randint(0, 9, (1,), generator=g)), VOCAB, shapes[i % 4], g)
            for i in range(64)]


def _node_probs(tree, context, table, off_by_one):
    toks, par = tree.tokens.tolist(), tree.parents.tolist()
    tok = lambda i: context[-1] if i == 0 else toks[i]  # the root stands for the last committed token
    prev = lambda i: context[-2] if i == 0 else tok(par[i])

    def probs(i):
        if off_by_one and i > 0:  # deliberate bug for the control test: use the parent's row
            i = par[i]
        return table[prev(i), tok(i)]

    return probs


def _first_two_tokens(table, n_samples, seed, off_by_one=False):
    g = torch.Generator().manual_seed(seed)
    pool = _tree_pool(g)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.long)
    picks = torch.randint(0, len(pool), (n_samples * 4,), generator=g).tolist()
    pick = iter(picks)
    for _ in range(n_samples):
        context, out = list(PREFIX), []
        while len(out) < 2:
            tree = pool[next(pick)]
            acc = accept_sampling(tree, _node_probs(tree, context, table, off_by_one), g)
            committed = acc.committed_tokens(tree).tolist()
            context += committed
            out += committed
        counts[out[0], out[1]] += 1
    return counts


def _expected_first_two(table):
    a, r = PREFIX
    p1 = table[a, r]  # [V]
    return p1[:, None] * table[r]  # p(t1) * p(t2 | r, t1) -> [V, V]


def _chi2_pvalue(counts, expected):
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token outside the target's top-k/top-p support"
    obs = counts[support].double()
    exp = expected[support].double()
    return chisquare(obs.numpy(), (exp / exp.sum() * obs.sum()).numpy()).pvalue


PARAMS = [
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8, top_k=4),
    SamplingParams(temperature=0.7),
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-p{p.top_p}-k{p.top_k}")
def test_tree_sampling_is_lossless_chi2(params):
    table = _trigram_probs(params)
    counts = _first_two_tokens(table, 20_000, seed=PARAMS.index(params))
    expected = _expected_first_two(table)
    assert _chi2_pvalue(counts.sum(1), expected.sum(1)) > 1e-3  # first token
    assert _chi2_pvalue(counts, expected) > 1e-3  # first two tokens


def test_chi2_catches_a_wrong_walk():
    # Control: a walk that samples at a node from its parent's distribution must be rejected,
    # otherwise the test above would prove nothing.
    table = _trigram_probs(SamplingParams(temperature=1.0))
    counts = _first_two_tokens(table, 5_000, seed=3, off_by_one=True)
    assert _chi2_pvalue(counts, _expected_first_two(table)) < 1e-6


def test_tree_pool_covers_acceptances():
    # The chi2 test only means something if the trees are often accepted into.
    g = torch.Generator().manual_seed(0)
    table = _trigram_probs(SamplingParams(temperature=1.0))
    accepted = 0
    for tree in itertools.islice(itertools.cycle(_tree_pool(g)), 500):
        accepted += accept_sampling(tree, _node_probs(tree, list(PREFIX), table, False), g).num_accepted_drafts
    assert accepted > 100
