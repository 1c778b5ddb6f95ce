"""Random trees and GDN inputs for the tests and the benchmark."""
from __future__ import annotations

import torch


def make_parents(shape: str, n: int, gen: torch.Generator) -> torch.Tensor:
    """Parents in topological order for a named tree shape."""
    parents = torch.full((n,), -1, dtype=torch.long)
    for i in range(1, n):
        if shape == "chain":
            p = i - 1
        elif shape == "star":
            p = 0
        elif shape == "deep":  # a long spine with short side branches
            p = i - 1 if i % 5 else max(0, i - 3)
        elif shape == "random":  # uniform over all previous nodes
            p = int(torch.randint(0, i, (1,), generator=gen))
        elif shape == "local":  # parent among the previous 8 nodes (DDTree-like widths)
            p = int(torch.randint(max(0, i - 8), i, (1,), generator=gen))
        else:
            raise ValueError(f"unknown tree shape {shape!r}")
        parents[i] = p
    return parents


def make_gdn_inputs(Hk, Hv, n, dk, dv, gen, dtype=torch.float64, g_min=-8.0):
    """Prepared (normalised) q̂, k̂ plus v, g, β and a random S0."""
    from drafttree.ops.gdn.naive import prepare_qk

    q = torch.randn(Hk, n, dk, generator=gen, dtype=dtype)
    k = torch.randn(Hk, n, dk, generator=gen, dtype=dtype)
    q, k = prepare_qk(q, k, dtype)
    v = torch.randn(Hv, n, dv, generator=gen, dtype=dtype)
    g = torch.rand(Hv, n, generator=gen, dtype=dtype) * g_min  # in [g_min, 0]
    beta = torch.rand(Hv, n, generator=gen, dtype=dtype)
    S0 = torch.randn(Hv, dk, dv, generator=gen, dtype=dtype) * 0.5
    return q, k, v, g, beta, S0


def path_of(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]
