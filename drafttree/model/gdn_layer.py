"""Gated DeltaNet token mixer for the runtime; a request's conv context and recurrent state live in
its `GDNLayerState` (model/state.py), not on the module.

`forward(x, tree, st)` reads the committed state and writes nothing to it; it stashes what `commit`
needs. `commit(st, path)` folds the accepted root-to-node path into the state (or defers that to the
next forward).

Projections are re-laid out at load time into one flat matmul: [q | k | v | z | b | a], with
q, k [Hk·dk], v, z [Hv·dv], b, a [Hv]; value head h belongs to key head h // r (both families).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from drafttree.ops.conv import causal_conv1d, tree_causal_conv1d
from drafttree.ops.gdn.fused import gdn_tree_verify
from drafttree.ops.gdn.naive import chunk_gated_delta_rule, prepare_qk
from drafttree.ops.gdn.tree import GDNTreeStash, commit_gdn_path, replay_gdn_path

from .hybrid_config import HybridConfig
from .state import GDNLayerState

# A causal chain up to this length goes through the masked solve (its commit of any prefix is a fold);
# longer chains (prefill) use the chunked form, whose memory is O(T·64) instead of O(T²).
CHAIN_SOLVE_MAX = 64


@dataclass
class TreeInfo:
    """Per-forward metadata shared by every GDN layer."""

    mask: torch.Tensor          # bool [T, T] ancestor-or-self
    conv_index: torch.Tensor    # [T, K] rows of [context; x] in each node's conv window


@dataclass
class _Pending:
    """What one forward leaves for the commit."""

    E: torch.Tensor                 # [(K-1)+T, C] conv context + new pre-conv inputs
    conv_index: torch.Tensor | None  # tree forward: window rows; None for a chain
    core: GDNTreeStash | None       # masked-solve stash (tree, or short chain)
    chain: tuple | None             # long chain: (q, k, v, g, beta, final state)


class GatedRMSNorm(nn.Module):
    """w ⊙ rmsnorm(o) ⊙ silu(z); weight starts at 1 (not the (1 + w) convention of the block norms)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(dtype) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.Hk, self.Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.K = cfg.linear_conv_kernel_dim
        self.key_dim, self.value_dim = self.Hk * self.dk, self.Hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj = nn.Linear(cfg.hidden_size, self.conv_dim + self.value_dim + 2 * self.Hv, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.K))
        self.dt_bias = nn.Parameter(torch.ones(self.Hv))
        self.A_log = nn.Parameter(torch.zeros(self.Hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)
        self.use_replay = False  # commit by replaying the recurrence instead of the fold (cross-check)

    def new_state(self) -> GDNLayerState:
        return GDNLayerState(conv_ctx=torch.zeros(self.K - 1, self.conv_dim, dtype=self.conv_weight.dtype),
                             recurrent=torch.zeros(self.Hv, self.dk, self.dv, dtype=torch.float32))

    # ---- forward -------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, tree: TreeInfo | None, st: GDNLayerState) -> torch.Tensor:
        self.apply_deferred_commit(st)
        T = x.shape[0]
        mixed, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_dim, self.Hv, self.Hv], dim=-1)
        if tree is None:
            mixed, E = causal_conv1d(mixed, self.conv_weight, st.conv_ctx)
        else:
            mixed, E = tree_causal_conv1d(mixed, self.conv_weight, st.conv_ctx, tree.conv_index)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = prepare_qk(q.view(T, self.Hk, self.dk).transpose(0, 1), k.view(T, self.Hk, self.dk).transpose(0, 1))
        v = v.view(T, self.Hv, self.dv).transpose(0, 1).float()
        beta = b.float().sigmoid().t()
        g = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())).t()  # ≤ 0

        pending = _Pending(E=E, conv_index=None if tree is None else tree.conv_index, core=None, chain=None)
        if tree is None and T > CHAIN_SOLVE_MAX:
            o, S_end = chunk_gated_delta_rule(q, k, v, g, beta, st.recurrent)
            pending.chain = (q, k, v, g, beta, S_end)
        else:
            mask = tree.mask if tree is not None else torch.ones(T, T, dtype=torch.bool).tril_()
            o, pending.core = gdn_tree_verify(q, k, v, g, beta, st.recurrent, mask)  # fused on fp32 CPU
        st.pending = pending

        o = o.transpose(0, 1).to(x.dtype)                           # [T, Hv, dv]
        y = self.norm(o, z.view(T, self.Hv, self.dv)).reshape(T, self.value_dim)
        return self.out_proj(y)

    # ---- commit --------------------------------------------------------------------------------

    def commit(self, st: GDNLayerState, path: torch.Tensor, defer: bool = False) -> None:
        """Accept the root-to-node `path` (rows of the last forward, root first); an empty path keeps
        the committed state as it was."""
        if st.pending is None:
            raise RuntimeError("commit without a forward to commit")
        if path.numel() == 0:
            st.pending = None
            return
        st.deferred = path
        if not defer:
            self.apply_deferred_commit(st)

    def apply_deferred_commit(self, st: GDNLayerState) -> None:
        path, p = st.deferred, st.pending
        if path is None:
            return
        st.deferred, st.pending = None, None
        A, K = path.numel(), self.K
        if p.conv_index is None:  # chain: the path is a prefix
            st.conv_ctx = p.E[A:A + K - 1].clone()
        else:
            st.conv_ctx = p.E[p.conv_index[path[-1], 1:]].clone()
        if p.core is not None:
            fn = replay_gdn_path if self.use_replay else commit_gdn_path
            st.recurrent = fn(st.recurrent, p.core, path)
        else:
            q, k, v, g, beta, S_end = p.chain
            if A == v.shape[-2]:
                st.recurrent = S_end
            else:  # a partial prefix of a long chain: re-run the chunked form over it
                _, st.recurrent = chunk_gated_delta_rule(
                    q[:, :A], k[:, :A], v[:, :A], g[:, :A], beta[:, :A], st.recurrent
                )
