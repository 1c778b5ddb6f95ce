"""Reference for drafttree.weaver.tree: exact best-first (w = 1), each node's children scored by running
Weaver over the node's whole path from scratch (no cache, no batching). Slow and obviously right."""
from __future__ import annotations

import heapq
import math

import torch

from ..tree import TreeNode
from .model import Weaver
from .tree import RoundInputs


def child_distribution(weaver: Weaver, inputs: RoundInputs, path_tokens: list[int]) -> tuple[list[float], list[int]]:
    """Log-probs (descending) and token ids of the children of the node whose root-first path is path_tokens."""
    depths = torch.arange(len(path_tokens))
    x = weaver.node_inputs(inputs.embed(torch.tensor(path_tokens)), inputs.hidden[depths], depths)
    s = weaver.forward_paths(x[None])[0, -1]
    d = len(path_tokens) - 1
    logp = weaver.candidate_logprobs(s, inputs.cand_logprobs[d], inputs.log_rest[d], inputs.cand_embeds[d])[:-1]  # "other" is no token
    if d < weaver.config.first_scored_depth:  # the drafter's own marginals there
        logp = inputs.cand_logprobs[d]
    values, order = logp.sort(dim=-1, descending=True, stable=True)
    return values.tolist(), inputs.cand_ids[d][order].tolist()


def weaver_nodes_reference(weaver: Weaver, inputs: RoundInputs, root_token: int, max_nodes: int) -> list[TreeNode]:
    paths = [[int(root_token)]]  # per tree node: its root-first tokens
    weights, ranks = [0.0], [()]
    dists = {0: child_distribution(weaver, inputs, paths[0])}
    heap = [(-dists[0][0][0], (0,), 0, 0)]
    nodes: list[TreeNode] = []
    while heap and len(nodes) < max_nodes:
        neg_w, path_ranks, parent, r = heapq.heappop(heap)
        if -neg_w == -math.inf:
            break
        lp, ids = dists[parent]
        node = len(nodes) + 1
        paths.append(paths[parent] + [ids[r]])
        weights.append(-neg_w)
        ranks.append(path_ranks)
        nodes.append(TreeNode(parent, ids[r], len(paths[node]) - 1, lp[r], -neg_w))
        if r + 1 < len(lp):
            heapq.heappush(heap, (-(weights[parent] + lp[r + 1]), path_ranks[:-1] + (r + 1,), parent, r + 1))
        if len(paths[node]) - 1 < inputs.depth and len(nodes) < max_nodes:
            dists[node] = child_distribution(weaver, inputs, paths[node])
            clp = dists[node][0]
            heapq.heappush(heap, (-(weights[node] + clp[0]), path_ranks + (0,), node, 0))
    return nodes
