"""Walking a verified draft tree: which nodes are accepted and which token becomes the bonus.

Both walks follow the same rule: at the current node take the target's token for the next
position (argmax, or a fresh sample), move to the child holding that token, and stop when no
child does; the token that found no child is the bonus. Sampling this way ("sample-and-match")
is lossless for any fixed tree: every committed token is a target sample given its prefix.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Union

import torch

from .sampling import sample_from
from .tree import DraftTree

TargetArgmax = Union[torch.Tensor, Callable[[int], int]]
TargetProbs = Union[torch.Tensor, Callable[[int], torch.Tensor]]


class TreeLogits:
    """The target's logits at a verified tree's nodes, computed for the nodes a walk reaches: the verify forward
    computes them for the rows `verify_input` asks for (a small tree's every node, a larger one's principal path:
    `DraftTree.principal_path`), and a walk that leaves them gets the principal path below the node it reached in one
    more head call. The LM head is a fifth of a row's weights at SmolLM2's shape, and a walk reads τ of a tree's n
    rows.

    `row_logits(hidden [r, H]) -> [r, V]` must give the forward's own bits for those rows (the kernel paths'
    row-wise norm and head do)."""

    def __init__(self, tree: DraftTree, logits: torch.Tensor, rows: list[int], hidden: torch.Tensor | None,
                 row_logits: Callable[[torch.Tensor], torch.Tensor]):
        self.tree, self.hidden, self.row_logits = tree, hidden, row_logits
        self.at = dict(zip(rows, logits))  # node -> its logits row
        self.head_calls = 1

    def __call__(self, node: int) -> torch.Tensor:
        row = self.at.get(node)
        if row is None:
            if self.hidden is None:
                raise ValueError(f"no logits for node {node} and no hidden states to compute them from")
            rows = self.tree.principal_path(node)
            self.at.update(zip(rows, self.row_logits(self.hidden[rows])))
            self.head_calls += 1
            row = self.at[node]
        return row


class Acceptance(NamedTuple):
    nodes: torch.Tensor  # LongTensor: accepted node indices, root first (always starts with 0)
    bonus_token: int  # the target's token after the last accepted node (next round's root)

    @property
    def num_accepted_drafts(self) -> int:
        return self.nodes.numel() - 1

    def committed_tokens(self, tree: DraftTree) -> torch.Tensor:
        """Tokens this round appends after the root: accepted drafts, then the bonus."""
        return torch.cat([tree.tokens[self.nodes[1:]], torch.tensor([self.bonus_token])])


def accept_greedy(tree: DraftTree, target_argmax: TargetArgmax) -> Acceptance:
    """Greedy walk. target_argmax: LongTensor[n] (argmax of the target at every node) or a
    callable node -> argmax token, so the engine may compute the LM head only on visited rows."""
    argmax_at: Callable[[int], int]
    if isinstance(target_argmax, torch.Tensor):
        if target_argmax.shape != (tree.num_nodes,):
            raise ValueError(f"target_argmax must have shape ({tree.num_nodes},) = one token per node, "
                             f"got {tuple(target_argmax.shape)}")
        table = target_argmax.tolist()  # one conversion instead of an .item() per step
        argmax_at = table.__getitem__
    elif callable(target_argmax):
        argmax_at = target_argmax
    else:
        raise TypeError("target_argmax must be a LongTensor[n] or a callable node -> token")
    return _walk(tree, lambda node: int(argmax_at(node)))


def _walk(tree: DraftTree, token_at: Callable[[int], int]) -> Acceptance:
    """From the root, follow the child carrying the target's token at each node; the first token no child
    carries is the bonus. Both walks (greedy and sampled) differ only in how that token is chosen."""
    path, cur = [0], 0
    while True:
        tok = token_at(cur)
        child = tree.child_maps[cur].get(tok)
        if child is None:
            return Acceptance(torch.tensor(path, dtype=torch.long), tok)
        path.append(child)
        cur = child


def accept_greedy_reference(tree: DraftTree, target_argmax: torch.Tensor) -> Acceptance:
    """Definition-based reference: a node is accepted iff every node on its path carries the
    target's argmax at its parent; the deepest accepted node (unique, since siblings have
    distinct tokens) ends the path."""
    argmax = target_argmax.tolist()
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    accepted = [True] + [False] * (tree.num_nodes - 1)
    for i in range(1, tree.num_nodes):  # parents precede children
        accepted[i] = accepted[parents[i]] and tokens[i] == argmax[parents[i]]
    depths = tree.depths.tolist()
    last = max((i for i in range(tree.num_nodes) if accepted[i]), key=lambda i: depths[i])
    return Acceptance(tree.path(last), argmax[last])


def accept_sampling(tree: DraftTree, target_probs: TargetProbs, generator: torch.Generator | None) -> Acceptance:
    """Sample-and-match walk. target_probs: FloatTensor[n, V] or a callable node -> probs[V],
    already processed by `sampling.sampling_probs` (temperature, top-k, top-p). Only visited nodes
    are queried, at most depth+1 of them."""
    probs_at: Callable[[int], torch.Tensor]
    if isinstance(target_probs, torch.Tensor):
        if target_probs.dim() != 2 or target_probs.shape[0] != tree.num_nodes:
            raise ValueError(f"target_probs must have shape [{tree.num_nodes}, V] (one row per node), "
                             f"got {tuple(target_probs.shape)}")
        probs_at = target_probs.__getitem__
    elif callable(target_probs):
        probs_at = target_probs
    else:
        raise TypeError("target_probs must be a FloatTensor[n, V] or a callable node -> probs[V]")

    def sampled_at(node: int) -> int:
        probs = probs_at(node)
        if probs.dim() != 1:
            raise ValueError(f"probabilities for node {node} must be 1-D [V], got shape {tuple(probs.shape)}")
        return int(sample_from(probs, generator))

    return _walk(tree, sampled_at)
