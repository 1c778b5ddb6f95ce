"""One best-first candidate stream over two sources: the drafter's per-depth marginals and the lookup's
continuation trie.

A candidate is a token path below the root. The drafter gives every path a probability
s · Π m_d(token_d) (DDTree's independent-marginal weight, scaled by caddtree-online's acceptance factor
s when it has one); the lookup gives the paths of its trie Π a(b)·frac (drafttree.lookup.calibration,
calibrated on its own acceptance). Both estimate one quantity, the chance that the path is accepted, so
a path's weight is the larger of the two (a path only one source proposes has the other's weight 0).
Both weights fall along every path (each factor is <= 1), so their maximum does too, and popping paths in
weight order from one heap yields a topological, non-increasing stream, which is what DDTree's budget and
CaDDTree's greedy stop (policies.caddtree_select) consume. A path both sources propose is one node;
siblings always carry distinct tokens.

With no trie this is DDTree's stream (best_first_nodes); with no marginals, best-first over the trie.
Lookup paths may run deeper than the drafter's rows: there only the lookup weight counts.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Iterator, NamedTuple

import torch

from ..best_first import NEG_INF, Frontier
from ..tree import TreeNode, _RankedMarginals  # the drafter side's lazily grown per-depth ranking
from .index import ContinuationNode, Continuations



class MergedNode(NamedTuple):
    """A TreeNode (the first five fields) and where its weight came from."""

    parent: int  # tree index (0 = root); the i-th node of the stream becomes node i + 1
    token: int
    depth: int
    logprob: float  # path_logprob - the parent's
    path_logprob: float  # log max(s · drafter path prob, lookup path prob)
    drafter_logprob: float  # the drafter's own path log-prob, unscaled (-inf: beyond its rows or no drafter)
    lookup: ContinuationNode | None  # the trie node on this path, if the lookup proposes it

    def tree_node(self) -> TreeNode:
        return TreeNode(self.parent, self.token, self.depth, self.logprob, self.path_logprob)


def merged_best_first(cont: Continuations | None, marginal_logprobs, max_nodes: int,
                      drafter_scale: float = 1.0, token_ids: torch.Tensor | None = None) -> Iterator[MergedNode]:
    """The merged stream, at most `max_nodes` nodes, best first; stops early when only zero weights remain.

    marginal_logprobs [D, V]: the drafter's log-probs per depth (row d is depth d + 1; a tensor or a
    marginals.LazyDraftScores, whose rows are computed when the stream first reaches their depth), or None
    (lookup alone); with a reduced draft vocabulary V is its size and token_ids [V] the target id of each column
    (a trie token outside it has drafter weight 0). `cont`: the lookup's continuations, or None.
    `drafter_scale` multiplies the drafter's path
    probabilities (caddtree-online's acceptance scale). Ties pop in order of the paths' sibling ranks (best_first).
    """
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
        raise ValueError(f"max_nodes must be an int >= 1, got {max_nodes!r}")
    if drafter_scale <= 0:
        raise ValueError(f"drafter_scale must be > 0, got {drafter_scale}")
    ranked = None
    if marginal_logprobs is not None:
        vocab = marginal_logprobs.shape[-1]
        # trie tokens are skipped in the drafter's ranking, so it may need a few ranks past max_nodes
        ranked = _RankedMarginals(marginal_logprobs, k_cap=min(max_nodes + 64, vocab), token_ids=token_ids)
    sources = _Sources(cont, ranked, math.log(drafter_scale))
    frontier: Frontier[_MergedChildren] = Frontier()
    root_trie = cont.root if cont is not None else None
    frontier.add(_MergedChildren(sources, 0, 0, 0.0, 0.0, 0.0 if root_trie is not None else NEG_INF, root_trie))
    emitted = 0
    while emitted < max_nodes and (popped := frontier.pop()) is not None:
        parent, r, w, ranks = popped
        _, token, d_lp, l_lp, trie = parent.made[r]
        emitted += 1
        depth = parent.depth + 1
        yield MergedNode(parent.index, token, depth, w - parent.logprob, w, d_lp, trie)
        if ranked is None or depth >= ranked.depth_count or depth < len(ranked.lp):  # nothing to defer
            frontier.add(_MergedChildren(sources, emitted, depth, w, d_lp, l_lp, trie), ranks)
        else:
            frontier.add_unranked(w, ranks, partial(_MergedChildren, sources, emitted, depth, w, d_lp, l_lp, trie))


class _Sources(NamedTuple):
    cont: Continuations | None
    ranked: _RankedMarginals | None
    log_scale: float  # log of the drafter's acceptance scale


class _MergedChildren:
    """One node's children from both sources, best first, made as the search asks for them.

    The trie's candidates (few) are scored and sorted up front; the drafter's row is walked lazily,
    skipping the trie's tokens (a path both propose is one node, weighted by the larger estimate).
    `made[r]` = (path log-prob, token, drafter path log-prob, lookup path log-prob, trie node)."""

    __slots__ = ("sources", "index", "depth", "logprob", "drafter_logprob", "look", "look_next", "row",
                 "row_lp", "row_ids", "rank", "skip", "made")

    def __init__(self, sources: _Sources, index: int, depth: int, logprob: float, drafter_logprob: float,
                 lookup_logprob: float, trie: ContinuationNode | None):
        self.sources, self.index, self.depth, self.logprob = sources, index, depth, logprob
        self.drafter_logprob = drafter_logprob
        ranked = sources.ranked
        self.row = depth if ranked is not None and depth < ranked.depth_count and drafter_logprob > NEG_INF else -1
        # the row's ranked lists, held once (_RankedMarginals.grow extends these same lists)
        self.row_lp, self.row_ids = ranked.row(depth) if ranked is not None and self.row >= 0 else ([], [])
        look = []
        if trie is not None:
            assert sources.cont is not None  # trie nodes are cont's
            for c in sources.cont.children(trie):
                d_lp = drafter_logprob + ranked.logprob_of(depth, c.token) if ranked is not None and self.row >= 0 else NEG_INF
                l_lp = lookup_logprob + c.log_q
                look.append((max(sources.log_scale + d_lp, l_lp), d_lp, l_lp, c))
            look.sort(key=lambda e: -e[0])  # stable: trie order (count, recency) breaks ties
        self.look, self.look_next = look, 0
        self.skip = {e[3].token for e in look}
        self.rank = 0  # the drafter row's next rank to look at
        self.made: list[tuple[float, int, float, float, ContinuationNode | None]] = []

    def child_logprob(self, r: int) -> float:
        made = self.made
        while len(made) <= r:
            child = self._next()
            if child is None:
                return NEG_INF
            made.append(child)
        return made[r][0]

    def _next(self):
        """The better of the trie's and the drafter's next candidates, or None when both are spent."""
        look = self.look
        best_l = look[self.look_next] if self.look_next < len(look) else None
        best_d = None
        if self.row >= 0:
            ranked = self.sources.ranked
            assert ranked is not None  # a drafter row: there are drafter marginals
            lp, ids, skip, rank = self.row_lp, self.row_ids, self.skip, self.rank
            while True:
                if rank >= len(lp) and not (rank < ranked.k_cap and ranked.grow(self.row)):
                    break
                if ids[rank] in skip:
                    rank += 1
                    continue
                w = lp[rank]
                if w > NEG_INF:
                    best_d = (self.sources.log_scale + self.drafter_logprob + w, ids[rank], self.drafter_logprob + w)
                break
            self.rank = rank
        if best_l is not None and (best_d is None or best_l[0] >= best_d[0]):
            self.look_next += 1
            return best_l[0], best_l[3].token, best_l[1], best_l[2], best_l[3]
        if best_d is not None:
            self.rank += 1
            return best_d[0], best_d[1], best_d[2], NEG_INF, None
        return None
