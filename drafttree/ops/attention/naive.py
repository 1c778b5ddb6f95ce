"""Reference for the row-by-row tree attention kernel: plain softmax attention over the visible keys."""
from __future__ import annotations

import torch


def visible_keys(past: int, t: int, visible: torch.Tensor | None) -> torch.Tensor:
    """Bool [T, past+T]: every cached key, and among the new ones the mask's (causal when None)."""
    tree = torch.ones(t, t, dtype=torch.bool).tril_() if visible is None else visible
    return torch.cat([torch.ones(t, past, dtype=torch.bool), tree], dim=1)


def tree_attention_ref(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: int,
                       visible: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [Hkv, G*T, d] (row g*T + t), keys/values [Hkv, >= past+T, d] -> [Hkv, G*T, d]."""
    rows = q.shape[1]
    t = visible.shape[0] if visible is not None else keys.shape[1] - past
    seen = visible_keys(past, t, visible).repeat(rows // t, 1)  # [G*T, past+T]
    scores = torch.matmul(q, keys[:, : past + t].transpose(1, 2)) * scale
    probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.matmul(probs, values[:, : past + t])
