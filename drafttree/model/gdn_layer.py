"""Gated DeltaNet token mixer for the runtime; a request's conv context and recurrent state live in
its `GDNLayerState` (model/state.py), not on the module.

`forward(x, tree, st)` reads the committed state and writes nothing to it; it stashes what `commit`
needs. `commit(st, path)` folds the accepted root-to-node path into the state (or defers that to the
next forward).

On the kernel paths (`use_cpu_kernels` sets `kernel_isa`) a one-token forward is one C++ call between the two
projections (ops/gdn/step.py): it returns the new conv context and recurrent state as fresh tensors, which the
commit swaps in; `step.USE_STEP = False` runs it through the composed ops below instead (the reference).

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
from drafttree.ops.gdn import step
from drafttree.ops.gdn.naive import chunk_gated_delta_rule, prepare_qk
from drafttree.ops.gdn.tree import GDNTreeStash, commit_gdn_path, replay_gdn_path

from .hybrid_config import HybridConfig
from .layers import FusedKernel
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

    E: torch.Tensor | None          # [(K-1)+T, C] conv context + new pre-conv inputs (None: a kernel step)
    conv_index: torch.Tensor | None  # tree forward: window rows; None for a chain
    core: GDNTreeStash | None       # masked-solve stash (tree, or short chain)
    chain: tuple | None             # long chain: (q, k, v, g, beta, final state)
    step: tuple | None = None       # one-token kernel step: (new conv context, new recurrent state)


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


class GatedDeltaNet(FusedKernel, nn.Module):
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
        self.kernel_isa: str | None = None  # set by use_cpu_kernels: one-token forwards run ops/gdn/step.py
        self._conv_wt: tuple | None = None  # ((data_ptr, version) of conv_weight, its [K, C] transpose) for the step

    def new_state(self) -> GDNLayerState:
        return GDNLayerState(conv_ctx=torch.zeros(self.K - 1, self.conv_dim, dtype=self.conv_weight.dtype),
                             recurrent=torch.zeros(self.Hv, self.dk, self.dv, dtype=torch.float32))

    # ---- forward -------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, tree: TreeInfo | None, st: GDNLayerState) -> torch.Tensor:
        self.apply_deferred_commit(st)
        T = x.shape[0]
        if T == 1 and self._step_ready(x, st):
            return self._kernel_step(x, st)
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

    def _step_ready(self, x: torch.Tensor, st: GDNLayerState) -> bool:
        return (step.USE_STEP and self.kernel_isa is not None and x.device.type == "cpu"
                and all(t.dtype == torch.float32 for t in (x, self.conv_weight, st.conv_ctx, st.recurrent))
                and step.step_available())

    def _conv_weight_t(self) -> torch.Tensor:
        w = self.conv_weight
        try:
            version = w._version
        except RuntimeError:  # an inference tensor keeps no version counter (and cannot change outside inference mode)
            version = -1
        key = (w.data_ptr(), version)
        if self._conv_wt is None or self._conv_wt[0] != key:
            self._conv_wt = (key, w.detach().t().contiguous())
        return self._conv_wt[1]

    def _kernel_step(self, x: torch.Tensor, st: GDNLayerState) -> torch.Tensor:
        """One token through the C++ step: the committed state is read, the new one waits for the commit."""
        y, ctx, S = step.gdn_step(self.in_proj(x), self._conv_weight_t(), st.conv_ctx, self.A_log, self.dt_bias,
                                  self.norm.weight, st.recurrent, self.Hk, self.norm.eps, self.kernel_isa)
        st.pending = _Pending(E=None, conv_index=None, core=None, chain=None, step=(ctx, S))
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
        if p.step is not None:  # a kernel step computed the accepted token's state already: swap it in
            if A != 1 or int(path[0]) != 0:
                raise ValueError(f"a one-token forward commits the path [0], got {path.tolist()}")
            st.conv_ctx, st.recurrent = p.step
            return
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
