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

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, cast

import torch

from ..best_first import Frontier
from ..tree import TreeNode
from .model import Weaver, WeaverLayer, drafter_candidates


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
    """Per-layer keys/values of every expanded node of one tree, indexed by tree node (0 = root) or, for the
    look-ahead stream, by slot (nodes scored before they are emitted get slots too)."""

    def __init__(self, weaver: Weaver, capacity: int):
        cfg = weaver.config
        shape = (cfg.num_layers, capacity, cfg.num_heads, cfg.hidden_size // cfg.num_heads)
        dtype = weaver.token_proj.weight.dtype
        self.k, self.v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        self.ancestors: dict[int, list[int]] = {}  # node -> root-first path (ancestors and itself)

    def ensure(self, rows: int) -> None:
        if rows > self.k.shape[1]:
            grow = lambda t: torch.cat([t, torch.zeros_like(t)[:, : max(rows - t.shape[1], t.shape[1])]], 1)
            self.k, self.v = grow(self.k), grow(self.v)


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
    for i, layer in enumerate(cast(Iterable[WeaverLayer], weaver.layers)):  # torch types a ModuleList's items as Module
        q, k, v = layer.project(h)  # [n, heads, head_dim]
        cache.k[i, rows], cache.v[i, rows] = k, v
        keys, values = cache.k[i, index].transpose(1, 2), cache.v[i, index].transpose(1, 2)  # [n, heads, L, hd]
        # one query per row against at most max_depth keys: plain matmuls beat SDPA's setup at this size
        scores = (q[:, :, None] @ keys.transpose(-1, -2)).mul_(layer.head_dim ** -0.5).masked_fill_(~visible, -math.inf)
        h = layer.finish(h, (scores.softmax(-1) @ values)[:, :, 0])
    s = weaver.norm(h)
    logp = weaver.candidate_logprobs(s, inputs.cand_logprobs[d], inputs.log_rest[d], inputs.cand_embeds[d])[:, :-1]  # "other" is no token
    shallow = d < weaver.config.first_scored_depth
    if shallow.any():
        logp = torch.where(shallow[:, None], inputs.cand_logprobs[d], logp)
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
        tokens, depths, weights, parent_of = [self.root], [0], [0.0], [-1]
        ranks: list[tuple[int, ...]] = [()]
        frontier: Frontier[ScoredChildren] = Frontier()

        def expand_nodes(nodes: list[int]) -> None:
            lps, ids = expand(self.weaver, inputs, cache, nodes, [parent_of[u] for u in nodes], [tokens[u] for u in nodes],
                              [depths[u] for u in nodes])
            self.calls += 1
            for u, lp, i in zip(nodes, lps, ids):
                frontier.add(ScoredChildren(u, weights[u], lp, i), ranks[u])

        expand_nodes([0])
        emitted = 0
        while frontier and emitted < self.max_nodes:
            new: list[int] = []
            while emitted < self.max_nodes and len(new) < self.width and (popped := frontier.pop()) is not None:
                children, r, w, path_ranks = popped
                emitted += 1
                node, parent = emitted, children.node
                tokens.append(children.ids[r])
                depths.append(depths[parent] + 1)
                weights.append(w)
                ranks.append(path_ranks)
                parent_of.append(parent)
                yield TreeNode(parent, tokens[node], depths[node], children.logprobs[r], w)
                if depths[node] < D:
                    new.append(node)
            if new and emitted < self.max_nodes:  # first children wait for this step's batched call
                expand_nodes(new)


class ScoredChildren:
    """A node's children as one Weaver call scored them: log-probs descending, their ids."""

    __slots__ = ("node", "path_logprob", "logprobs", "ids")

    def __init__(self, node: int, path_logprob: float, logprobs: list[float], ids: list[int]):
        self.node, self.path_logprob, self.logprobs, self.ids = node, path_logprob, logprobs, ids

    def child_logprob(self, r: int) -> float:
        return self.path_logprob + self.logprobs[r] if r < len(self.logprobs) else -math.inf


class LookaheadWeaverStream(WeaverStream):
    """Exact best-first order under Weaver's path probabilities (the w = 1 stream's nodes, in its order), with
    up to `width` rows per Weaver call. Popping the w best entries at once (WeaverStream) places nodes before
    the first children still waiting for the call, which at small budgets turns the tree into a fan of
    depth-1 siblings; here a call is made only when the node just emitted needs its children scored, and it
    also scores the nodes most likely to need it next: the best heap entries and the node's likely line of
    descent under the drafter's marginals (each row attends to rows of the same call that are its
    ancestors). A node emitted later finds its children already scored and costs no call."""

    def __iter__(self) -> Iterator[TreeNode]:
        if self.max_nodes == 0:
            return
        inputs, D, extra = self.inputs, self.inputs.depth, self.width - 1
        cache = PathCache(self.weaver, 2 * self.max_nodes + self.width + 1)
        s_tok, s_depth, s_parent = [], [], []  # per slot
        dist: dict[int, tuple[list[float], list[int]]] = {}  # slot -> its children's log-probs and ids
        spec: dict[tuple[int, int], int] = {}  # (parent slot, token) -> slot: scored before being emitted
        top_lp, top_id = inputs.cand_logprobs[:, 0].tolist(), inputs.cand_ids[:, 0].tolist()
        node_slot = [0]  # tree node -> slot
        frontier: Frontier[ScoredChildren] = Frontier()

        def new_slot(parent: int, token: int, depth: int) -> int:
            s_tok.append(token)
            s_depth.append(depth)
            s_parent.append(parent)
            return len(s_tok) - 1

        def score(slot: int, weight: float) -> None:
            """One call: `slot` (emitted, unscored) and up to width-1 nodes likely to be needed next."""
            picks: list[tuple[float, int, int, int, bool]] = []  # (priority, parent slot (-1: on the chain), token, depth, chain)
            if extra:
                for children, r, w, _ in frontier.best(extra):
                    ps = node_slot[children.node]
                    tok, d = children.ids[r], s_depth[ps] + 1
                    if d < D and (ps, tok) not in spec:
                        picks.append((w, ps, tok, d, False))
                pw, d = weight, s_depth[slot]
                while d + 1 < D and len(picks) < 2 * extra:  # the drafter's best line below the node
                    pw += top_lp[d]
                    picks.append((pw, -1, top_id[d], d + 1, True))
                    d += 1
                picks.sort(key=lambda x: -x[0])
            rows, parent = [slot], slot
            chain = [x for x in picks[:extra] if x[4]]
            for _, ps, tok, d, is_chain in picks[:extra]:
                if not is_chain:
                    rows.append(new_slot(ps, tok, d))
            for _, _, tok, d, _ in sorted(chain, key=lambda x: x[3]):  # parents first (a chain pick implies its prefix)
                parent = new_slot(parent, tok, d)
                rows.append(parent)
            cache.ensure(len(s_tok))
            lps, ids = expand(self.weaver, inputs, cache, rows, [s_parent[x] for x in rows], [s_tok[x] for x in rows],
                              [s_depth[x] for x in rows])
            self.calls += 1
            for x, lp, i in zip(rows, lps, ids):
                dist[x] = (lp, i)
                if x != slot:
                    spec[(s_parent[x], s_tok[x])] = x

        root = new_slot(-1, self.root, 0)
        score(root, 0.0)
        frontier.add(ScoredChildren(0, 0.0, *dist[root]))
        emitted = 0
        while emitted < self.max_nodes and (popped := frontier.pop()) is not None:
            children, r, w, path_ranks = popped
            p_node = children.node
            ps = node_slot[p_node]
            tok, d = children.ids[r], s_depth[ps] + 1
            emitted += 1
            node = emitted
            slot = spec.pop((ps, tok), None)
            if slot is None:
                slot = new_slot(ps, tok, d)
            node_slot.append(slot)
            yield TreeNode(p_node, tok, d, children.logprobs[r], w)
            if d < D and emitted < self.max_nodes:
                if slot not in dist:
                    score(slot, w)
                frontier.add(ScoredChildren(node, w, *dist[slot]), path_ranks)
