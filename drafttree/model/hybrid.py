"""Hybrid Gated DeltaNet / gated-attention decoder (qwen3_next, qwen3_5 text) for the runtime.

Same interface as `transformer.Transformer`: `forward(state, ...)` runs new tokens (a chain or a tree
given by its ancestor mask and parents) without advancing the committed state; `commit(state, rows)`
accepts a root-to-node path.
Attention layers write K/V to scratch rows of the KV cache; GDN layers verify the whole tree with
one masked triangular solve per layer and fold the accepted path into their state at commit.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from drafttree.ops.conv import chain_conv_index, tree_conv_index
from drafttree.ops.gdn.tree import check_ancestor_mask, parents_from_mask

from .decoder import CausalLM, ForwardOutput
from .gdn_layer import CHAIN_SOLVE_MAX, GatedDeltaNet, TreeInfo
from .hybrid_blocks import GatedAttention, SparseMoE, ZeroCenteredRMSNorm
from .hybrid_config import HybridConfig
from .kv_cache import KVCache, check_room
from .layers import AttentionMask, RotaryTable, SwiGLU
from .state import ModelState
from .transformer import additive_mask


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

    def forward(self, x, cos, sin, mask, cache, slot, tree, gdn_state):
        h = self.input_norm(x)
        h = self.attn(h, cos, sin, mask, cache, slot) if self.kind == "full_attention" else self.gdn(h, tree, gdn_state)
        x = x + h
        return x + self.mlp(self.post_norm(x))


class HybridModel(CausalLM):
    config: HybridConfig

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.attn_slot = {layer: slot for slot, layer in enumerate(cfg.attention_layers)}
        self.gdn_slot = {layer: slot for slot, layer in enumerate(i for i, k in enumerate(cfg.layer_types)
                                                                  if k == "linear_attention")}
        self.defer_gdn_commit = False  # fold accepted GDN paths at the start of the next forward
        self.attention_kernel: str | None = None  # ISA of the batch-invariant attention kernel (int8 path)

    def init_rope(self) -> None:
        cfg = self.config
        self.rope = RotaryTable(cfg.rotary_dim, cfg.rope_theta, cfg.max_position_embeddings)

    def gdn_layers(self) -> list[GatedDeltaNet]:
        return [layer.gdn for layer in self.layers if layer.kind == "linear_attention"]

    def _new_state(self, max_len: int) -> ModelState:
        cfg = self.config
        kv = KVCache(len(self.attn_slot), cfg.num_kv_heads, cfg.head_dim, max_len, self.dtype)
        return ModelState(kv, [gdn.new_state() for gdn in self.gdn_layers()])

    def _tree_mask(self, past: int, t: int, tree_mask: torch.Tensor) -> torch.Tensor:
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
        state: ModelState,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        capture_layers: tuple[int, ...] = (),
        logits_rows: torch.Tensor | None = None,
        parents: torch.Tensor | None = None,  # [T]: the tree's parents (derived from the mask when not given)
    ) -> ForwardOutput:
        t, past = tokens.shape[0], check_room(state.kv, tokens.shape[0])
        tree = None
        if tree_mask is not None:
            tree_mask = self._tree_mask(past, t, tree_mask)
            if parents is None:
                parents = parents_from_mask(tree_mask)
            tree = TreeInfo(mask=tree_mask, conv_index=tree_conv_index(parents, self.config.linear_conv_kernel_dim))
            visible_new = tree_mask
            if positions is None:
                positions = past + tree_mask.sum(1) - 1  # depth below the committed prefix
        else:
            visible_new = None if t == 1 else torch.ones(t, t, dtype=torch.bool).tril_()
            if t <= CHAIN_SOLVE_MAX:  # a decode step or a short chain: the GDN layers run it as a one-branch tree,
                # whose conv is a gather (a depthwise conv1d call costs ~0.3 ms a layer for one token)
                tree = TreeInfo(mask=torch.ones(t, t, dtype=torch.bool).tril_(),
                                conv_index=chain_conv_index(t, self.config.linear_conv_kernel_dim))
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
            gdn_state = state.gdn[self.gdn_slot[i]] if i in self.gdn_slot else None
            x = layer(x, cos, sin, mask, state.kv, self.attn_slot.get(i), tree, gdn_state)
            if i in capture_layers:
                captured[i] = x
        state.kv.pending = t
        state.last_tree_mask = tree_mask
        return self._output(x, captured, capture_layers, logits_rows)

    def commit(self, state: ModelState, rows: torch.Tensor) -> None:
        """Accept rows of the last forward forming a root-to-node path (a prefix for a chain)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        if state.kv.pending == 0:
            raise RuntimeError("commit without a forward to commit")
        a = rows.numel()
        if a:
            last_mask = state.last_tree_mask
            if last_mask is None:
                expected = torch.arange(a)
            else:
                if int(rows[-1]) >= last_mask.shape[0] or int(rows[-1]) < 0:
                    raise ValueError(f"commit row {int(rows[-1])} is outside the last forward's {state.kv.pending} rows")
                expected = last_mask[int(rows[-1])].nonzero().flatten()
            if not torch.equal(rows, expected):
                raise ValueError(f"commit rows {rows.tolist()} are not the root-to-node path {expected.tolist()}")
        state.kv.commit(rows)
        for gdn, st in zip(self.gdn_layers(), state.gdn):
            gdn.commit(st, rows, defer=self.defer_gdn_commit)


def build_hybrid_model(hf_config, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> HybridModel:
    """The loader hook (`drafttree.load`): config + safetensors tensors with Hugging Face names."""
    from .hybrid_weights import to_hybrid_state_dict
    from .weights import load_checked

    cfg = HybridConfig.from_hf(hf_config)
    return load_checked(HybridModel, cfg, to_hybrid_state_dict(tensors, cfg), dtype).eval()
