"""Weaver: a small path-conditioned adapter on top of the DFlash drafter's marginals.

The drafter predicts every depth of a block independently of what the tree placed above it. Weaver
re-scores, for one tree node u at depth d, the drafter's top-K candidates C_{d+1} for u's children,
conditioned on u's realised path (root -> u):

  e_v  = W_in [E_t(x_v); h_{d_v+1}] + depth(d_v)   for every v on the path (E_t: the target's frozen
         embedding, h_i: the drafter's hidden state at block index i, the one that predicts depth i)
  s_u  = a few causal (ancestors-or-self) transformer layers over e_root..e_u, last row
  r(c) = <Q s_u, E_t(c)>                            gathered embedding rows of the K candidates only
  log p_W(c | path)   ∝ log m_{d+1}(c) + r(c)        c in C_{d+1}
  log p_W(other|path) ∝ log(1 - Σ_C m_{d+1}) + <v, s_u>

Q and v start at zero, so an untrained Weaver returns the drafter's marginals bit for bit: the
normaliser is computed as log1p(Σ m·expm1(r) + rest·expm1(b)), exactly 0 when r = b = 0.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from drafttree.model.layers import RMSNorm

MIN_REST = 1e-6  # floor on the drafter's mass outside the K candidates (fp32 rounding can make it 0 or < 0)
MAX_RESIDUAL = 20.0  # r and b are squashed to ±20 nats: expm1 stays finite, 0 stays exactly 0


@dataclass
class WeaverConfig:
    vocab_size: int  # the target's vocabulary (candidate ids are target ids)
    embed_size: int  # the target's embedding width (E_t, also the candidate rows)
    drafter_hidden_size: int  # width of the drafter's hidden states h
    max_depth: int  # deepest drafted position (drafter block_size - 1)
    hidden_size: int = 256
    num_layers: int = 1
    num_heads: int = 4
    intermediate_size: int = 512
    num_candidates: int = 32  # K
    rms_norm_eps: float = 1e-6
    # children of nodes shallower than this keep the drafter's marginals: at the root Weaver sees no more than
    # the drafter did (the root token and h_1), and there a residual can only overfit
    first_scored_depth: int = 0

    def __post_init__(self):
        for name in ("vocab_size", "embed_size", "drafter_hidden_size", "max_depth", "hidden_size", "num_layers",
                     "num_heads", "intermediate_size", "num_candidates"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"weaver config: {name} must be an integer >= 1, got {value!r}")
        if isinstance(self.first_scored_depth, bool) or not isinstance(self.first_scored_depth, int) \
                or self.first_scored_depth < 0:
            raise ValueError(f"weaver config: first_scored_depth must be an integer >= 0, got {self.first_scored_depth!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"weaver config: hidden_size {self.hidden_size} is not a multiple of num_heads "
                             f"{self.num_heads}")
        if self.num_candidates > self.vocab_size:
            raise ValueError(f"weaver config: num_candidates {self.num_candidates} > vocab_size {self.vocab_size}")

    def to_dict(self) -> dict:
        return asdict(self)


class WeaverLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP; attention is split into `project` and `finish` so the training
    forward (whole paths) and the tree builder (new nodes against cached ancestors) share the weights."""

    def __init__(self, cfg: WeaverConfig):
        super().__init__()
        W = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, W // cfg.num_heads
        self.attn_norm = RMSNorm(W, cfg.rms_norm_eps)
        self.qkv = nn.Linear(W, 3 * W, bias=False)
        self.out = nn.Linear(W, W, bias=False)
        self.mlp_norm = RMSNorm(W, cfg.rms_norm_eps)
        self.gate_up = nn.Linear(W, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, W, bias=False)

    def project(self, h: torch.Tensor):
        """h [..., T, W] -> q, k, v [..., T, heads, head_dim]."""
        q, k, v = self.qkv(self.attn_norm(h)).chunk(3, dim=-1)
        shape = (*h.shape[:-1], self.num_heads, self.head_dim)
        return q.reshape(shape), k.reshape(shape), v.reshape(shape)

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual after attention (attn [..., T, heads, head_dim]), then the MLP."""
        h = h + self.out(attn.flatten(-2))
        gate, up = self.gate_up(self.mlp_norm(h)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)


class Weaver(nn.Module):
    def __init__(self, config: WeaverConfig):
        super().__init__()
        self.config = config
        W = config.hidden_size
        # W_in [E_t(x); h] as two halves: the tree builder projects a round's hidden states once (hidden_table)
        self.token_proj = nn.Linear(config.embed_size, W, bias=False)
        self.hidden_proj = nn.Linear(config.drafter_hidden_size, W, bias=False)
        self.depth_embedding = nn.Embedding(config.max_depth, W)  # nodes at depths 0..max_depth-1 have children
        self.layers = nn.ModuleList(WeaverLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(W, config.rms_norm_eps)
        # [Q; v] in one matmul: s_u -> a query against the candidate rows, and the "other" logit's offset
        self.readout = nn.Linear(W, config.embed_size + 1, bias=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        # the residual starts at exactly zero: an untrained Weaver is the drafter
        nn.init.zeros_(self.readout.weight)

    # ---- inputs ----------------------------------------------------------------------------
    def node_inputs(self, token_embeds: torch.Tensor, drafter_hidden: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """e = W_in [E_t(x); h_{d+1}] + depth(d): token_embeds [..., E], drafter_hidden [..., Hd], depths [...]."""
        dtype = self.token_proj.weight.dtype
        return self.token_proj(token_embeds.to(dtype)) + self.hidden_table(drafter_hidden, depths)

    def hidden_table(self, drafter_hidden: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """The input terms that depend on depth only: W_h h_{d+1} + depth(d)."""
        return self.hidden_proj(drafter_hidden.to(self.hidden_proj.weight.dtype)) + self.depth_embedding(depths)

    # ---- whole paths (training, and the naive reference) ------------------------------------
    def forward_paths(self, x: torch.Tensor) -> torch.Tensor:
        """x [P, L, W]: P paths of L nodes, root first; causal attention = ancestors-or-self on a path.
        Returns s [P, L, W] (final-normed)."""
        h = x
        for layer in self.layers:
            q, k, v = layer.project(h)
            att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            h = layer.finish(h, att.transpose(1, 2))
        return self.norm(h)

    # ---- scores over the candidates ----------------------------------------------------------
    def candidate_logprobs(self, s: torch.Tensor, cand_logprobs: torch.Tensor, log_rest: torch.Tensor,
                           cand_embeds: torch.Tensor) -> torch.Tensor:
        """log p_W over C ∪ {other}: s [..., W], cand_logprobs [..., K] (the drafter's log-marginals of the
        candidates), log_rest [...] (log of its mass outside them), cand_embeds [..., K, E].
        Returns [..., K + 1], the last entry "other"."""
        out = self.readout(s)
        q, b = out[..., :-1], out[..., -1]
        raw = (cand_embeds.to(q.dtype) @ q.unsqueeze(-1)).squeeze(-1)
        r = MAX_RESIDUAL * torch.tanh(raw / MAX_RESIDUAL)
        b = MAX_RESIDUAL * torch.tanh(b / MAX_RESIDUAL)
        lp = cand_logprobs.to(r.dtype)
        scores = torch.cat([lp + r, (log_rest.to(r.dtype) + b).unsqueeze(-1)], dim=-1)
        # log Z = log(Σ m e^r + rest e^b) = log1p(Σ m (e^r - 1) + rest (e^b - 1)) since Σ m + rest = 1: exactly 0
        # for an untrained Weaver. Where that sum nears -1 (every score pushed down) log1p loses precision and
        # logsumexp takes over, as it does for large sums; the clamp keeps the unused branch finite for the gradient
        # (and the squashed r, b keep expm1 finite).
        x = (lp.exp() * torch.expm1(r)).sum(-1) + log_rest.to(r.dtype).exp() * torch.expm1(b)
        near = (x > -0.5) & (x < 1.0)
        log_z = torch.where(near, torch.log1p(x.clamp(min=-0.5, max=1.0)), torch.logsumexp(scores, dim=-1))
        return scores - log_z.unsqueeze(-1)


def candidates_from_logits(logits: torch.Tensor, k: int):
    """drafter_candidates from raw logits without materialising the log-softmax (training: one pass for the
    normaliser, one for the top-k, over [N, D, V])."""
    values, ids = grouped_topk(logits, k)
    lp = (values - torch.logsumexp(logits, dim=-1, keepdim=True)).float()
    rest = (1.0 - lp.exp().sum(-1)).clamp(min=MIN_REST)
    return ids, lp, rest.log()


def grouped_topk(x: torch.Tensor, k: int, group: int = 128):
    """torch.topk over the last axis, faster on CPU for a small k over a large vocabulary: the top k entries lie
    in the k groups with the largest maxima, so one max-reduction picks the groups and topk runs on k*group
    entries only (torch.topk on 49k entries per row is ~10x slower). Same values; ties may pick other ids."""
    V = x.shape[-1]
    pad = (-V) % group
    if V <= k * group:
        return torch.topk(x, k, dim=-1)
    xg = torch.nn.functional.pad(x, (0, pad), value=float("-inf")) if pad else x
    xg = xg.unflatten(-1, (-1, group))  # [..., G, group]
    top_groups = xg.amax(-1).topk(k, dim=-1).indices  # [..., k]
    members = xg.gather(-2, top_groups[..., None].expand(*top_groups.shape, group)).flatten(-2)
    ids = (top_groups[..., None] * group + torch.arange(group)).flatten(-2)
    values, order = members.topk(k, dim=-1)
    return values, ids.gather(-1, order)


def drafter_candidates(logprobs: torch.Tensor, k: int):
    """Top-k of the drafter's log-marginals per row: (ids [..., k] target ids, log-probs [..., k] sorted
    descending, log of the mass outside them [...])."""
    lp, ids = grouped_topk(logprobs, k)  # the values torch.topk gives, faster over a large vocabulary
    rest = (1.0 - lp.float().exp().sum(-1)).clamp(min=MIN_REST)
    return ids, lp.float(), rest.log()
