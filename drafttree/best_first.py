"""The best-first search every draft-tree source runs: DDTree's marginals (tree.best_first_nodes), the
lookup merge (lookup.merge) and Weaver (weaver.tree) differ only in how a node's children are ranked.

The frontier is a max-heap of candidates "the r-th best child of node u", keyed by that child's path
log-prob. Popping one emits the child and puts u's (r+1)-th child in its place: siblings weigh no more
as r grows, and a node's children weigh no more than the node (log-probs are <= 0), so every candidate
enters after its predecessor left and the emitted stream is topological with non-increasing weights —
what a fixed budget or CaDDTree's greedy stop (policies) cuts. Ties are broken by the path's tuple of
sibling ranks, so the order is total and the same for every source.

A node's children may enter *unranked*, keyed by the node's own weight (an upper bound on theirs): they
are ranked only when that entry reaches the top, so a search that stops earlier never pays for ranking
them (a drafter row never computed, a trie never walked), and the emitted order is still the eager one.
Candidates of weight -inf never enter: only impossible prefixes would follow.
"""
from __future__ import annotations

import heapq
import math
from typing import Callable, Generic, Protocol, TypeVar

NEG_INF = -math.inf


class RankedChildren(Protocol):
    """A node's children, best first, as a source ranks them."""

    def child_logprob(self, r: int) -> float:
        """Path log-prob of the r-th best child (asked for r = 0, 1, 2, ... in order); -inf past the last."""
        ...


C = TypeVar("C", bound=RankedChildren)


# What `pop` returns: (the parent's ranked children, which of them was emitted, its path log-prob, the
# sibling ranks along its path: the tie key, and the prefix of its own children's). A plain tuple: this is
# the hot loop of tree building (a NamedTuple per node costs more than the heap operation).
Popped = tuple[C, int, float, tuple[int, ...]]


class Frontier(Generic[C]):
    """The heap of candidates. `add` / `add_unranked` put a node's children in; `pop` takes the best child
    out and enters its next sibling."""

    def __init__(self) -> None:
        # (-path_logprob, ranks, seq, children or ranking callback, rank, unranked)
        self._heap: list = []
        self._seq = 0  # never compared in practice (rank tuples are unique); keeps the heap off the objects

    def __bool__(self) -> bool:
        return bool(self._heap)

    def _push(self, w: float, ranks: tuple[int, ...], item, r: int, unranked: bool) -> None:
        if w > NEG_INF:
            heapq.heappush(self._heap, (-w, ranks, self._seq, item, r, unranked))
            self._seq += 1

    def add(self, children: C, ranks: tuple[int, ...] = ()) -> None:
        """A node's ranked children; `ranks` is the node's own path of sibling ranks (the root's: ())."""
        self._push(children.child_logprob(0), ranks + (0,), children, 0, False)

    def add_unranked(self, bound: float, ranks: tuple[int, ...], rank: Callable[[], C | None]) -> None:
        """A node's children, ranked by `rank()` only when `bound` (the node's weight) reaches the top;
        `rank` may return None (no children)."""
        self._push(bound, ranks + (0,), rank, 0, True)

    def pop(self) -> Popped[C] | None:
        """The best candidate (its next sibling takes its place), or None when none is left."""
        heap = self._heap
        while heap:
            neg_w, ranks, _, item, r, unranked = heapq.heappop(heap)
            if unranked:
                children = item()
                if children is not None:
                    self.add(children, ranks[:-1])
                continue
            self._push(item.child_logprob(r + 1), ranks[:-1] + (r + 1,), item, r + 1, False)
            return item, r, -neg_w, ranks
        return None

    def best(self, k: int) -> list[Popped[C]]:
        """The k best ranked candidates, left in place (what a source may prepare ahead: weaver.tree)."""
        return [(item, r, -neg_w, ranks)
                for neg_w, ranks, _, item, r, unranked in heapq.nsmallest(k, self._heap) if not unranked]
