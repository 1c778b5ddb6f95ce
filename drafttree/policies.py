"""Where a best-first node stream is cut: a fixed budget (DDTree) or CaDDTree's greedy stop, alone or for the
requests of one batched turn together (caddtree_select_batch).

Every draft-tree source (tree.best_first_nodes, lookup.merge, weaver.tree) yields nodes in best-first
order (path log-prob non-increasing) from the one search in best_first.py; proposers, replay and benches decide how many to keep here, so
the stop rule has one implementation and one test suite (tests/test_policies.py, test_costmodel.py).
"""
from __future__ import annotations

import heapq
import math
from itertools import islice
from typing import Callable, Generic, Iterable, NamedTuple, Protocol, Sequence, TypeVar

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


class BatchSelection(NamedTuple, Generic[N]):
    nodes: list[list[N]]  # per request: its chosen draft nodes, best first
    expected_tokens: float  # the turn's: its base tokens plus every chosen node's (scaled) path probability
    turn_ms: float  # fixed_ms + C_v(base rows + chosen nodes)


def caddtree_select_batch(node_streams: Sequence[Iterable[N]], verify_curve: Callable[[float], float],
                          fixed_ms: float, base_rows: int, base_tokens: float, max_nodes: Sequence[int],
                          accept_scales: Sequence[float]) -> BatchSelection[N]:
    """CaDDTree for a batched turn: the requests' trees sized together to maximise the turn's tokens per ms,
    Σᵢ(1 + Φᵢ) / (C_fixed + C_v(rows)), where every request's rows share one verify forward.

    A node costs the same whichever request it joins (one more row of the forward), so the greedy step takes the
    most probable next node of any request — a merge of the best-first streams — and stops at the first that fails
    caddtree_select's ratio test; the merged stream is non-increasing and C_v convex, so that first failure is the
    optimum (caddtree_select_batch_reference). The turn's rate is about the batch size times one request's, so a
    node must be that much likelier to pay than alone: only confident drafts make a busy turn longer.
    `base_rows` / `base_tokens`: the forward's rows and the tokens the turn emits without any draft node (a root and
    its bonus token per request); `accept_scales[i]` multiplies request i's path probabilities (capped at 1)."""
    if not (len(node_streams) == len(max_nodes) == len(accept_scales)):
        raise ValueError("need one max_nodes and one accept_scale per node stream")
    if any(isinstance(m, bool) or not isinstance(m, int) or m < 0 for m in max_nodes):
        raise ValueError(f"max_nodes must be ints >= 0, got {list(max_nodes)!r}")
    if base_rows < 1 or base_tokens <= 0:
        raise ValueError(f"a turn has >= 1 row and > 0 tokens, got {base_rows} rows and {base_tokens} tokens")
    streams = [iter(islice(s, m)) for s, m in zip(node_streams, max_nodes)]
    heads: list[tuple[float, int, N]] = []  # (-p, request, node): ties go to the lower request index

    def push(i: int) -> None:
        node = next(streams[i], None)
        if node is not None:
            heapq.heappush(heads, (-min(1.0, accept_scales[i] * math.exp(node.path_logprob)), i, node))

    for i in range(len(streams)):
        push(i)
    chosen: list[list[N]] = [[] for _ in streams]
    gain, rows = float(base_tokens), base_rows
    cost = fixed_ms + verify_curve(rows)
    if cost <= 0:
        raise ValueError("the modelled turn cost must be > 0")
    while heads:
        p, i = -heads[0][0], heads[0][1]
        next_cost = fixed_ms + verify_curve(rows + 1)
        if (gain + p) * cost <= gain * next_cost:
            break
        chosen[i].append(heapq.heappop(heads)[2])
        gain, rows, cost = gain + p, rows + 1, next_cost
        push(i)
    return BatchSelection(chosen, gain, cost)


def caddtree_select_batch_reference(path_probs: Sequence[Sequence[float]], verify_curve: Callable[[float], float],
                                    fixed_ms: float, base_rows: int, base_tokens: float, max_nodes: Sequence[int],
                                    accept_scales: Sequence[float]) -> list[int]:
    """Brute force: nodes per request, from the n maximising (base + Σ top-n) / (fixed + C_v(base_rows + n)) over
    all requests' (scaled, capped) probabilities sorted together (ties: lower request first), first max."""
    merged = sorted((-min(1.0, s * p), i, k)
                    for i, (probs, m, s) in enumerate(zip(path_probs, max_nodes, accept_scales))
                    for k, p in enumerate(list(probs)[:m]))
    phi = np.concatenate([[0.0], np.cumsum([-q for q, _, _ in merged])])
    cost = np.array([fixed_ms + verify_curve(base_rows + n) for n in range(len(merged) + 1)])
    n = int(np.argmax((base_tokens + phi) / cost))
    counts = [0] * len(path_probs)
    for _, i, _ in merged[:n]:
        counts[i] += 1
    return counts


def build_caddtree(root_token: int, marginal_logprobs, cost_model: VerifyCostModel, context_len: int,
                   max_nodes: int = 1024, overhead_ms: float = 0.0, accept_scale: float = 1.0,
                   token_ids: torch.Tensor | None = None) -> tuple[DraftTree, CaddSelection[TreeNode]]:
    """Convenience: best-first stream -> CaDDTree selection -> DraftTree (root-only if nothing pays).
    token_ids: the target id of each marginal column (a reduced draft vocabulary), or None."""
    nodes = iter(()) if max_nodes == 0 else best_first_nodes(marginal_logprobs, max_nodes, token_ids)
    sel = caddtree_select(nodes, cost_model, context_len, max_nodes, overhead_ms, accept_scale)
    return DraftTree.from_nodes(root_token, sel.nodes), sel
