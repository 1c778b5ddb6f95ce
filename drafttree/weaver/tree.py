"""Best-first draft trees over Weaver's path probabilities, expanded w nodes per Weaver call.

A node's children are scored by Weaver conditioned on the node's path, so a child's probability is
known only once its parent has been expanded (one Weaver row). The heap holds candidates
(parent, rank r in the parent's sorted child distribution) keyed by path log-prob:
  - popping a candidate emits the node and pushes its next sibling at once (the parent's
    distribution is already known);
  - its first child needs the node's own expansion: with width w, up to w nodes are popped per step
    and expanded together in one batched Weaver call at the end of the step, then their first
    children join the heap. w = 1 is exact best-first under Weaver's path probabilities; larger w
    trades a little order for ⌈n/w⌉ calls instead of n.
Each expansion runs only the new nodes through Weaver: their ancestors' keys/values are cached per
tree (PathCache), so a call costs w rows, not w paths. drafttree.weaver.naive is the reference.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ..tree import TreeNode
from .model import Weaver, drafter_candidates


@dataclass
class RoundInputs:
    """What one round's Weaver calls read; row d belongs to nodes at depth d (their children's depth d+1)."""

    cand_ids: torch.Tensor  # [D, K] target token ids: the drafter's top-K at depth d+1
    cand_logprobs: torch.Tensor  # [D, K] their log-marginals, descending
    log_rest: torch.Tensor  # [D] log of the drafter's mass outside them
    cand_embeds: torch.Tensor  # [D, K, E] their rows of the target's embedding
    hidden: torch.Tensor  # [D, Hd] the drafter's hidden state predicting depth d+1
    embed: Callable[[torch.Tensor], torch.Tensor]  # token ids -> [n, E] (the target's embedding)
    hidden_terms: torch.Tensor | None = None  # [D, W] Weaver's depth-only input terms, filled by the first call

    @property
    def depth(self) -> int:
        return self.cand_ids.shape[0]


def round_inputs(weaver: Weaver, logits: torch.Tensor, hidden: torch.Tensor, embed,
                 token_ids: torch.Tensor | None = None) -> RoundInputs:
    """From the drafter's logits [D, Vd] (depths 1..D) and hidden states [D, Hd] (block rows 1..D); with a
    reduced draft vocabulary, token_ids [Vd] maps columns to target ids (candidates are always target ids)."""
    if logits.shape[0] != hidden.shape[0]:
        raise ValueError(f"drafter logits have {logits.shape[0]} depths but hidden states {hidden.shape[0]}")
    if logits.shape[0] > weaver.config.max_depth:
        raise ValueError(f"{logits.shape[0]} drafted depths, but the Weaver was built for at most {weaver.config.max_depth}")
    k = min(weaver.config.num_candidates, logits.shape[1])
    ids, lp, log_rest = drafter_candidates(logits.float().log_softmax(-1), k)
    if token_ids is not None:
        ids = token_ids[ids]
    embeds = embed(ids.reshape(-1)).reshape(*ids.shape, -1)
    return RoundInputs(ids, lp, log_rest, embeds, hidden, embed)


class PathCache:
    """Per-layer keys/values of every expanded node of one tree, indexed by tree node (0 = root)."""

    def __init__(self, weaver: Weaver, capacity: int):
        cfg = weaver.config
        shape = (cfg.num_layers, capacity, cfg.num_heads, cfg.hidden_size // cfg.num_heads)
        dtype = weaver.token_proj.weight.dtype
        self.k, self.v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        self.ancestors: dict[int, list[int]] = {}  # node -> root-first path (ancestors and itself)


def expand(weaver: Weaver, inputs: RoundInputs, cache: PathCache, nodes: list[int], parents: list[int],
           tokens: list[int], depths: list[int]) -> tuple[list[list[float]], list[list[int]]]:
    """One batched Weaver call for `nodes` (tree indices; their parents already expanded, -1 for the root).
    Returns per node its children's log-probs (descending) and their token ids."""
    for u, p in zip(nodes, parents):
        cache.ancestors[u] = ([] if p < 0 else cache.ancestors[p]) + [u]
    paths = [cache.ancestors[u] for u in nodes]
    longest = max(len(a) for a in paths)
    index = torch.tensor([a + [0] * (longest - len(a)) for a in paths])  # padding points at the root, masked
    visible = (torch.arange(longest)[None, :] < torch.tensor([len(a) for a in paths])[:, None])[:, None, None, :]
    rows, d = torch.tensor(nodes), torch.tensor(depths)
    if inputs.hidden_terms is None:  # the depth-only input terms, once per round
        inputs.hidden_terms = weaver.hidden_table(inputs.hidden, torch.arange(inputs.depth))
    h = weaver.token_proj(inputs.embed(torch.tensor(tokens)).to(weaver.token_proj.weight.dtype)) + inputs.hidden_terms[d]
    for i, layer in enumerate(weaver.layers):
        q, k, v = layer.project(h)  # [n, heads, head_dim]
        cache.k[i, rows], cache.v[i, rows] = k, v
        keys, values = cache.k[i, index].transpose(1, 2), cache.v[i, index].transpose(1, 2)  # [n, heads, L, hd]
        # one query per row against at most max_depth keys: plain matmuls beat SDPA's setup at this size
        scores = (q[:, :, None] @ keys.transpose(-1, -2)).mul_(layer.head_dim ** -0.5).masked_fill_(~visible, -math.inf)
        h = layer.finish(h, (scores.softmax(-1) @ values)[:, :, 0])
    s = weaver.norm(h)
    logp = weaver.candidate_logprobs(s, inputs.cand_logprobs[d], inputs.log_rest[d], inputs.cand_embeds[d])[:, :-1]  # "other" is no token
    values, order = logp.sort(dim=-1, descending=True, stable=True)  # stable: an untrained Weaver keeps the drafter's order
    return values.tolist(), inputs.cand_ids[d].gather(1, order).tolist()


class WeaverStream:
    """Draft nodes in best-first order of Weaver path log-probs, lazily (a consumer that stops early, as
    CaDDTree's greedy stop does, pays no further Weaver calls). `calls` counts Weaver calls so far."""

    def __init__(self, weaver: Weaver, inputs: RoundInputs, root_token: int, max_nodes: int, width: int = 8):
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be an int >= 1, got {width!r}")
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 0:
            raise ValueError(f"max_nodes must be an int >= 0, got {max_nodes!r}")
        self.weaver, self.inputs, self.root, self.max_nodes, self.width = weaver, inputs, int(root_token), max_nodes, width
        self.calls = 0

    def __iter__(self) -> Iterator[TreeNode]:
        if self.max_nodes == 0:
            return
        inputs, D = self.inputs, self.inputs.depth
        cache = PathCache(self.weaver, self.max_nodes + 1)
        tokens, depths, weights, ranks = [self.root], [0], [0.0], [()]
        child_lp: dict[int, list[float]] = {}
        child_ids: dict[int, list[int]] = {}

        def expand_nodes(nodes: list[int], parents: list[int]) -> None:
            lps, ids = expand(self.weaver, inputs, cache, nodes, parents, [tokens[u] for u in nodes],
                              [depths[u] for u in nodes])
            self.calls += 1
            for u, lp, i in zip(nodes, lps, ids):
                child_lp[u], child_ids[u] = lp, i
                heapq.heappush(heap, (-(weights[u] + lp[0]), ranks[u] + (0,), u, 0))

        heap: list = []
        expand_nodes([0], [-1])
        parent_of = [-1]
        emitted = 0
        while heap and emitted < self.max_nodes:
            new: list[int] = []
            while heap and emitted < self.max_nodes and len(new) < self.width:
                neg_w, path_ranks, parent, r = heapq.heappop(heap)
                w = -neg_w
                if w == -math.inf:  # only impossible prefixes remain
                    heap.clear()
                    break
                emitted += 1
                node = emitted
                lp = child_lp[parent]
                tokens.append(child_ids[parent][r])
                depths.append(depths[parent] + 1)
                weights.append(w)
                ranks.append(path_ranks)
                parent_of.append(parent)
                yield TreeNode(parent, tokens[node], depths[node], lp[r], w)
                if r + 1 < len(lp):  # next sibling: its probability is already known
                    heapq.heappush(heap, (-(weights[parent] + lp[r + 1]), path_ranks[:-1] + (r + 1,), parent, r + 1))
                if depths[node] < D:
                    new.append(node)
            if new and emitted < self.max_nodes:  # first children wait for this step's batched call
                expand_nodes(new, [parent_of[u] for u in new])
