"""Where a best-first node stream is cut: a fixed budget (DDTree) or CaDDTree's greedy stop.

Every draft-tree source (tree.best_first_nodes, lookup.merge, weaver.tree) yields nodes in best-first
order (path log-prob non-increasing) from the one search in best_first.py; proposers, replay and benches decide how many to keep here, so
the stop rule has one implementation and one test suite (tests/test_policies.py, test_costmodel.py).
"""
from __future__ import annotations

import math
from itertools import islice
from typing import Generic, Iterable, NamedTuple, Protocol, Sequence, TypeVar

import numpy as np
import torch

from .costmodel import VerifyCostModel
from .tree import DraftTree, TreeNode, best_first_nodes


class PathNode(Protocol):
    """What the stop rule reads of a node: tree.TreeNode, or a node of another best-first stream (lookup.merge)."""

    @property
    def path_logprob(self) -> float: ...


N = TypeVar("N", bound=PathNode)


def fixed_budget_cut(node_stream: Iterable[N], budget: int) -> list[N]:
    """DDTree's cut: the first `budget` nodes of the stream (fewer if it runs out)."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be an int >= 0, got {budget!r}")
    return list(islice(node_stream, budget))


def build_best_first_tree(root_token: int, marginal_logprobs, budget: int,
                          token_ids: torch.Tensor | None = None) -> DraftTree:
    """DDTree: the `budget` highest-weight prefixes (draft nodes, root excluded) as a DraftTree."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be an int >= 1 (draft nodes, root excluded), got {budget!r}")
    nodes = fixed_budget_cut(best_first_nodes(marginal_logprobs, budget, token_ids), budget)
    return DraftTree.from_nodes(root_token, nodes)


class CaddSelection(NamedTuple, Generic[N]):
    nodes: list[N]  # chosen draft nodes in best-first (topological) order
    expected_tokens: float  # 1 + Φ: bonus plus summed path probabilities
    round_ms: float  # C_d + C_v(len(nodes) + 1 tokens)

    @property
    def throughput(self) -> float:
        """Expected tokens per ms under the model."""
        return self.expected_tokens / self.round_ms


def caddtree_select(node_stream: Iterable[N], cost_model: VerifyCostModel, context_len: int,
                    max_nodes: int, overhead_ms: float = 0.0, accept_scale: float = 1.0,
                    node_ms: float = 0.0) -> CaddSelection[N]:
    """Add nodes in best-first order while modelled throughput (1 + Φ) / (C_d + C_v) improves.

    Node n+1 with path probability p joins iff (1 + Φ + p)/C(n+1) > (1 + Φ)/C(n), i.e.
    p > θ(n)·(C_v(n+1) − C_v(n)); the first node that fails ends the search (θ is unimodal in n
    when C_v is convex and p non-increasing). Zero nodes is a valid answer (verify the root only).
    `overhead_ms` adds a per-round cost the profile does not see; `accept_scale` multiplies every path
    probability (capped at 1): both come from online recalibration (see proposers.CostAwarePolicy).
    `node_ms` adds a cost per draft node that building the tree itself pays (Weaver's expansion calls,
    amortised over its width: drafttree.weaver); linear in n, so the round cost stays convex.
    """
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 0:
        raise ValueError(f"max_nodes must be an int >= 0, got {max_nodes!r}")
    curve = cost_model.verify_curve(context_len)
    draft = cost_model.draft_cost_ms(context_len)
    draft += overhead_ms
    cost = draft + curve(1)  # zero draft nodes: the root alone
    if cost <= 0:
        raise ValueError("the modelled round cost must be > 0")
    gain = 1.0  # 1 + Φ
    chosen: list[N] = []
    for node in islice(node_stream, max_nodes):
        p = min(1.0, accept_scale * math.exp(node.path_logprob))
        next_cost = draft + curve(len(chosen) + 2) + node_ms * (len(chosen) + 1)  # len(chosen)+1 nodes -> +1 root token
        if (gain + p) * cost <= gain * next_cost:  # cross-multiplied ratio test, no division
            break
        chosen.append(node)
        gain += p
        cost = next_cost
    return CaddSelection(chosen, gain, cost)


def caddtree_select_reference(path_probs: Sequence[float], cost_model: VerifyCostModel,
                              context_len: int, max_nodes: int, overhead_ms: float = 0.0, accept_scale: float = 1.0,
                              node_ms: float = 0.0) -> int:
    """Brute force: the n in 0..max_nodes maximising (1 + Σ_{i<n} p_i) / (C_d + C_v(n)), first max."""
    probs = np.minimum(1.0, accept_scale * np.asarray(list(path_probs)[:max_nodes], dtype=float))
    phi = np.concatenate([[0.0], np.cumsum(probs)])
    cost = np.array([cost_model.round_ms(n, context_len) + overhead_ms + node_ms * n for n in range(len(probs) + 1)])
    return int(np.argmax((1 + phi) / cost))


def build_caddtree(root_token: int, marginal_logprobs, cost_model: VerifyCostModel, context_len: int,
                   max_nodes: int = 1024, overhead_ms: float = 0.0, accept_scale: float = 1.0,
                   token_ids: torch.Tensor | None = None) -> tuple[DraftTree, CaddSelection[TreeNode]]:
    """Convenience: best-first stream -> CaDDTree selection -> DraftTree (root-only if nothing pays).
    token_ids: the target id of each marginal column (a reduced draft vocabulary), or None."""
    nodes = iter(()) if max_nodes == 0 else best_first_nodes(marginal_logprobs, max_nodes, token_ids)
    sel = caddtree_select(nodes, cost_model, context_len, max_nodes, overhead_ms, accept_scale)
    return DraftTree.from_nodes(root_token, sel.nodes), sel
