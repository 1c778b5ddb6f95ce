"""DFlash block-diffusion drafter (Qwen3-style layers with target-context "KV injection").

One round: the block [last committed token, mask x (B-1)] at positions s..s+B-1 runs through
a few draft layers whose attention keys/values are [context ; block]. The context is the
target's hidden states after layers `target_layer_ids`, fused by `fc` + `hidden_norm` and
projected by each layer's own k/v projections; it never enters the residual stream. Block
index i predicts the token at position s+i (same position, no shift); index 0 is unused.

The drafter owns neither embedding nor LM head: both come from the target at call time.
Mask token: published checkpoints name a `mask_token_id` (a spare row of the target's
embedding). SmolLM2 has no spare row, so drafters trained here set `mask_token_id = None`
and carry a learned `mask_embedding` [H] saved beside the published tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from drafttree.model.layers import FusedKernel, KernelAttention, RMSNorm, RotaryTable, StackedLayers, apply_rotary
from drafttree.model.linear import Int8Linear

Embed = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]  # embedding weight [V, H] or ids -> [n, H]
LMHead = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]  # head weight [V, H] or hidden -> logits


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default: the middle layer for one draft layer, else evenly spaced over 1..L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int  # draft layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary (LM head rows)
    target_layer_ids: list[int] = field(default_factory=list)
    num_target_layers: int | None = None
    block_size: int = 16
    mask_token_id: int | None = None  # None: use the learned `mask_embedding` tensor
    target_hidden_size: int | None = None  # defaults to hidden_size (as in all published drafters)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    draft_vocab_size: int | None = None  # optional reduced LM head (see DFlashDrafter.draft_vocab)

    def __post_init__(self):
        if not self.target_layer_ids:
            if self.num_target_layers is None:
                raise ValueError("DFlashConfig needs target_layer_ids or num_target_layers")
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def context_dim(self) -> int:
        """Width of the runtime's context feature: k target layers concatenated."""
        return len(self.target_layer_ids) * self.target_hidden_size


class DraftMLP(FusedKernel, nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up: nn.Linear | None = None  # set by fuse_projections: one matmul instead of two
        self.kernel_isa: str | None = None  # silu(gate) * up in one C++ call on the quantized paths

    def forward(self, x):
        if self.gate_up is not None and x.dim() == 2:
            gate_up = self.gate_up(x)
            if self.kernel_isa is not None:
                from drafttree.ops.pointwise import silu_mul

                return self.down_proj(silu_mul(gate_up, self.kernel_isa))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftAttention(FusedKernel, nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H = cfg.hidden_size
        self.q_proj = nn.Linear(H, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, H, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qkv: nn.Linear | None = None  # set by fuse_projections: one matmul instead of three
        self.kernel_isa: str | None = None  # the fused C++ attention on the quantized paths

    def project(self, x, cos, sin):
        """q [..., heads, T, d], k and v [..., kv_heads, T, d] of the same rows (k, q normed and RoPE'd)."""
        if self.qkv is None:
            return (self.queries(x, cos, sin), *self.keys_values(x, cos, sin))
        d = self.head_dim
        q, k, v = self.qkv(x).split([self.n_heads * d, self.n_kv * d, self.n_kv * d], dim=-1)
        q = self.q_norm(q.unflatten(-1, (self.n_heads, d))).transpose(-3, -2)
        k = self.k_norm(k.unflatten(-1, (self.n_kv, d))).transpose(-3, -2)
        v = v.unflatten(-1, (self.n_kv, d)).transpose(-3, -2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    # Shapes: x [..., T, H] (optional leading batch of sequences); cos/sin [..., 1, T, d] (head axis
    # broadcast); heads come out as [..., heads, T, d].
    def keys_values(self, x, cos, sin):
        """k, v [..., kv_heads, T, d]; k is k-normed and RoPE'd (context and block alike)."""
        return self.kv_heads(self.k_proj(x), self.v_proj(x), cos, sin)

    def kv_heads(self, k, v, cos, sin):
        """Projected k, v [..., T, kv_heads*d] -> [..., kv_heads, T, d], k normed and RoPE'd."""
        k = self.k_norm(k.unflatten(-1, (self.n_kv, self.head_dim))).transpose(-3, -2)
        v = v.unflatten(-1, (self.n_kv, self.head_dim)).transpose(-3, -2)
        return apply_rotary(k, cos, sin), v

    def queries(self, x, cos, sin):
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.n_heads, self.head_dim))).transpose(-3, -2)
        return apply_rotary(q, cos, sin)

    def attend(self, q, k, v, mask=None):
        """q [..., heads, Q, d] against k/v [..., kv_heads, K, d]; bidirectional unless a boolean mask
        [..., 1, Q, K] is given. GQA through SDPA (on CPU faster than repeating k/v)."""
        return self.o_proj(self.attention_heads(q, k, v, mask))

    def attention_heads(self, q, k, v, mask=None):
        """`attend` before the output projection: [..., Q, heads*d]."""
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv)
        return out.transpose(-3, -2).flatten(-2)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask=None):
        """h [..., Q, H] block rows; ctx_k/ctx_v [..., kv_heads, C, d] already-projected context."""
        x = self.input_layernorm(h)
        q = self.self_attn.queries(x, cos, sin)
        k, v = self.self_attn.keys_values(x, cos, sin)
        k, v = torch.cat([ctx_k, k], dim=-2), torch.cat([ctx_v, v], dim=-2)
        h = h + self.self_attn.attend(q, k, v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(KernelAttention, StackedLayers, nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(config.context_dim, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        if config.mask_token_id is None:
            self.mask_embedding = nn.Parameter(torch.zeros(H))
        if config.draft_vocab_size:
            # target token ids the reduced head scores (sorted); a buffer so it is saved and moved with the model
            self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size, dtype=torch.long))
        self.rotary = RotaryTable(config.head_dim, config.rope_theta, config.max_position_embeddings)
        self.context_kv: nn.Linear | None = None  # set by fuse_projections: every layer's context k/v in one matmul
        self._head_cache: tuple | None = None
        # set by model.linear.use_cpu_kernels on the quantized paths: the kernels' ISA, and the block's layers as one
        # C++ call (ops.decoder, the target's own stack: ~25 Python-level calls a round fewer)
        self.attention_kernel: str | None = None
        self.decoder_stack = None
        self.reset_parameters()

    def stack_layers(self) -> list:
        """The layers as ops.decoder.DecoderStack reads them (their fused projections: fuse_projections)."""
        from drafttree.ops.decoder import StackLayer

        return [StackLayer(l.input_layernorm, l.post_attention_layernorm, l.self_attn, l.self_attn.qkv,
                           l.self_attn.o_proj, l.mlp, l.mlp.gate_up, l.mlp.down_proj) for l in self.layers]

    def reset_parameters(self, std: float = 0.02):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        if self.config.mask_token_id is None:
            nn.init.normal_(self.mask_embedding, std=std)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # not fc's: on the int8 path the linears hold int8 weights

    # ---- shared pieces -------------------------------------------------------------------
    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        """[N, k*H_target] concatenated target hidden states -> [N, H] context vectors."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def mask_vector(self, embed: Embed) -> torch.Tensor:
        if self.config.mask_token_id is None:
            return self.mask_embedding
        return _embed(embed, torch.tensor([self.config.mask_token_id]))[0]

    def block_embeds(self, token: int | torch.Tensor, embed: Embed, rows: int | None = None) -> torch.Tensor:
        """[R, H] inputs of one block: the last committed token, then R-1 mask vectors (R = rows, at most the
        block size it was trained with; fewer rows draft fewer depths for less work)."""
        rows = self.config.block_size if rows is None else rows
        if not 2 <= rows <= self.config.block_size:
            raise ValueError(f"a block has 2..{self.config.block_size} rows (root + masks), got {rows}")
        tok = _embed(embed, torch.as_tensor(token, dtype=torch.long).view(1))
        mask = self.mask_vector(embed).to(tok.dtype)
        return torch.cat([tok, mask.expand(rows - 1, -1)])

    # ---- inference: a request's incremental context (DraftContext) ---------------------------
    def new_context(self, capacity: int = 256) -> "DraftContext":
        return DraftContext.empty(self, capacity)

    @torch.no_grad()
    def extend_context(self, ctx: "DraftContext", features: torch.Tensor, positions: torch.Tensor) -> None:
        """Append the context K/V of newly committed tokens (features [N, k*H], positions [N])."""
        self.extend_context_many([ctx], [features], [positions])

    @torch.no_grad()
    def extend_context_many(self, ctxs: list["DraftContext"], features: list[torch.Tensor],
                            positions: list[torch.Tensor]) -> None:
        """`extend_context` for several requests in one pass: with the fused projections (`context_kv`) all layers'
        K/V of all rows in one matmul, RoPE and the cache writes once over all heads (per-layer Python calls were
        most of a context update: 0.5 ms for two tokens on a Zen 3; the same arithmetic as DraftAttention.kv_heads,
        bit for bit, tests/test_marginals.py). Several requests share the pass only on int8 projections, which work
        row by row (every row's K/V the bits it gets alone); float projections are BLAS matmuls whose rounding may
        depend on the rows, so those requests go one by one."""
        kept = [(c, f, p) for c, f, p in zip(ctxs, features, positions) if f.shape[0] > 0]
        if len(kept) > 1 and (self.context_kv is None or isinstance(self.context_kv, nn.Linear)):
            for c, f, p in kept:
                self.extend_context_many([c], [f], [p])
            return
        if not kept:
            return
        for ctx, f, _ in kept:
            ctx.ensure_capacity(ctx.length + f.shape[0] + self.config.block_size)
        fused = self.fuse_context(torch.cat([f for _, f, _ in kept]))
        cos, sin = self._rope(torch.cat([p for _, _, p in kept]), fused.dtype)
        if self.context_kv is not None and self.layers:
            k, v = self._context_heads(fused, cos, sin)  # [L, kv, N, d] each
        elif self.layers:  # unfused projections, one request (the check above): layer by layer
            kv = [layer.self_attn.keys_values(fused, cos, sin) for layer in self.layers]
            k, v = torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])
        row = 0
        for ctx, f, _ in kept:
            n = f.shape[0]
            if self.layers:
                ctx.k[:, :, ctx.length:ctx.length + n] = k[:, :, row:row + n]
                ctx.v[:, :, ctx.length:ctx.length + n] = v[:, :, row:row + n]
            ctx.length += n
            row += n

    def _context_heads(self, fused: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's context k (normed, RoPE'd) and v [L, kv, n, d] of fused context rows, in one matmul."""
        n, L = fused.shape[0], len(self.layers)
        attn = self.layers[0].self_attn
        kv = self.context_kv(fused).view(n, L, 2, attn.n_kv, attn.head_dim).permute(2, 1, 3, 0, 4)  # [2, L, kv, n, d]
        k, v = kv[0], kv[1]
        k = torch.stack([layer.self_attn.k_norm(k[i]) for i, layer in enumerate(self.layers)])  # each layer's own norm
        return apply_rotary(k, cos.squeeze(-3), sin.squeeze(-3)), v

    @torch.no_grad()
    def draft(self, ctx: "DraftContext", block_embeds: torch.Tensor, start_position: int) -> torch.Tensor:
        """Run one block [B, H] at positions start..start+B-1 against the request's context.

        Returns the final-normed hidden states [B, H]; the block's own K/V are written to scratch
        rows after the context and never committed.
        """
        rows = self.draft_rows(ctx, block_embeds, start_position)
        return rows.rows(0, rows.count)

    @torch.no_grad()
    def draft_rows(self, ctx: "DraftContext", block_embeds: torch.Tensor, start_position: int) -> "BlockRows":
        """`draft` up to the last layer's attention: every row's K/V is needed by every other row, but the
        rest of the last layer (output projection, MLP, final norm) is row by row, so `BlockRows` runs it
        for the rows a tree asks for (drafttree.marginals)."""
        B = min(block_embeds.shape[0], self.rotary.cos.shape[0] - start_position)  # no positions past the context
        block_embeds = block_embeds[:B]
        ctx.ensure_capacity(ctx.length + B)
        pos = torch.arange(start_position, start_position + B, device=block_embeds.device)
        h = block_embeds.to(self.dtype)
        cos, sin = self._rope(pos, h.dtype)
        c, end = ctx.length, ctx.length + B
        if self.decoder_stack is not None:  # float32 weights and context (DecoderStack.of checks the dtype)
            # every layer whole, in one call: the last layer's tail for all rows costs less than its Python calls
            h, _ = self.decoder_stack(h, cos.squeeze(-3), sin.squeeze(-3), ctx, c, torch.ones(B, B, dtype=torch.bool), ())
            return BlockRows(self, h, None)
        if self._fused_attention([ctx]):
            return self._fused_rows([ctx], [block_embeds], [start_position])[0]
        heads = None
        for i, layer in enumerate(self.layers):
            if heads is not None:
                h = layer_tail(self.layers[i - 1], h, heads)
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(h), cos, sin)
            ctx.k[i, :, c:end] = k  # scratch rows: the block sees itself and the whole context
            ctx.v[i, :, c:end] = v
            heads = attn.attention_heads(q, ctx.k[i, :, :end], ctx.v[i, :, :end])
        return BlockRows(self, h, heads)

    @torch.no_grad()
    def draft_rows_many(self, ctxs: list["DraftContext"], block_embeds: list[torch.Tensor], starts: list[int]
                        ) -> list["BlockRows"]:
        """`draft_rows` of several requests in one pass: their block rows share each linear (one int8 call per
        layer) and attention runs per request against its own context in one C++ call. Every request's rows get
        the bits `draft_rows` gives them alone (the kernels are batch-invariant; tests compare). Without the fused
        attention kernel (the float paths) the requests run one after another."""
        if len(ctxs) < 2 or not self._fused_attention(ctxs):
            return [self.draft_rows(c, e, s) for c, e, s in zip(ctxs, block_embeds, starts)]
        return self._fused_rows(ctxs, block_embeds, starts)

    def _fused_attention(self, ctxs: list["DraftContext"]) -> bool:
        """The quantized paths' C++ attention (q/k norms, RoPE, the block's K/V into its scratch rows, attention in
        one call) serves these contexts."""
        attn = self.layers[0].self_attn if self.layers else None
        return (attn is not None and attn.kernel_isa is not None and attn.qkv is not None
                and all(c.k.dtype == torch.float32 for c in ctxs))

    def _fused_rows(self, ctxs: list["DraftContext"], block_embeds: list[torch.Tensor], starts: list[int]
                    ) -> list["BlockRows"]:
        """draft_rows on the C++ attention, for one request or several (their rows share each linear)."""
        from drafttree.ops.attention import rope_tree_attention_batched

        kernel = self.layers[0].self_attn.kernel_isa
        assert kernel is not None
        segments, positions, embeds, row = [], [], [], 0
        for ctx, emb, start in zip(ctxs, block_embeds, starts):
            b = min(emb.shape[0], self.rotary.cos.shape[0] - start)  # as draft_rows: no positions past the context
            ctx.ensure_capacity(ctx.length + b)
            segments.append((row, row + b, ctx.length, torch.ones(b, b, dtype=torch.bool), ctx))
            positions.append(torch.arange(start, start + b))
            embeds.append(emb[:b])
            row += b
        h = torch.cat(embeds).to(self.dtype)
        cos, sin = self._rope(torch.cat(positions), h.dtype)
        cos, sin = cos.squeeze(-3), sin.squeeze(-3)
        heads = None
        for i, layer in enumerate(self.layers):
            if heads is not None:
                h = layer_tail(self.layers[i - 1], h, heads)
            attn = layer.self_attn
            heads = rope_tree_attention_batched(attn.qkv(layer.input_layernorm(h)), cos, sin, segments, i,
                                                attn.n_heads, attn.n_kv, kernel, attn.q_norm, attn.k_norm)
        return [BlockRows(self, h[a:b], heads[a:b]) for a, b, *_ in segments]

    # ---- LM head -------------------------------------------------------------------------
    def head_weight(self, lm_head):
        """The target's head (a weight tensor or an int8 layer) restricted to the draft vocabulary,
        sliced once, then cached."""
        if not self.config.draft_vocab_size:
            return lm_head
        if isinstance(lm_head, torch.Tensor):
            key = (lm_head.data_ptr(), lm_head.shape, lm_head.dtype, lm_head._version, self.draft_vocab.data_ptr())
        else:
            key = (id(lm_head), self.draft_vocab.data_ptr())
        if self._head_cache is None or self._head_cache[0] != key:
            sub = (lm_head[self.draft_vocab].contiguous() if isinstance(lm_head, torch.Tensor)
                   else lm_head.select_rows(self.draft_vocab))
            self._head_cache = (key, sub)
        return self._head_cache[1]

    def draft_scores(self, hidden: torch.Tensor, lm_head: LMHead) -> torch.Tensor:
        """fp32 logits [n, Vd] over the draft vocabulary (column j is token `draft_vocab[j]`; the whole
        target vocabulary when the drafter has no reduced one). The hot path: nothing is widened.
        A weight tensor is used in its own dtype (the small hidden is cast, never the big head)."""
        if not self.config.draft_vocab_size:
            if callable(lm_head) and not isinstance(lm_head, torch.Tensor):
                return lm_head(hidden).float()
            return (hidden.to(lm_head.dtype) @ lm_head.t()).float()
        if not isinstance(lm_head, (torch.Tensor, Int8Linear)):
            raise TypeError("a reduced draft vocabulary needs the LM head weight tensor or an int8 head layer")
        w = self.head_weight(lm_head)
        return (hidden.to(w.dtype) @ w.t()).float() if isinstance(w, torch.Tensor) else w(hidden).float()

    @property
    def draft_token_ids(self) -> torch.Tensor | None:
        """The target id of each column of `draft_scores`, or None when the columns are the ids."""
        return self.draft_vocab if self.config.draft_vocab_size else None

    def draft_logits(self, hidden: torch.Tensor, lm_head: LMHead) -> torch.Tensor:
        """fp32 logits [n, V] over the target vocabulary; with a draft vocabulary the other ids get -inf
        (for training and references; decoding uses draft_scores)."""
        small = self.draft_scores(hidden, lm_head)
        if not self.config.draft_vocab_size:
            return small
        out = small.new_full((hidden.shape[0], self.config.vocab_size), float("-inf"))
        return out.index_copy_(1, self.draft_vocab, small)

    @torch.no_grad()
    def fuse_projections(self) -> "DFlashDrafter":
        """q/k/v and gate/up as one matmul each on the drafting hot path, and every layer's context k/v as one
        (the separate layers stay for training); done before quantizing, from the float weights."""
        def fused(parts) -> nn.Linear:
            w = torch.cat([p.weight for p in parts])
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype, device=w.device)
            lin.weight.copy_(w)
            return lin

        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv = fused((attn.q_proj, attn.k_proj, attn.v_proj))
            mlp.gate_up = fused((mlp.gate_proj, mlp.up_proj))
        if self.layers:
            self.context_kv = fused([p for layer in self.layers for p in (layer.self_attn.k_proj, layer.self_attn.v_proj)])
        return self

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        ids = torch.as_tensor(token_ids, dtype=torch.long).unique(sorted=True)
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"draft vocab has {ids.numel()} unique ids, config says {self.config.draft_vocab_size}")
        self.draft_vocab.copy_(ids)
        self._head_cache = None

    def _rope(self, positions, dtype):
        cos, sin = self.rotary(positions, dtype)
        return cos.unsqueeze(-3), sin.unsqueeze(-3)  # broadcast over the head axis

    # ---- training: many blocks in one forward ---------------------------------------------
    def forward(self, context_features, context_positions, block_embeds, block_positions, attn_mask):
        """Multi-block forward (training; also a reference for the cached path).

        context_features [..., C, k*H], context_positions [..., C]; block_embeds [..., Q, H] and
        block_positions [..., Q] hold all blocks' rows concatenated; attn_mask [..., Q, C + Q] boolean
        (True = may attend), see `block_attention_mask`. An optional leading axis batches sequences
        (padded), so attention cost grows with one sequence's context, not all of them.
        Returns final-normed hidden states [..., Q, H].
        """
        ctx = self.fuse_context(context_features)
        dtype = ctx.dtype
        ccos, csin = self._rope(context_positions, dtype)
        bcos, bsin = self._rope(block_positions, dtype)
        h = block_embeds.to(dtype)
        attn_mask = attn_mask.unsqueeze(-3)
        for layer in self.layers:
            ck, cv = layer.self_attn.keys_values(ctx, ccos, csin)
            h = layer(h, bcos, bsin, ck, cv, attn_mask)
        return self.norm(h)


def layer_tail(layer: DraftLayer, h: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """A draft layer after its attention, row by row: residual + output projection, then the MLP block."""
    h = h + layer.self_attn.o_proj(heads)
    return h + layer.mlp(layer.post_attention_layernorm(h))


@dataclass
class BlockRows:
    """One drafted block before the last layer's row-wise tail: `rows(a, b)` is `draft`'s hidden states
    [b-a, H] for block rows a..b-1, computed for those rows only."""

    drafter: DFlashDrafter
    h: torch.Tensor  # [B, H] the residual stream entering the last layer
    heads: torch.Tensor | None  # [B, heads*d] the last layer's attention output (None: no layers)

    @property
    def count(self) -> int:
        return self.h.shape[0]

    def rows(self, a: int, b: int) -> torch.Tensor:
        d = self.drafter
        h = self.h[a:b] if self.heads is None else layer_tail(d.layers[-1], self.h[a:b], self.heads[a:b])
        return d.norm(h)


@dataclass
class DraftContext:
    """One request's drafter context: the K/V of every committed token, per draft layer, with scratch
    rows after them for the block being drafted. Grown by doubling."""

    k: torch.Tensor  # [layers, kv_heads, capacity, d]
    v: torch.Tensor
    length: int = 0  # committed context tokens

    @classmethod
    def empty(cls, drafter: "DFlashDrafter", capacity: int) -> "DraftContext":
        cfg, w = drafter.config, drafter.norm.weight  # dtype and device of the compute path (linears may be int8)
        k = torch.zeros(cfg.num_hidden_layers, cfg.num_key_value_heads, capacity, cfg.head_dim, dtype=w.dtype,
                        device=w.device)
        return cls(k, torch.zeros_like(k))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def ensure_capacity(self, needed: int) -> None:
        """`needed` includes the block's scratch rows; the committed rows are kept."""
        cap = self.k.shape[2]
        if cap >= needed:
            return
        shape = (*self.k.shape[:2], max(needed, 2 * cap), self.k.shape[3])
        k, v = self.k.new_zeros(shape), self.v.new_zeros(shape)
        k[:, :, :self.length], v[:, :, :self.length] = self.k[:, :, :self.length], self.v[:, :, :self.length]
        self.k, self.v = k, v

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a drafter context of {self.length} tokens to {n}")
        self.length = n


def block_attention_mask(context_seq, context_positions, block_seq, block_anchor, block_size: int) -> torch.Tensor:
    """Boolean [nb*B, C + nb*B]: each block's rows see its own sequence's context at positions < anchor
    (tokens the target had already processed when that block would be drafted) and its own block."""
    ctx_ok = (block_seq[:, None] == context_seq[None, :]) & (context_positions[None, :] < block_anchor[:, None])
    nb = block_seq.shape[0]
    blk_ok = torch.eye(nb, dtype=torch.bool, device=block_seq.device)
    ctx_ok = ctx_ok.repeat_interleave(block_size, dim=0)
    blk_ok = blk_ok.repeat_interleave(block_size, dim=0).repeat_interleave(block_size, dim=1)
    return torch.cat([ctx_ok, blk_ok], dim=1)


def _embed(embed: Embed, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(embed, torch.Tensor):
        return embed[ids.to(embed.device)]
    return embed(ids)
