"""Draft trees: the node layout the target verifies in one forward, and how DDTree builds them.

Node 0 is the root: the last committed token (the bonus of the previous round), which the
target has not processed yet, so it is part of the verify input but is not a draft. Parents
always precede children (topological numbering), which makes masks and walks one pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Iterable, Iterator, NamedTuple, Sequence

import torch

from .best_first import Frontier
from .marginals import LazyDraftScores, Scores


class TreeNode(NamedTuple):
    """One draft node as produced by best-first search, before it is placed in a DraftTree.

    `parent` is an index in the final tree (0 = root); the i-th node of a stream becomes node i+1.
    """

    parent: int
    token: int
    depth: int  # 1-based; the root has depth 0
    logprob: float  # draft log-prob of `token` at this depth
    path_logprob: float  # sum of logprobs from depth 1 to this node (DDTree's prefix weight, in logs)


@dataclass(eq=False)
class DraftTree:
    """A draft tree in topological order. All tensors have length n = number of draft nodes + 1."""

    tokens: torch.Tensor  # LongTensor[n]; tokens[0] is the root (last committed token)
    parents: torch.Tensor  # LongTensor[n]; parents[0] = -1, parents[i] < i
    depths: torch.Tensor  # LongTensor[n]; depths[0] = 0, depths[i] = depths[parents[i]] + 1
    logprobs: torch.Tensor  # FloatTensor[n]; draft log-prob of each node's token (root 0, NaN = unknown)
    path_logprobs: torch.Tensor  # FloatTensor[n]; cumulative along the path (root 0)

    def __post_init__(self):
        # Python lists: the walk and the child maps touch single elements, which is slow on tensors.
        self._parent_list, self._token_list = _check_tree_tensors(self.tokens, self.parents, self.depths,
                                                                  self.logprobs, self.path_logprobs)
        child_maps: list[dict[int, int]] = [{} for _ in self._parent_list]
        for i in range(1, len(self._parent_list)):
            siblings = child_maps[self._parent_list[i]]
            tok = self._token_list[i]
            if tok in siblings:
                # Two siblings with one token make the walk ambiguous and waste a verify slot.
                raise ValueError(f"nodes {siblings[tok]} and {i} are siblings with the same token {tok}")
            siblings[tok] = i
        self.child_maps = child_maps  # per node: token -> child index

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def from_nodes(cls, root_token: int, nodes: Sequence[TreeNode]) -> "DraftTree":
        """Tree from a root token and nodes in topological order (node i of the list is tree node i+1)."""
        n = len(nodes) + 1
        tokens = torch.empty(n, dtype=torch.long)
        parents = torch.empty(n, dtype=torch.long)
        depths = torch.empty(n, dtype=torch.long)
        logprobs = torch.empty(n, dtype=torch.float32)
        path_logprobs = torch.empty(n, dtype=torch.float32)
        tokens[0], parents[0], depths[0], logprobs[0], path_logprobs[0] = int(root_token), -1, 0, 0.0, 0.0
        if nodes:
            # One tensor construction per field is far cheaper than n element writes.
            cols = list(zip(*nodes))
            parents[1:] = torch.tensor(cols[0], dtype=torch.long)
            tokens[1:] = torch.tensor(cols[1], dtype=torch.long)
            depths[1:] = torch.tensor(cols[2], dtype=torch.long)
            logprobs[1:] = torch.tensor(cols[3], dtype=torch.float32)
            path_logprobs[1:] = torch.tensor(cols[4], dtype=torch.float32)
        return cls(tokens, parents, depths, logprobs, path_logprobs)

    @classmethod
    def root_only(cls, root_token: int) -> "DraftTree":
        """The tree of a plain round: the root alone (what from_parents([root_token], [-1]) gives, without its
        checks and loops: a gated proposer's plain rounds make one every step)."""
        return cls(torch.tensor([int(root_token)]), torch.tensor([-1]), torch.zeros(1, dtype=torch.long),
                   torch.zeros(1), torch.zeros(1))

    @classmethod
    def from_parents(cls, tokens, parents, logprobs=None) -> "DraftTree":
        """Tree from tokens[n] (root first) and parents[n] (root -1); depths and path log-probs derived.

        `logprobs` (length n, root entry ignored) defaults to NaN = unknown.
        """
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        parents = torch.as_tensor(parents, dtype=torch.long)
        if tokens.dim() != 1 or parents.shape != tokens.shape or tokens.numel() < 1:
            raise ValueError(f"tokens and parents must be 1-D of equal length >= 1, got {tuple(tokens.shape)} "
                             f"and {tuple(parents.shape)}")
        n = tokens.numel()
        plist = parents.tolist()
        _check_parent_list(plist)
        if logprobs is None:
            lp = [0.0] + [math.nan] * (n - 1)
        else:
            lp = torch.as_tensor(logprobs, dtype=torch.float32).tolist()
            if len(lp) != n:
                raise ValueError(f"logprobs must have length {n} (root included), got {len(lp)}")
            lp[0] = 0.0
        depth = [0] * n
        path = [0.0] * n
        for i in range(1, n):
            depth[i] = depth[plist[i]] + 1
            path[i] = path[plist[i]] + lp[i]
        return cls(tokens, parents, torch.tensor(depth), torch.tensor(lp), torch.tensor(path))

    # ---- derived views ------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """Nodes including the root = tokens in the verify forward."""
        return self.tokens.numel()

    @property
    def num_draft_nodes(self) -> int:
        return self.tokens.numel() - 1

    def positions(self, start: int) -> torch.Tensor:
        """Position ids for the verify forward; the root sits at `start`, siblings share a position."""
        return self.depths + start

    def children(self, node: int) -> list[int]:
        return list(self.child_maps[node].values())

    def principal_path(self, node: int = 0) -> list[int]:
        """`node`, then its first child, that child's first child, ...: in a best-first tree (nodes in order of
        path probability) the most probable path below `node`, the one a walk most likely takes."""
        path, maps = [node], self.child_maps
        while maps[node]:
            node = min(maps[node].values())
            path.append(node)
        return path

    def path(self, node: int) -> torch.Tensor:
        """Root-first node indices from the root to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self._parent_list[node]
        return torch.tensor(out[::-1], dtype=torch.long)

    def truncated(self, max_nodes: int, max_depth: int) -> "DraftTree":
        """The first `max_nodes` nodes (root included) no deeper than `max_depth`: still a tree, since
        parents precede children and are shallower. Itself when nothing is cut."""
        keep = (self.depths <= max_depth).nonzero().flatten()[:max(1, max_nodes)]
        if keep.numel() == self.num_nodes:
            return self
        remap = torch.full((self.num_nodes,), -1, dtype=torch.long)
        remap[keep] = torch.arange(keep.numel())
        parents = self.parents[keep]
        parents[1:] = remap[parents[1:]]
        return DraftTree(self.tokens[keep], parents, self.depths[keep], self.logprobs[keep], self.path_logprobs[keep])

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """Bool [n, n]: mask[i, j] is True iff j is i or an ancestor of i (what node i may attend to)."""
        n = self.num_nodes
        if n > SMALL_TREE:
            return ancestor_mask_by_depth(self.parents, int(self.depths.max()))
        rows: list[list[bool]] = []  # a node's row: its parent's, plus itself (parents precede children)
        for i, p in enumerate(self._parent_list):
            row = rows[p].copy() if p >= 0 else [False] * n
            row[i] = True
            rows.append(row)
        return torch.tensor(rows)


# ---- ancestor mask: fast path and reference ---------------------------------------------

# Up to this many nodes (most CPU rounds' trees) the mask is built from the parent list in Python: 4-9 µs against the
# vectorised climb's ~25 µs of small tensor ops (Emerald Rapids); larger trees take the climb.
SMALL_TREE = 16


def ancestor_mask_by_depth(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Vectorised: climb all nodes one level at a time, marking each ancestor (max_depth steps)."""
    n = parents.numel()
    rows = torch.arange(n)
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[rows, rows] = True
    up = parents.clone()
    up[0] = 0  # the root is its own parent here, so climbing past it stays at the root
    anc = rows
    for _ in range(max_depth):
        anc = up[anc]
        mask[rows, anc] = True
    return mask


def ancestor_mask_reference(parents: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Naive: walk each node's parent chain to the root."""
    plist = torch.as_tensor(parents).tolist()
    n = len(plist)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = plist[j]
    return mask


# ---- builders ---------------------------------------------------------------------------


def build_chain_tree(root_token: int, draft_tokens, logprobs=None) -> DraftTree:
    """The DFlash chain as a tree: root -> d1 -> d2 -> ...; logprobs[i] belongs to draft_tokens[i]."""
    draft = torch.as_tensor(draft_tokens, dtype=torch.long).reshape(-1)
    n = draft.numel() + 1
    tokens = torch.cat([torch.tensor([int(root_token)]), draft])
    lp = torch.zeros(n, dtype=torch.float32)
    if logprobs is None:
        lp[1:] = math.nan
    else:
        given = torch.as_tensor(logprobs, dtype=torch.float32).reshape(-1)
        if given.numel() != n - 1:
            raise ValueError(f"logprobs must have one entry per draft token ({n - 1}), got {given.numel()}")
        lp[1:] = given
    return DraftTree(tokens, torch.arange(-1, n - 1), torch.arange(n), lp, torch.cumsum(lp, 0))


def best_first_nodes(marginal_logprobs: Scores, max_nodes: int,
                     token_ids: torch.Tensor | None = None) -> Iterator[TreeNode]:
    """DDTree's best-first enumeration of prefixes, highest path log-prob first, lazily.

    marginal_logprobs [D, V]: the drafter's log-probs per depth (row d is depth d+1), a tensor or a
    marginals.LazyDraftScores (rows computed when the search first reaches their depth); with a reduced
    draft vocabulary V is its size and token_ids [V] the target id of each column. Prefix weight
    = sum of log-marginals along the path (positions treated as independent). Yields at most
    `max_nodes` nodes in pop order, which is topological. Ties are broken by the tuple of
    top-k ranks along the path, so the order is total and deterministic. Stops early when only
    zero-probability (-inf) prefixes remain.
    """
    _check_marginals_shape(marginal_logprobs)
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
        raise ValueError(f"max_nodes must be an int >= 1, got {max_nodes!r}")
    depth_count, vocab = marginal_logprobs.shape
    ranked = _RankedMarginals(marginal_logprobs, k_cap=min(max_nodes, vocab), token_ids=token_ids)
    # A node's children are its depth's row: ranked when the search first reaches that depth (best_first).
    frontier: Frontier[_DepthChildren] = Frontier()
    frontier.add_unranked(0.0, (), lambda: _DepthChildren(ranked, 0, 0, 0.0))
    emitted = 0
    while emitted < max_nodes and (popped := frontier.pop()) is not None:
        children, r, w, ranks = popped
        emitted += 1
        d = children.depth
        yield TreeNode(children.parent, ranked.ids[d][r], d + 1, ranked.lp[d][r], w)
        if d + 1 < len(ranked.lp):  # the next depth's row is ranked already: no need to defer
            frontier.add(_DepthChildren(ranked, emitted, d + 1, w), ranks)
        elif d + 1 < depth_count:
            frontier.add_unranked(w, ranks, partial(_DepthChildren, ranked, emitted, d + 1, w))


class _DepthChildren:
    """Node `parent`'s children under independent marginals: depth index `depth`'s ranked row, shifted by
    the parent's path log-prob."""

    __slots__ = ("ranked", "parent", "depth", "parent_logprob")

    def __init__(self, ranked: "_RankedMarginals", parent: int, depth: int, parent_logprob: float):
        self.ranked, self.parent, self.depth, self.parent_logprob = ranked, parent, depth, parent_logprob
        ranked.row(depth)

    def child_logprob(self, r: int) -> float:
        ranked, d = self.ranked, self.depth
        lp = ranked.lp[d]
        if r >= len(lp) and not (r < ranked.k_cap and ranked.grow(d)):
            return -math.inf
        return self.parent_logprob + lp[r]


class _RankedMarginals:
    """Per-depth tokens sorted by log-prob, extended on demand.

    A full top-k with k = budget over a 49k-150k vocab costs milliseconds, but peaked draft
    marginals rarely use more than a few ranks per depth, so start small and double a row only
    when the heap asks for a rank past its end. Rows are ranked when first asked for (`row`): a
    tensor's all at once, lazy scores' a chunk at a time. With `token_ids` (a reduced draft vocabulary,
    ascending ids: column j is token token_ids[j]) the ranks are over the columns and `ids` holds target ids.
    """

    INITIAL_K = 16

    def __init__(self, marginal_logprobs: Scores, k_cap: int, token_ids: torch.Tensor | None = None):
        self.source = marginal_logprobs
        self.depth_count = marginal_logprobs.shape[0]
        self.k_cap = k_cap
        self.token_ids = token_ids
        self.m: list[torch.Tensor] = []  # log-prob row per ranked depth
        self.lp: list[list[float]] = []
        self.ids: list[list[int]] = []

    def row(self, d: int) -> tuple[list[float], list[int]]:
        """(log-probs, target ids) of depth index d, best first, ranking it (and its chunk) if not yet."""
        while d >= len(self.lp):
            self._rank(len(self.lp))
        return self.lp[d], self.ids[d]

    def _rank(self, d: int) -> None:
        if isinstance(self.source, torch.Tensor):
            rows = self.source[d:].detach().float()
        else:
            rows = self.source.logprobs_from(d)
        top = torch.topk(rows, min(self.k_cap, self.INITIAL_K), dim=-1)  # sorted descending
        lp = top.values.tolist()
        # The best entry per row is the row max (NaN sorts first in topk), so checking it is free.
        for i, row in enumerate(lp):
            if math.isnan(row[0]):
                raise ValueError(f"marginal log-probs contain NaN (depth {d + i + 1})")
            if row[0] > 1e-4:
                raise ValueError("marginal log-probs must be <= 0 (pass log_softmax of the logits, "
                                 f"not logits); depth {d + i + 1} has max {row[0]:.4g}")
        self.m.extend(rows.unbind(0))
        self.lp.extend(lp)
        self.ids.extend(self._ids(top.indices))

    def grow(self, d: int) -> bool:
        """Extend row d (about doubling it); returns True (it always gains entries below k_cap)."""
        self.row(d)
        have = len(self.lp[d])
        top = torch.topk(self.m[d], min(self.k_cap, 2 * have))
        # With ties, a larger top-k may pick different members of a tied group; keep the entries we
        # already handed out and append only unseen tokens, so ranks stay stable and tokens distinct.
        seen = set(self.ids[d])
        for v, i in zip(top.values.tolist(), self._ids(top.indices)):
            if i not in seen:
                self.lp[d].append(v)
                self.ids[d].append(i)
        return len(self.lp[d]) > have

    def _ids(self, columns: torch.Tensor) -> list:
        return (columns if self.token_ids is None else self.token_ids[columns]).tolist()

    def logprob_of(self, d: int, token: int) -> float:
        """The log-prob of target id `token` at depth index d (-inf outside a reduced vocabulary)."""
        self.row(d)
        if self.token_ids is None:
            return float(self.m[d][token])
        # binary search in the (sorted) draft vocabulary: no per-round inverse map on the hot path
        j = int(torch.searchsorted(self.token_ids, token))
        inside = j < self.token_ids.numel() and int(self.token_ids[j]) == token
        return float(self.m[d][j]) if inside else -math.inf


def best_first_reference(marginal_logprobs: torch.Tensor, budget: int) -> list[tuple[int, ...]]:
    """Brute force over all V^D prefixes (tiny cases only): the top-`budget` token paths by the
    same key (path log-prob desc, then rank tuple), each as a tuple of tokens from depth 1."""
    _check_marginals_shape(marginal_logprobs)
    depth_count, vocab = marginal_logprobs.shape
    top = torch.topk(marginal_logprobs.float(), vocab, dim=-1)
    lp, ids = top.values.tolist(), top.indices.tolist()
    scored = []

    def visit(ranks: tuple[int, ...], w: float):
        if ranks:
            scored.append((-w, ranks))
        if len(ranks) < depth_count:
            d = len(ranks)
            for r in range(vocab):
                visit(ranks + (r,), w + lp[d][r])  # same summation order as the heap

    visit((), 0.0)
    scored.sort()
    picked = [s for s in scored if s[0] != math.inf][:budget]
    return [tuple(ids[d][r] for d, r in enumerate(ranks)) for _, ranks in picked]


# ---- random trees for tests ---------------------------------------------------------------


def random_tree(num_draft_nodes: int, vocab_size: int, shape: str = "random",
                generator: torch.Generator | None = None, root_token: int = 0) -> DraftTree:
    """A random valid tree: shape in {"chain", "star", "deep", "random"}; sibling tokens distinct
    (a node whose chosen parent has no free token left hangs below the newest node instead).

    "deep" attaches each node to one of the last three nodes (long thin trees); "random" to any
    earlier node. Log-probs are random negatives, so path log-probs are meaningful.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    n = num_draft_nodes + 1
    parents, tokens = [-1], [root_token]
    child_tokens: list[set[int]] = [set()]
    for i in range(1, n):
        if shape == "chain":
            p = i - 1
        elif shape == "star":
            p = 0
        elif shape == "deep":
            p = max(0, i - 1 - int(torch.randint(0, 3, (1,), generator=g)))
        elif shape == "random":
            p = int(torch.randint(0, i, (1,), generator=g))
        else:
            raise ValueError(f"unknown tree shape {shape!r}; use chain, star, deep or random")
        if len(child_tokens[p]) >= vocab_size:
            p = i - 1  # parent already has every token as a child; the newest node has none yet
        free = [t for t in range(vocab_size) if t not in child_tokens[p]]
        tok = free[int(torch.randint(0, len(free), (1,), generator=g))]
        child_tokens[p].add(tok)
        child_tokens.append(set())
        parents.append(p)
        tokens.append(tok)
    logprobs = -torch.rand(n, generator=g) * 3
    return DraftTree.from_parents(tokens, parents, logprobs)


# ---- validation ---------------------------------------------------------------------------


def _check_marginals_shape(m) -> None:
    if isinstance(m, LazyDraftScores):
        if m.depth_count < 1 or m.vocab_size < 1:
            raise ValueError(f"marginal log-probs need depth >= 1 and vocab >= 1, got shape {m.shape}")
        return
    if not isinstance(m, torch.Tensor):
        raise TypeError(f"marginal log-probs must be a torch.Tensor [D, V], got {type(m).__name__}")
    if m.dim() != 2:
        raise ValueError(f"marginal log-probs must be 2-D [depth, vocab], got shape {tuple(m.shape)}")
    if m.shape[0] < 1 or m.shape[1] < 1:
        raise ValueError(f"marginal log-probs need depth >= 1 and vocab >= 1, got shape {tuple(m.shape)}")
    if not m.is_floating_point():
        raise TypeError(f"marginal log-probs must be floating point, got {m.dtype}")


def _check_parent_list(plist: list[int]) -> None:
    if plist[0] != -1:
        raise ValueError(f"node 0 is the root and must have parent -1, got {plist[0]}")
    for i in range(1, len(plist)):
        if not 0 <= plist[i] < i:
            raise ValueError(f"parent must precede child: node {i} has parent {plist[i]} (need 0 <= parent < {i})")


def _check_tree_tensors(tokens, parents, depths, logprobs, path_logprobs) -> tuple[list[int], list[int]]:
    """Validate a tree's tensors; returns (parents, tokens) as lists. The structure is checked on Python lists:
    for the few-node trees of a CPU round, element-wise tensor ops cost more than the loop."""
    n = tokens.numel() if isinstance(tokens, torch.Tensor) else -1
    for name, t in (("tokens", tokens), ("parents", parents), ("depths", depths),
                    ("logprobs", logprobs), ("path_logprobs", path_logprobs)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != n:
            raise ValueError(f"{name} must be a 1-D tensor of length {n} (the root included)")
    if n < 1:
        raise ValueError("a tree needs at least the root node")
    for name, t in (("tokens", tokens), ("parents", parents), ("depths", depths)):
        if t.dtype != torch.long:
            raise TypeError(f"{name} must be a LongTensor, got {t.dtype}")
    plist, dlist, tlist = parents.tolist(), depths.tolist(), tokens.tolist()
    if plist[0] != -1 or dlist[0] != 0:
        raise ValueError("node 0 is the root: parents[0] must be -1 and depths[0] must be 0")
    for i in range(1, n):
        p = plist[i]
        if not 0 <= p < i:
            raise ValueError(f"parent must precede child: node {i} has parent {p} (need 0 <= parent < {i})")
        if dlist[i] != dlist[p] + 1:
            raise ValueError(f"depths[{i}] = {dlist[i]} but its parent {p} has depth {dlist[p]}")
    if min(tlist) < 0:
        raise ValueError("token ids must be >= 0")
    return plist, tlist


def iter_tree_nodes(tree: DraftTree) -> Iterable[TreeNode]:
    """The draft nodes of a tree as TreeNodes (inverse of DraftTree.from_nodes)."""
    cols = [t.tolist() for t in (tree.parents, tree.tokens, tree.depths, tree.logprobs, tree.path_logprobs)]
    return [TreeNode(*row) for row in zip(*cols)][1:]
