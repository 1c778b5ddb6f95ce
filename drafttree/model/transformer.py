"""Lean llama / qwen3 decoder for batch-1 decoding and tree verification (in the spirit of gpt-fast).

One call does everything speculative decoding needs: `forward(state, ...)` runs any number of new
tokens with explicit positions and an ancestor mask over the new tokens (the committed prefix is always
visible), optionally returns the hidden states after chosen decoder layers (the drafter's input) and
logits for selected rows only; `commit(state, rows)` keeps the accepted rows in the request's KV cache.
The module holds weights only: every request brings its own `ModelState`.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from drafttree.ops.attention import rope_tree_attention, rope_tree_attention_batched

from .config import ModelConfig
from .decoder import CausalLM, ForwardOutput
from .kv_cache import KVCache, check_room
from .layers import AttentionMask, RMSNorm, RotaryTable, StackedLayers, SwiGLU, apply_rotary, attend
from .state import ModelState
from .verify_input import VerifyInput


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.group = self.n_heads // self.n_kv
        self.qkv = nn.Linear(cfg.hidden_size, (self.n_heads + 2 * self.n_kv) * self.head_dim, bias=cfg.attention_bias)
        self.o = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, mask: AttentionMask, cache: KVCache, layer: int) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv(x)
        if mask.kernel_isa is not None:  # q/k norms, RoPE, cache write and attention: one C++ call
            out = rope_tree_attention(qkv, cos, sin, cache.k[layer], cache.v[layer], mask.past, mask.tree,
                                      self.n_heads, self.n_kv, mask.kernel_isa, self.q_norm, self.k_norm)
            return self.o(out)
        q, k, v = qkv.split([self.n_heads * d, self.n_kv * d, self.n_kv * d], dim=-1)
        q = q.view(t, self.n_heads, d).transpose(0, 1)
        k = k.view(t, self.n_kv, d).transpose(0, 1)
        v = v.view(t, self.n_kv, d).transpose(0, 1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys, values = cache.write(layer, k, v)
        # Grouped-query attention without repeating K/V: the query heads sharing a KV head are
        # stacked along the row axis, so each KV head is one [group*T, L+T] matmul.
        out = attend(q.reshape(self.n_kv, self.group * t, d), keys, values, mask)
        return self.o(out.view(self.n_heads, t, d).transpose(0, 1).reshape(t, self.n_heads * d))


    def forward_segments(self, x, cos, sin, segments, layer: int) -> torch.Tensor:
        """Rows of several requests: the projections once over all rows, attention per request against its
        own cache (segments: (first row, end row, AttentionMask, KVCache)); kernel path only."""
        out = rope_tree_attention_batched(self.qkv(x), cos, sin, [(a, b, mask.past, mask.tree, cache)
                                                                 for a, b, mask, cache in segments],
                                          layer, self.n_heads, self.n_kv, segments[0][2].kernel_isa, self.q_norm,
                                          self.k_norm)
        return self.o(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)

    def forward(self, x, cos, sin, mask, cache, layer):
        x = x + self.attn(self.input_norm(x), cos, sin, mask, cache, layer)
        return x + self.mlp(self.post_norm(x))

    def forward_segments(self, x, cos, sin, segments, layer):
        x = x + self.attn.forward_segments(self.input_norm(x), cos, sin, segments, layer)
        return x + self.mlp(self.post_norm(x))


def additive_mask(visible: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Bool [T, L+T] -> additive [group*T, L+T] (rows repeated for the stacked query heads)."""
    m = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    return m.repeat(group, 1)


class Transformer(StackedLayers, CausalLM):
    config: ModelConfig

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.attention_kernel: str | None = None  # ISA of the batch-invariant attention kernel (int8 path)
        self.decoder_stack = None  # the layers as one C++ call (ops.decoder), set with the kernels; None: the loop

    def stack_layers(self) -> list:
        """The layers as DecoderStack reads them."""
        from drafttree.ops.decoder import StackLayer

        return [StackLayer(l.input_norm, l.post_norm, l.attn, l.attn.qkv, l.attn.o, l.mlp, l.mlp.gate_up, l.mlp.down)
                for l in self.layers]

    def init_rope(self) -> None:
        """Rope tables are derived, not loaded; build them outside any meta-device context."""
        cfg = self.config
        self.rope = RotaryTable(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)

    def _new_state(self, max_len: int) -> ModelState:
        cfg = self.config
        return ModelState(KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_len, self.dtype))

    def _mask(self, past: int, t: int, tree_mask: torch.Tensor | None) -> AttentionMask:
        group = self.config.num_heads // self.config.num_kv_heads
        if tree_mask is None:
            if t == 1:  # one token sees everything
                return AttentionMask(past, None, None, self.attention_kernel)
            tree_mask = torch.ones(t, t, dtype=torch.bool).tril_()
        if tree_mask.dtype != torch.bool:
            raise TypeError(f"tree_mask must be a bool tensor, got {tree_mask.dtype}")
        if tree_mask.shape == (t, past + t) and bool(tree_mask[:, :past].all()):
            tree_mask = tree_mask[:, past:]  # every committed key visible: the usual case
        if tree_mask.shape == (t, t):
            if self.attention_kernel is not None:  # the kernel reads the [T, T] part; the prefix is always seen
                return AttentionMask(past, tree_mask, None, self.attention_kernel)
            visible = torch.cat([torch.ones(t, past, dtype=torch.bool), tree_mask], dim=1)
        elif tree_mask.shape == (t, past + t):
            visible = tree_mask  # a hidden committed key: only the matmul path masks those
        else:
            raise ValueError(f"tree_mask must be [T, T] or [T, cache_len + T] = [{t}, {past + t}], got {tuple(tree_mask.shape)}")
        return AttentionMask(past, tree_mask, additive_mask(visible, group, self.dtype))

    @torch.inference_mode()
    def forward(
        self,
        state: ModelState,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        capture_layers: tuple[int, ...] = (),
        logits_rows: torch.Tensor | None = None,
        parents: torch.Tensor | None = None,  # unused: attention needs only the mask
    ) -> ForwardOutput:
        cache = state.kv
        t, past = tokens.shape[0], check_room(cache, tokens.shape[0])
        if positions is None:
            positions = torch.arange(past, past + t)
        cos, sin = self.rope(positions, self.dtype)
        mask = self._mask(past, t, tree_mask)
        x = self.embed_tokens(tokens)
        if self.decoder_stack is not None and mask.kernel_isa is not None:  # the layer loop below, in one call
            x, captured = self.decoder_stack(x, cos, sin, cache, mask.past, mask.tree, capture_layers)
        else:
            captured = {}
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, mask, cache, i)
                if i in capture_layers:
                    captured[i] = x
        cache.pending = t
        return self._output(x, captured, capture_layers, logits_rows)

    @torch.inference_mode()
    def verify_many(self, states: list[ModelState], batches: list[VerifyInput],
                    capture_layers: list[tuple[int, ...]]) -> list[ForwardOutput]:
        """The draft trees of several requests in one forward: every linear layer and the LM head run once
        over all their rows, attention per request against its own KV rows. Only on the batch-invariant
        kernel paths (int8/q4: each row is computed alone, so every request gets exactly the logits of its
        own verify); elsewhere one verify after another."""
        if self.attention_kernel is None or len(states) < 2:
            return super().verify_many(states, batches, capture_layers)
        sizes = [b.num_nodes for b in batches]
        ends = torch.tensor(sizes).cumsum(0).tolist()
        segments = [(e - n, e, self._mask(check_room(st.kv, n), n, b.mask), st.kv)
                    for st, b, n, e in zip(states, batches, sizes, ends)]
        cos, sin = self.rope(torch.cat([b.positions for b in batches]), self.dtype)
        x = self.embed_tokens(torch.cat([b.tokens for b in batches]))
        wanted = set().union(*capture_layers)
        captured = {}
        for i, layer in enumerate(self.layers):
            x = layer.forward_segments(x, cos, sin, segments, i)
            if i in wanted:
                captured[i] = x
        rows = [torch.arange(a, b) if batch.logits_rows is None else a + batch.logits_rows
                for (a, b, _, _), batch in zip(segments, batches)]
        logits = self.row_logits(x[torch.cat(rows)]).split([r.numel() for r in rows])
        out = []
        for st, (a, b, _, _), layers, lg in zip(states, segments, capture_layers, logits):
            st.kv.pending = b - a
            feats = torch.cat([captured[i][a:b] for i in layers], dim=-1) if layers else None
            out.append(ForwardOutput(logits=lg, features=feats, hidden=x[a:b]))
        return out

    def commit(self, state: ModelState, rows: torch.Tensor) -> None:
        state.kv.commit(rows)
