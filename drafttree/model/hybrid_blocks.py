"""Blocks of the qwen3_next / qwen3_5 hybrids other than the Gated DeltaNet: (1 + w) RMSNorm,
gated attention with partial RoPE, and the sparse MoE with a gated shared expert."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .hybrid_config import HybridConfig
from .kv_cache import KVCache
from .layers import FusedKernel, SwiGLU, apply_rotary, attend


class ZeroCenteredRMSNorm(FusedKernel, nn.Module):
    """RMSNorm with weight stored as an offset from 1: out = norm(x) · (1 + w), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.kernel_isa: str | None = None  # one C++ call (ops.pointwise) on the int8/q4 paths

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_isa is not None and x.dtype == torch.float32:
            from drafttree.ops.pointwise import rms_norm

            return rms_norm(x, 1.0 + self.weight, self.eps, self.kernel_isa)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)


class GatedAttention(nn.Module):
    """Full attention whose output is gated per channel by sigmoid(gate); q_proj yields [q | gate] per head."""

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.group = self.n_heads // self.n_kv
        self.rotary_dim = cfg.rotary_dim
        d = self.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, (2 * self.n_heads + 2 * self.n_kv) * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * d, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps)

    def _rope(self, x, cos, sin):
        r = self.rotary_dim  # partial RoPE: only the first r channels rotate
        return torch.cat([apply_rotary(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def forward(self, x, cos, sin, mask, cache: KVCache, slot: int) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qg, k, v = self.qkv(x).split([2 * self.n_heads * d, self.n_kv * d, self.n_kv * d], dim=-1)
        q, gate = qg.view(t, self.n_heads, 2 * d).split(d, dim=-1)
        q = self.q_norm(q).transpose(0, 1)
        k = self.k_norm(k.view(t, self.n_kv, d)).transpose(0, 1)
        v = v.view(t, self.n_kv, d).transpose(0, 1)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        keys, values = cache.write(slot, k, v)
        # query heads sharing a KV head are stacked on the row axis: one matmul per KV head
        out = attend(q.reshape(self.n_kv, self.group * t, d), keys, values, mask)
        out = out.view(self.n_heads, t, d).transpose(0, 1).reshape(t, self.n_heads * d)
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, self.n_heads * d)))


class SparseMoE(nn.Module):
    """Top-k softmax router over experts (SwiGLU each) plus a shared expert scaled by sigmoid(gate)."""

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = nn.Linear(D, E, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))  # [gate; up] rows per expert
        self.down_proj = nn.Parameter(torch.empty(E, D, I))
        self.shared_expert = SwiGLU(D, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(D, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        probs = logits.float().softmax(-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            rows, slot = (experts == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[rows, slot, None]
            out.index_add_(0, rows, h)
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
