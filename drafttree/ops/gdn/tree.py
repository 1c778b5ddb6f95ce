"""Tree verification for the gated delta rule: one masked triangular solve, no state writes.

Nodes 0..n-1 are in topological order (parents before children). With M the ancestor-or-self mask,
Γ = M·g the path log-decay (NOT a cumsum over node order: that would add in siblings), and
D[i,j] = e^{Γ_i−Γ_j}·M[i,j] (masked BEFORE exp, non-ancestor differences can be huge):

    X = β ⊙ D ⊙ K̂K̂ᵀ  (strictly lower: the diagonal is ignored by the unit-triangular solve)
    Y = D ⊙ Q̂K̂ᵀ
    (I + X) U = β (V − e^Γ K̂ S₀)
    O = e^Γ Q̂ S₀ + Y U

Every node's state is S_i = e^{Γ_i} S₀ + Σ_{j∈anc(i)} e^{Γ_i−Γ_j} k̂_j u_jᵀ, so committing an accepted
node is a fold over its path's stashed (k̂, U, Γ): no re-solve, no per-node snapshots.
Shapes follow `naive.py`; value heads are grouped per key head so Gram products are computed once
per key head (GQA).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GDNTreeStash:
    """What a commit needs from one verify call (per layer)."""

    k: torch.Tensor      # k̂      [..., Hk, n, dk]
    u: torch.Tensor      # U      [..., Hv, n, dv]
    gamma: torch.Tensor  # Γ      [..., Hv, n]
    # the step inputs, kept (they are views of tensors computed anyway) for the replay commit
    v: torch.Tensor      # [..., Hv, n, dv]
    g: torch.Tensor      # [..., Hv, n]
    beta: torch.Tensor   # [..., Hv, n]


def ancestor_mask(parents) -> torch.Tensor:
    """Bool [n, n], M[i, j] = j is i or an ancestor of i. Needs parents[i] < i."""
    parents = torch.as_tensor(parents, dtype=torch.long)
    n = parents.numel()
    M = torch.eye(n, dtype=torch.bool)
    for i in range(n):
        p = int(parents[i])
        if p >= i:
            raise ValueError(f"nodes must be in topological order: parents[{i}] = {p}")
        if p >= 0:
            M[i] |= M[p]
    return M


def parents_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Parent of each node from an ancestor-or-self mask: the proper ancestor with the largest index."""
    n = mask.shape[0]
    strict = mask & ~torch.eye(n, dtype=torch.bool, device=mask.device)
    idx = torch.arange(n, device=mask.device).expand(n, n)
    return torch.where(strict, idx, -1).amax(dim=1)


def check_ancestor_mask(mask: torch.Tensor) -> None:
    """An ancestor-or-self mask of a forest in topological order: unit diagonal, lower triangular,
    and each row is its parent's row plus itself."""
    n = mask.shape[0]
    if mask.dtype != torch.bool or mask.shape != (n, n):
        raise ValueError(f"tree_mask must be a bool [n, n] tensor, got {mask.dtype} {tuple(mask.shape)}")
    if not bool(mask.diagonal().all()):
        raise ValueError("tree_mask must include each node itself (unit diagonal)")
    if bool(mask.triu(1).any()):
        raise ValueError("tree_mask must be lower triangular: nodes in topological order, parents first")
    parents = parents_from_mask(mask)
    expected = torch.eye(n, dtype=torch.bool, device=mask.device)
    has_parent = parents >= 0
    expected[has_parent] |= mask[parents[has_parent]]
    if not torch.equal(expected, mask):
        raise ValueError("tree_mask is not an ancestor mask (a row differs from its parent's row plus itself)")


def tree_gated_delta_verify(q, k, v, g, beta, initial_state, mask):
    """Outputs of every tree node, as if the recurrence ran along its root-to-node path from S₀.

    q, k are prepared (`naive.prepare_qk`). mask is the bool ancestor-or-self mask [n, n].
    Reads initial_state, writes nothing. Returns (o [..., Hv, n, dv], GDNTreeStash).
    """
    Hk, n, dk = k.shape[-3:]
    Hv, dv = v.shape[-3], v.shape[-1]
    r = Hv // Hk
    lead = v.shape[:-3]
    # group value heads under their key head: [..., Hk, r, ...]
    vg = v.reshape(*lead, Hk, r, n, dv)
    gg, bg = g.reshape(*lead, Hk, r, n), beta.reshape(*lead, Hk, r, n)
    S0 = initial_state.to(v.dtype).reshape(*lead, Hk, r, dk, dv)
    qg, kg = q.unsqueeze(-3), k.unsqueeze(-3)  # [..., Hk, 1, n, dk]

    gamma = gg @ mask.to(g.dtype).transpose(0, 1)                      # Γ = M g, path sums
    diff = gamma[..., :, None] - gamma[..., None, :]
    D = torch.where(mask, diff, float("-inf")).exp()                     # mask before exp
    X = bg[..., :, None] * D * (kg @ kg.transpose(-1, -2))               # diag ignored below
    Y = D * (qg @ kg.transpose(-1, -2))
    e_gamma = gamma.exp()[..., None]
    R = bg[..., None] * (vg - e_gamma * (kg @ S0))
    U = torch.linalg.solve_triangular(X, R, upper=False, unitriangular=True)
    O = e_gamma * (qg @ S0) + Y @ U

    O = O.reshape(*lead, Hv, n, dv)
    stash = GDNTreeStash(k=k, u=U.reshape(*lead, Hv, n, dv), gamma=gamma.reshape(*lead, Hv, n), v=v, g=g, beta=beta)
    return O, stash


def _path_tensor(path, device) -> torch.Tensor:
    path = torch.as_tensor(path, dtype=torch.long, device=device)
    if path.ndim != 1 or path.numel() == 0:
        raise ValueError("path must be a non-empty 1-D list of node indices, root first")
    return path


def commit_gdn_path(initial_state, stash: GDNTreeStash, path):
    """State after the accepted node ℓ = path[-1], by folding the stash over path = anc(ℓ) (root first):
        S* = e^{Γ_ℓ} S₀ + Σ_{j∈path} e^{Γ_ℓ−Γ_j} k̂_j u_jᵀ
    """
    path = _path_tensor(path, stash.u.device)
    Hv = stash.u.shape[-3]
    gamma = stash.gamma[..., path]                                       # [..., Hv, P]
    g_last = gamma[..., -1:]
    w = (g_last - gamma).exp()                                           # ≤ 1 along a path
    k = stash.k[..., path, :]
    k = k.repeat_interleave(Hv // k.shape[-3], dim=-3) if k.shape[-3] != Hv else k
    S0 = initial_state.to(stash.u.dtype)
    return g_last.exp()[..., None] * S0 + (w[..., None] * k).transpose(-1, -2) @ stash.u[..., path, :]


def replay_gdn_path(initial_state, stash: GDNTreeStash, path):
    """Same state by re-running the recurrence over the path's inputs (cross-check of the fold)."""
    path = _path_tensor(path, stash.u.device)
    Hv = stash.v.shape[-3]
    k = stash.k[..., path, :]
    k = k.repeat_interleave(Hv // k.shape[-3], dim=-3) if k.shape[-3] != Hv else k
    S = initial_state.to(stash.v.dtype).clone()
    for t in range(path.numel()):
        i = path[t]
        S = S * stash.g[..., i].exp()[..., None, None]
        kt = k[..., t, :]
        u = stash.beta[..., i, None] * (stash.v[..., i, :] - (S * kt[..., None]).sum(-2))
        S = S + kt[..., :, None] * u[..., None, :]
    return S
