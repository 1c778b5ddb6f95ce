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

from drafttree.ops.attention import rope_tree_attention, rope_tree_attention_batched, tree_attention

from .config import ModelConfig
from .decoder import CausalLM, ForwardOutput
from .kv_cache import KVCache, check_room
from .layers import AttentionMask, GeGLU, RMSNorm, RotaryTable, StackedLayers, SwiGLU, apply_rotary, attend
from .state import ModelState
from .verify_input import VerifyInput


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.group = self.n_heads // self.n_kv
        self.window = cfg.sliding_window if cfg.sliding_layers and cfg.sliding_layers[index] else 0
        self.scale = cfg.attention_scale or self.head_dim**-0.5
        self.qkv = nn.Linear(cfg.hidden_size, (self.n_heads + 2 * self.n_kv) * self.head_dim, bias=cfg.attention_bias)
        self.o = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, mask: AttentionMask, cache: KVCache, layer: int) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv(x)
        if self.window and mask.kernel_isa is not None:
            return self.o(self._windowed_kernel_attention(qkv, cos, sin, mask, cache, layer))
        if mask.kernel_isa is not None:  # q/k norms, RoPE, cache write and attention: one C++ call
            out = rope_tree_attention(qkv, cos, sin, cache.k[layer], cache.v[layer], mask.past, mask.tree,
                                      self.n_heads, self.n_kv, mask.kernel_isa, self.q_norm, self.k_norm, self.scale)
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
        out = attend(q.reshape(self.n_kv, self.group * t, d), keys, values, mask, self.scale)
        return self.o(out.view(self.n_heads, t, d).transpose(0, 1).reshape(t, self.n_heads * d))

    def _windowed_kernel_attention(self, qkv, cos, sin, mask: AttentionMask, cache: KVCache, layer: int):
        """A sliding-window layer on the kernel path: q/k norms and RoPE row by row in PyTorch (elementwise and
        the row-wise C++ norm: a row's bits whatever the rows beside it), then the batch-invariant kernel over
        each row's visible keys. Where the window hides nothing that is one kernel call with the tree mask;
        where it does, one call per row over exactly its keys (a tree node then sees what the one-token step at
        its position sees, in the same order: the same bits)."""
        t, d, isa = qkv.shape[0], self.head_dim, mask.kernel_isa
        q, k, v = qkv.split([self.n_heads * d, self.n_kv * d, self.n_kv * d], dim=-1)
        q, k, v = q.reshape(t, self.n_heads, d), k.reshape(t, self.n_kv, d), v.reshape(t, self.n_kv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(0, 1), cos, sin).contiguous()  # [H, T, d]
        k = apply_rotary(k.transpose(0, 1), cos, sin)
        keys, values = cache.write(layer, k, v.transpose(0, 1))
        q = q.view(self.n_kv, self.group, t, d)
        if mask.window_keys is None:
            out = tree_attention(q.view(self.n_kv, self.group * t, d), keys, values, mask.past, mask.tree, self.scale, isa)
            out = out.view(self.n_kv, self.group, t, d)
        else:
            out = q.new_empty(self.n_kv, self.group, t, d)
            for r, seen in enumerate(mask.window_keys):
                ks, vs = cache.k[layer][:, seen], cache.v[layer][:, seen]
                row = q[:, :, r].contiguous()  # [Hkv, G, d]: one new row, its key last among `seen`
                out[:, :, r] = tree_attention(row, ks, vs, ks.shape[1] - 1, None, self.scale, isa)
        return out.view(self.n_heads, t, d).transpose(0, 1).reshape(t, self.n_heads * d)


    def forward_segments(self, x, cos, sin, segments, layer: int) -> torch.Tensor:
        """Rows of several requests: the projections once over all rows, attention per request against its
        own cache (segments: (first row, end row, AttentionMask, KVCache)); kernel path only."""
        out = rope_tree_attention_batched(self.qkv(x), cos, sin, [(a, b, mask.past, mask.tree, cache)
                                                                 for a, b, mask, cache in segments],
                                          layer, self.n_heads, self.n_kv, segments[0][2].kernel_isa, self.q_norm,
                                          self.k_norm)
        return self.o(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, index)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        mlp = {"silu": SwiGLU, "gelu_tanh": GeGLU}.get(cfg.mlp_activation)
        if mlp is None:
            raise ValueError(f"unknown MLP activation {cfg.mlp_activation!r}: the runtime has silu and gelu_tanh")
        self.mlp = mlp(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        # gemma3: the attention's and the MLP's outputs are normed before they join the residual
        self.attn_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        self.mlp_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None

    def forward(self, x, cos, sin, mask, cache, layer):
        if self.attn_out_norm is None:
            x = x + self.attn(self.input_norm(x), cos, sin, mask, cache, layer)
            return x + self.mlp(self.post_norm(x))
        x = x + self.attn_out_norm(self.attn(self.input_norm(x), cos, sin, mask, cache, layer))
        return x + self.mlp_out_norm(self.mlp(self.post_norm(x)))

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
        if cfg.sliding_layers and len(cfg.sliding_layers) != cfg.num_layers:
            raise ValueError(f"sliding_layers names {len(cfg.sliding_layers)} layers, the model has {cfg.num_layers}")
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.attention_kernel: str | None = None  # ISA of the batch-invariant attention kernel (int8 path)
        self.decoder_stack = None  # the layers as one C++ call (ops.decoder), set with the kernels; None: the loop

    def stack_layers(self) -> list:
        """The layers as DecoderStack reads them."""
        from drafttree.ops.decoder import StackLayer

        if not self.config.plain_layers:  # gemma3's layer is not the stack's: the Python loop runs it
            return []
        return [StackLayer(l.input_norm, l.post_norm, l.attn, l.attn.qkv, l.attn.o, l.mlp, l.mlp.gate_up, l.mlp.down)
                for l in self.layers]

    def init_rope(self) -> None:
        """Rope tables are derived, not loaded; build them outside any meta-device context."""
        cfg = self.config
        # a table up to 16 MB; beyond (gemma3: 32 k positions x 256) cos/sin are computed per forward, same bits
        precompute = cfg.max_position_embeddings * cfg.head_dim <= 1 << 22
        self.rope = RotaryTable(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, precompute)
        self.rope_local = None
        if cfg.sliding_layers:
            self.rope_local = RotaryTable(cfg.head_dim, cfg.rope_theta_local or cfg.rope_theta,
                                          cfg.max_position_embeddings, precompute)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's storage: float16 where the attention kernel reads it (half the bytes each decode step and
        each request of a batched turn streams; the kernel widens the rows exactly), else the model's dtype."""
        return torch.float16 if self.attention_kernel is not None else self.dtype

    def _new_state(self, max_len: int) -> ModelState:
        cfg = self.config
        return ModelState(KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_len, self.kv_dtype))

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

    def _window_mask(self, mask: AttentionMask, positions: torch.Tensor, t: int) -> AttentionMask:
        """The sliding-window layers' mask: what `mask` shows, less every key at a position `sliding_window` or
        more before the row's own (cache row j holds position j; the new rows are at `positions`)."""
        past, window = mask.past, self.config.sliding_window
        key_positions = torch.cat([torch.arange(past), positions])
        near = positions[:, None] - key_positions[None, :] < window  # [T, past+T]
        tree = mask.tree if mask.tree is not None else torch.ones(t, t, dtype=torch.bool).tril_()
        visible = tree if tree.shape == (t, past + t) else torch.cat([torch.ones(t, past, dtype=torch.bool), tree], 1)
        windowed = visible & near
        if mask.kernel_isa is None:
            group = self.config.num_heads // self.config.num_kv_heads
            return AttentionMask(past, windowed, additive_mask(windowed, group, self.dtype))
        if torch.equal(windowed, visible):  # the window hides nothing: one kernel call over the tree
            return mask
        rows = []
        for r in range(t):
            seen = windowed[r].nonzero()[:, 0]
            a, b = int(seen[0]), int(seen[-1]) + 1
            rows.append(slice(a, b) if b - a == seen.numel() else seen)  # a slice: a view of the cache, no copy
        return AttentionMask(past, mask.tree, None, mask.kernel_isa, window_keys=rows)

    def _layer_inputs(self, positions: torch.Tensor, mask: AttentionMask, t: int):
        """(cos, sin, mask) for the global layers and for the sliding-window ones (the same where there are none)."""
        cos, sin = self.rope(positions, self.dtype)
        if self.rope_local is None:
            return (cos, sin, mask), (cos, sin, mask)
        cos_l, sin_l = self.rope_local(positions, self.dtype)
        return (cos, sin, mask), (cos_l, sin_l, self._window_mask(mask, positions, t))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedded tokens as the first layer reads them (gemma3: times sqrt(hidden), as transformers' Gemma
        embedding returns them, so that a drafter trained there sees what it saw)."""
        x = self.embed_tokens(tokens)
        return x if self.config.embed_scale == 1.0 else x * self.config.embed_scale

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
        mask = self._mask(past, t, tree_mask)
        (cos, sin, mask), local = self._layer_inputs(positions, mask, t)
        x = self.embed(tokens)
        if self.decoder_stack is not None and mask.kernel_isa is not None:  # the layer loop below, in one call
            x, captured = self.decoder_stack(x, cos, sin, cache, mask.past, mask.tree, capture_layers)
        else:
            captured = {}
            for i, layer in enumerate(self.layers):
                x = layer(x, *(local if layer.attn.window else (cos, sin, mask)), cache, i)
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
        if self.attention_kernel is None or len(states) < 2 or not self.config.plain_layers:
            return super().verify_many(states, batches, capture_layers)
        sizes = [b.num_nodes for b in batches]
        ends = torch.tensor(sizes).cumsum(0).tolist()
        segments = [(e - n, e, self._mask(check_room(st.kv, n), n, b.mask), st.kv)
                    for st, b, n, e in zip(states, batches, sizes, ends)]
        cos, sin = self.rope(torch.cat([b.positions for b in batches]), self.dtype)
        x = self.embed(torch.cat([b.tokens for b in batches]))
        wanted = set().union(*capture_layers)
        if self.decoder_stack is not None:  # the layer loop below, in one call (each row: the same bits)
            x, captured = self.decoder_stack.many(x, cos, sin, [(b, m.past, m.tree, kv) for _, b, m, kv in segments],
                                                  wanted)
        else:
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
