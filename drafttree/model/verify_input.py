"""The one record a verify call passes from the engine to the target model."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VerifyInput:
    """A draft tree placed after `start` committed tokens, as the target's forward consumes it."""

    tokens: torch.Tensor  # [n] long: tokens[0] is the root (the last emitted token, not yet cached)
    positions: torch.Tensor  # [n] long: start + depth
    parents: torch.Tensor  # [n] long: parents[0] = -1, parents[i] < i (hybrid GDN layers walk them)
    mask: torch.Tensor  # [n, n] bool: node i sees node j iff j is i or an ancestor of i
    logits_rows: torch.Tensor | None = None  # [r] long: rows whose logits the walk may read; None: all n

    @classmethod
    def of_tree(cls, tree, start: int, logits_rows: torch.Tensor | None = None) -> "VerifyInput":
        return cls(tree.tokens, tree.positions(start), tree.parents, tree.ancestor_mask, logits_rows)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]
