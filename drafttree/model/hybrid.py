"""Hybrid Gated DeltaNet / gated-attention decoder (qwen3_next, qwen3_5 text) for the runtime.

Same interface as `transformer.Transformer`: `forward` runs new tokens (a chain or a tree given by
its ancestor mask) without advancing the committed state; `commit(rows)` accepts a root-to-node path.
Attention layers write K/V to scratch rows of the KV cache; GDN layers verify the whole tree with
one masked triangular solve per layer and fold the accepted path into their state at commit.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from drafttree.ops.conv import tree_conv_index
from drafttree.ops.gdn.tree import check_ancestor_mask, parents_from_mask

from .gdn_layer import GatedDeltaNet, TreeInfo
from .hybrid_blocks import GatedAttention, SparseMoE, ZeroCenteredRMSNorm
from .hybrid_config import HybridConfig
from .kv_cache import KVCache, check_room
from .layers import RotaryTable, SwiGLU
from .layers import AttentionMask
from .transformer import ForwardOutput, additive_mask


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, index: int):
        super().__init__()
        self.kind = cfg.layer_types[index]
        self.input_norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.kind == "full_attention":
            self.attn = GatedAttention(cfg)
        else:
            self.gdn = GatedDeltaNet(cfg)
        self.post_norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if cfg.is_moe_layer(index) else SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, mask, cache, slot, tree):
        h = self.input_norm(x)
        h = self.attn(h, cos, sin, mask, cache, slot) if self.kind == "full_attention" else self.gdn(h, tree)
        x = x + h
        return x + self.mlp(self.post_norm(x))


class HybridModel(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.attn_slot = {layer: slot for slot, layer in enumerate(cfg.attention_layers)}
        self.cache: KVCache | None = None
        self.defer_gdn_commit = False  # fold accepted GDN paths at the start of the next forward
        self._last_mask: torch.Tensor | None = None  # ancestor mask of the last forward (None = chain)
        self.attention_kernel: str | None = None  # ISA of the batch-invariant attention kernel (int8 path)

    def init_rope(self) -> None:
        cfg = self.config
        self.rope = RotaryTable(cfg.rotary_dim, cfg.rope_theta, cfg.max_position_embeddings)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # the compute dtype (int8 paths keep float norms)

    @property
    def cache_len(self) -> int:
        return 0 if self.cache is None else self.cache.length

    def gdn_layers(self) -> list[GatedDeltaNet]:
        return [layer.gdn for layer in self.layers if layer.kind == "linear_attention"]

    def setup_cache(self, max_len: int) -> None:
        """Allocate (or grow) the KV cache; committed K/V and GDN states are kept."""
        cfg = self.config
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"{max_len} tokens exceed the model's context of {cfg.max_position_embeddings}")
        for gdn in self.gdn_layers():
            if gdn.state is None:
                gdn.reset_state()
        if self.cache is not None and self.cache.max_len >= max_len:
            return
        new = KVCache(len(self.attn_slot), cfg.num_kv_heads, cfg.head_dim, max_len, self.dtype)
        if self.cache is not None and self.cache.length:
            n = self.cache.length
            new.k[:, :, :n], new.v[:, :, :n] = self.cache.k[:, :, :n], self.cache.v[:, :, :n]
            new.length = n
        self.cache = new

    def reset(self) -> None:
        if self.cache is not None:
            self.cache.truncate(0)
        for gdn in self.gdn_layers():
            gdn.reset_state()
        self._last_mask = None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on final-normed hidden states; fp32 logits."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def _tree_mask(self, t: int, tree_mask: torch.Tensor) -> torch.Tensor:
        past = self.cache.length
        if tree_mask.dtype != torch.bool:
            raise TypeError(f"tree_mask must be a bool tensor, got {tree_mask.dtype}")
        if tree_mask.shape == (t, past + t):
            if not bool(tree_mask[:, :past].all()):
                raise ValueError("hybrid models need the whole committed prefix visible (GDN state summarises it)")
            tree_mask = tree_mask[:, past:]
        if tree_mask.shape != (t, t):
            raise ValueError(f"tree_mask must be [T, T] or [T, cache_len + T] = [{t}, {past + t}], got {tuple(tree_mask.shape)}")
        check_ancestor_mask(tree_mask)
        return tree_mask

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        capture_layers: tuple[int, ...] = (),
        logits_rows: torch.Tensor | None = None,
    ) -> ForwardOutput:
        t, past = tokens.shape[0], check_room(self.cache, tokens.shape[0])
        tree = None
        if tree_mask is not None:
            tree_mask = self._tree_mask(t, tree_mask)
            parents = parents_from_mask(tree_mask)
            tree = TreeInfo(mask=tree_mask, conv_index=tree_conv_index(parents, self.config.linear_conv_kernel_dim))
            visible_new = tree_mask
            if positions is None:
                positions = past + tree_mask.sum(1) - 1  # depth below the committed prefix
        else:
            visible_new = None if t == 1 else torch.ones(t, t, dtype=torch.bool).tril_()
        if positions is None:
            positions = torch.arange(past, past + t)
        mask = AttentionMask(past, visible_new, None, self.attention_kernel)
        if visible_new is not None and self.attention_kernel is None:
            visible = torch.cat([torch.ones(t, past, dtype=torch.bool), visible_new], dim=1)
            mask.additive = additive_mask(visible, self.config.num_heads // self.config.num_kv_heads, self.dtype)
        cos, sin = self.rope(positions, self.dtype)
        x = self.embed_tokens(tokens)
        captured = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, self.cache, self.attn_slot.get(i), tree)
            if i in capture_layers:
                captured[i] = x
        self.cache.pending = t
        self._last_mask = tree_mask
        features = None
        if capture_layers:
            if len(captured) != len(capture_layers):
                raise ValueError(f"capture_layers {capture_layers} must be distinct indices below {len(self.layers)}")
            features = torch.cat([captured[i] for i in capture_layers], dim=-1)
        logits = None
        if logits_rows is None or logits_rows.numel():
            h = x if logits_rows is None else x[logits_rows]
            logits = self.logits(self.norm(h))
        return ForwardOutput(logits=logits, features=features)

    def commit(self, rows: torch.Tensor) -> None:
        """Accept rows of the last forward forming a root-to-node path (a prefix for a chain)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        if self.cache.pending == 0:
            raise RuntimeError("commit without a forward to commit")
        a = rows.numel()
        if a:
            if self._last_mask is None:
                expected = torch.arange(a)
            else:
                if int(rows[-1]) >= self._last_mask.shape[0] or int(rows[-1]) < 0:
                    raise ValueError(f"commit row {int(rows[-1])} is outside the last forward's {self.cache.pending} rows")
                expected = self._last_mask[int(rows[-1])].nonzero().flatten()
            if not torch.equal(rows, expected):
                raise ValueError(f"commit rows {rows.tolist()} are not the root-to-node path {expected.tolist()}")
        self.cache.commit(rows)
        for gdn in self.gdn_layers():
            if a:
                gdn.commit(rows, defer=self.defer_gdn_commit)
            else:
                gdn._pending = None  # nothing accepted: the committed state stays as it was

    def prefill(self, tokens: torch.Tensor, capture_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """Run and commit a whole prompt; logits of the last token only."""
        out = self.forward(tokens, capture_layers=capture_layers, logits_rows=torch.tensor([tokens.shape[0] - 1]))
        self.commit(torch.arange(tokens.shape[0]))
        return out


def build_hybrid_model(hf_config, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> HybridModel:
    """The loader hook (`drafttree.load`): config + safetensors tensors with Hugging Face names."""
    from .hybrid_weights import to_hybrid_state_dict
    from .weights import load_checked

    cfg = HybridConfig.from_hf(hf_config)
    model = load_checked(HybridModel, cfg, to_hybrid_state_dict(tensors, cfg), dtype)
    for gdn in model.gdn_layers():
        gdn.reset_state()
    return model.eval()
