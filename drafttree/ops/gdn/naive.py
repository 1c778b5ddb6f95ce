"""Readable references for the gated delta rule (the core of a Gated DeltaNet layer).

Shapes (any leading batch dims `...`):
    q, k   [..., Hk, T, dk]     q̂ = l2norm(q)·dk^-½ and k̂ = l2norm(k), see `prepare_qk`
    v      [..., Hv, T, dv]     Hv = r·Hk; value head h reads key head h // r (HF repeat_interleave)
    g      [..., Hv, T]         log decay, ≤ 0
    beta   [..., Hv, T]         write strength in [0, 1]
    S      [..., Hv, dk, dv]    recurrent state (HF layout), fp32

One step (per value head):  S ← e^g S;  u = β (v − Sᵀk̂);  S ← S + k̂ uᵀ;  o = Sᵀq̂.

Everything here computes in the dtype of its inputs (use fp64 for oracles).
"""
from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # eps inside the square root, as FLA and transformers do
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype = torch.float32):
    """Cast to the compute dtype first, then l2-normalise; scale q by dk^-½ (Qwen3.5 / newer HF order)."""
    q, k = l2norm(q.to(dtype)), l2norm(k.to(dtype))
    return q * q.shape[-1] ** -0.5, k


def expand_key_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """[..., Hk, T, d] -> [..., Hv, T, d]: value head h uses key head h // r."""
    r = num_v_heads // x.shape[-3]
    return x if r == 1 else x.repeat_interleave(r, dim=-3)


def _initial_state(v: torch.Tensor, dk: int, initial_state: torch.Tensor | None) -> torch.Tensor:
    if initial_state is None:
        return v.new_zeros(*v.shape[:-2], dk, v.shape[-1])
    return initial_state.to(v.dtype).clone()


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None):
    """Token-by-token recurrence. Returns (o [..., Hv, T, dv], final state [..., Hv, dk, dv])."""
    q, k = expand_key_heads(q, v.shape[-3]), expand_key_heads(k, v.shape[-3])
    S = _initial_state(v, k.shape[-1], initial_state)
    out = torch.empty_like(v)
    for t in range(v.shape[-2]):
        S = S * g[..., t].exp()[..., None, None]
        kt = k[..., t, :]
        u = beta[..., t, None] * (v[..., t, :] - (S * kt[..., None]).sum(-2))
        S = S + kt[..., :, None] * u[..., None, :]
        out[..., t, :] = (S * q[..., t, :, None]).sum(-2)
    return out, S


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = 64):
    """Chunked (WY/UT) form: inside a chunk of length L, with G = cumsum(g) inside the chunk,
        A[t,s] = β_t e^{G_t−G_s} k̂_t·k̂_s (s < t),   R = β (V − e^G K̂ S),   (I + A) U = R,
        O = e^G Q̂ S + (Q̂K̂ᵀ ⊙ e^{G_t−G_s}[s≤t]) U,   S' = e^{G_L} S + (e^{G_L−G} K̂)ᵀ U.
    The state read is folded into R (one solve instead of HF's two); the tail chunk is not padded.
    """
    q, k = expand_key_heads(q, v.shape[-3]), expand_key_heads(k, v.shape[-3])
    S = _initial_state(v, k.shape[-1], initial_state)
    T = v.shape[-2]
    outs = []
    for start in range(0, T, chunk_size):
        sl = slice(start, min(T, start + chunk_size))
        qc, kc, vc, gc, bc = q[..., sl, :], k[..., sl, :], v[..., sl, :], g[..., sl], beta[..., sl]
        L = vc.shape[-2]
        G = gc.cumsum(-1)
        causal = torch.ones(L, L, dtype=torch.bool, device=v.device).tril()
        # mask BEFORE exp: above the diagonal G_t − G_s > 0 and may overflow
        decay = torch.where(causal, G[..., :, None] - G[..., None, :], float("-inf")).exp()
        strict = decay.masked_fill(torch.eye(L, dtype=torch.bool, device=v.device), 0.0)
        A = bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * strict
        eG = G.exp()[..., None]
        R = bc[..., None] * (vc - eG * (kc @ S))
        U = torch.linalg.solve_triangular(A, R, upper=False, unitriangular=True)
        outs.append(eG * (qc @ S) + ((qc @ kc.transpose(-1, -2)) * decay) @ U)
        G_last = G[..., -1:]
        S = G_last.exp()[..., None] * S + ((G_last - G).exp()[..., None] * kc).transpose(-1, -2) @ U
    return torch.cat(outs, dim=-2), S


# ---------------------------------------------------------------------------------------------
# Tree oracles. Nodes are in topological order: parents[i] < i, parents[root] = -1.


def path_to(parents, node: int) -> list[int]:
    """Root-to-node path (inclusive), root first."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


def tree_oracle(q, k, v, g, beta, initial_state, parents):
    """Per-node recurrence from the parent's state: S_i = step(S_parent(i), token i).

    S_parent(i) is itself the recurrence along the root-to-parent path, so this is exactly the
    sequential recurrence along each node's path. Returns (o [..., Hv, n, dv], states [..., Hv, n, dk, dv]).
    Also the "per-node recursion with parent snapshots" baseline of the benchmark.
    """
    q, k = expand_key_heads(q, v.shape[-3]), expand_key_heads(k, v.shape[-3])
    S0 = _initial_state(v, k.shape[-1], initial_state)
    n = v.shape[-2]
    states = v.new_empty(*S0.shape[:-2], n, *S0.shape[-2:])
    out = torch.empty_like(v)
    for i in range(n):
        p = int(parents[i])
        S = (S0 if p < 0 else states[..., p, :, :]) * g[..., i].exp()[..., None, None]
        ki = k[..., i, :]
        u = beta[..., i, None] * (v[..., i, :] - (S * ki[..., None]).sum(-2))
        S = S + ki[..., :, None] * u[..., None, :]
        states[..., i, :, :] = S
        out[..., i, :] = (S * q[..., i, :, None]).sum(-2)
    return out, states


def tree_per_branch(q, k, v, g, beta, initial_state, parents):
    """Per-branch recursion: re-run the recurrence along every root-to-leaf path from S0.

    Interior nodes take their output from the first branch through them. Baseline for the benchmark
    and a second oracle. Returns o [..., Hv, n, dv].
    """
    n = v.shape[-2]
    is_parent = torch.zeros(n, dtype=torch.bool)
    for p in parents:
        if int(p) >= 0:
            is_parent[int(p)] = True
    out = torch.empty_like(v)
    done = torch.zeros(n, dtype=torch.bool)
    for leaf in range(n):
        if is_parent[leaf]:
            continue
        path = torch.tensor(path_to(parents, leaf))
        o, _ = recurrent_gated_delta_rule(
            q[..., path, :], k[..., path, :], v[..., path, :], g[..., path], beta[..., path], initial_state
        )
        new = ~done[path]
        out[..., path[new], :] = o[..., new, :]
        done[path] = True
    return out
