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

import heapq
import math
from typing import Iterator, NamedTuple

import torch

from ..tree import TreeNode, _RankedMarginals  # the drafter side's lazily grown per-depth ranking
from .index import ContinuationNode, Continuations

NEG_INF = -math.inf


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
    probabilities (caddtree-online's acceptance scale). Ties pop in push order (deterministic).
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
    log_s = math.log(drafter_scale)
    heap: list = []
    counter = 0

    def children(index, depth, score, drafter_lp, lookup_lp, trie):
        """Per parent: (sorted trie candidates, the drafter row or -1, cursor state) as a small list."""
        look = []
        row = depth if ranked is not None and depth < ranked.depth_count and drafter_lp > NEG_INF else -1
        if trie is not None:
            assert cont is not None  # trie nodes are cont's
            drafter = ranked if row >= 0 else None
            for c in cont.children(trie):
                d_lp = drafter_lp + drafter.logprob_of(depth, c.token) if drafter is not None else NEG_INF
                l_lp = lookup_lp + c.log_q
                look.append((max(log_s + d_lp, l_lp), d_lp, l_lp, c))
            look.sort(key=lambda e: -e[0])  # stable: trie order (count, recency) breaks ties
        skip = {e[3].token for e in look}
        # [index, depth, score, drafter_lp, look, li, row, rank, skip]
        return [index, depth, score, drafter_lp, look, 0, row, 0, skip]

    def next_child(ch):
        """Pop this parent's next candidate: (weight, token, drafter_lp, lookup_lp, trie node) or None."""
        _, depth, _, drafter_lp, look, li, row, rank, skip = ch
        best_l = look[li] if li < len(look) else None
        best_d = None
        if row >= 0:
            assert ranked is not None  # a drafter row: there are drafter marginals
            lp, ids = ranked.row(row)
            while True:
                if rank >= len(lp) and not (rank < ranked.k_cap and ranked.grow(row)):
                    break
                if ids[rank] in skip:
                    rank += 1
                    continue
                w = lp[rank]
                if w > NEG_INF:
                    best_d = (log_s + drafter_lp + w, ids[rank], drafter_lp + w)
                break
            ch[7] = rank
        if best_l is not None and (best_d is None or best_l[0] >= best_d[0]):
            ch[5] = li + 1
            return best_l[0], best_l[3].token, best_l[1], best_l[2], best_l[3]
        if best_d is not None:
            ch[7] = rank + 1
            return best_d[0], best_d[1], best_d[2], NEG_INF, None
        return None

    def push(ch, order=None):
        nonlocal counter
        nxt = next_child(ch)
        if nxt is not None and nxt[0] > NEG_INF:
            heapq.heappush(heap, (-nxt[0], counter if order is None else order, ch, nxt))
            counter += order is None

    def push_children_later(args):
        """A node's best child enters keyed by the node's own weight (no child weighs more) and is found
        when it reaches the top, so the drafter row of a depth the stream never gets to is never computed.
        It keeps its push-time place among ties, so the order is the eager one."""
        nonlocal counter
        heapq.heappush(heap, (-args[2], counter, None, args))
        counter += 1

    root_trie = cont.root if cont is not None else None
    push(children(0, 0, 0.0, 0.0, 0.0 if root_trie is not None else NEG_INF, root_trie))
    emitted = 0
    while heap and emitted < max_nodes:
        _, order, parent, entry = heapq.heappop(heap)
        if parent is None:  # a node's children, not looked at yet
            push(children(*entry), order)
            continue
        w, token, d_lp, l_lp, trie = entry
        emitted += 1
        depth = parent[1] + 1
        yield MergedNode(parent[0], token, depth, w - parent[2], w, d_lp, trie)
        push(parent)  # the parent's next sibling candidate
        push_children_later((emitted, depth, w, d_lp, l_lp, trie))  # this node's best child
