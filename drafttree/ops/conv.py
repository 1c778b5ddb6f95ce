"""Causal depthwise conv1d (kernel K) over a chain and over a tree, with a committed context.

Layout: tokens on rows. x [T, C] are the pre-conv inputs, weight [C, K] (W[:, K-1] multiplies the
current token), context [K-1, C] holds the K-1 most recent committed inputs, newest last (HF keeps
K columns in `conv_states`; only the last K-1 ever reach an output).

In a tree, node i's window is its last K-1 ancestors plus itself, not the previous rows in node
order; when the path is shorter than the window the rest comes from the context. That is a gather
over E = [context; x] with an index built once per tree and shared by every layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x, weight, context, activation: bool = True):
    """Chain form (reference and prefill path). Returns (y [T, C], extended inputs E [(K-1)+T, C]).

    The context after committing the first A rows is E[A : A + K - 1].
    """
    C, K = weight.shape
    E = torch.cat([context.to(x.dtype), x], dim=0)                      # [(K-1)+T, C]
    y = F.conv1d(E.t().unsqueeze(0), weight.unsqueeze(1).to(x.dtype), groups=C)[0].t()
    return (F.silu(y) if activation else y), E


def tree_conv_index(parents, K: int) -> torch.Tensor:
    """idx [n, K] into E = [context (K-1 rows); x (n rows)]: idx[i, m] is the row for window slot m
    (slot K-1 = the node itself, slot K-1-s = its s-th ancestor, or a context row past the root)."""
    parents = torch.as_tensor(parents, dtype=torch.long).cpu()
    n = parents.numel()
    idx = torch.empty(n, K, dtype=torch.long)
    for i in range(n):
        node, ctx_row = i, K - 1            # ctx_row: next context row to use once we pass the root
        for m in range(K - 1, -1, -1):
            if node >= 0:
                idx[i, m] = (K - 1) + node
                node = int(parents[node])
            else:
                ctx_row -= 1
                idx[i, m] = ctx_row
    return idx


def chain_conv_index(n: int, K: int) -> torch.Tensor:
    """tree_conv_index of a chain of n nodes (parents i - 1), in closed form: slot m of node i is row i + m."""
    return torch.arange(n)[:, None] + torch.arange(K)[None, :]


def tree_causal_conv1d(x, weight, context, idx, activation: bool = True):
    """Tree form. Returns (y [n, C], E [(K-1)+n, C]). The context after accepting node l is E[idx[l, 1:]]."""
    E = torch.cat([context.to(x.dtype), x], dim=0)
    windows = E[idx.to(x.device)]                                        # [n, K, C]
    y = torch.einsum("nkc,ck->nc", windows, weight.to(x.dtype))
    return (F.silu(y) if activation else y), E
