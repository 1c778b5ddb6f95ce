"""Config of the hybrid Gated DeltaNet + gated-attention families (qwen3_next, qwen3_5 text)."""
from __future__ import annotations

from dataclasses import dataclass

from .config import plain_rope

HYBRID_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_text")
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class HybridConfig:
    family: str  # "qwen3_next" (fused, head-grouped GDN projections, MoE) or "qwen3_5" (flat projections)
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # gated attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # partial RoPE: the first rotary_dim channels of each head rotate
    rope_theta: float
    attention_bias: bool
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MLP / MoE
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf(cls, hf) -> "HybridConfig":
        mt = hf.model_type
        if mt not in HYBRID_FAMILIES:
            raise ValueError(f"unsupported architecture {mt!r}: the hybrid runtime supports {HYBRID_FAMILIES}")
        tie = bool(getattr(hf, "tie_word_embeddings", False))
        if mt == "qwen3_5":  # multimodal wrapper: the language model's config is nested
            hf = hf.get_text_config()
            tie = tie or bool(getattr(hf, "tie_word_embeddings", False))
        family = "qwen3_next" if mt == "qwen3_next" else "qwen3_5"
        if hf.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hf.hidden_act!r}: only 'silu' is supported")
        rope, theta = plain_rope(hf)
        # Qwen3.5's multi-section RoPE gives the T/H/W sections their own positions; for text all three
        # are the token position, so it reduces to plain (partial) RoPE and mrope_section does not matter.
        partial = float(rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)))
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        rotary_dim = int(head_dim * partial)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"partial_rotary_factor {partial} gives an invalid rotary dim {rotary_dim} for head_dim {head_dim}")
        n = hf.num_hidden_layers
        layer_types = tuple(hf.layer_types)
        if len(layer_types) != n or any(t not in LAYER_TYPES for t in layer_types):
            raise ValueError(f"layer_types must list {n} entries from {LAYER_TYPES}, got {list(layer_types)}")
        if hf.linear_num_value_heads % hf.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({hf.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({hf.linear_num_key_heads})"
            )
        if hf.num_attention_heads % hf.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        moe = {}
        if family == "qwen3_next" and getattr(hf, "num_experts", 0) > 0:
            moe = dict(
                num_experts=hf.num_experts,
                num_experts_per_tok=hf.num_experts_per_tok,
                moe_intermediate_size=hf.moe_intermediate_size,
                shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
                norm_topk_prob=bool(hf.norm_topk_prob),
                decoder_sparse_step=hf.decoder_sparse_step,
                mlp_only_layers=tuple(hf.mlp_only_layers or ()),
            )
            if not 0 < hf.num_experts_per_tok <= hf.num_experts:
                raise ValueError(f"num_experts_per_tok must be in [1, num_experts], got {hf.num_experts_per_tok}")
        return cls(
            family=family,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=n,
            layer_types=layer_types,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=tie,
            max_position_embeddings=hf.max_position_embeddings,
            num_heads=hf.num_attention_heads,
            num_kv_heads=hf.num_key_value_heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=float(theta),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            linear_num_key_heads=hf.linear_num_key_heads,
            linear_num_value_heads=hf.linear_num_value_heads,
            linear_key_head_dim=hf.linear_key_head_dim,
            linear_value_head_dim=hf.linear_value_head_dim,
            linear_conv_kernel_dim=hf.linear_conv_kernel_dim,
            intermediate_size=hf.intermediate_size,
            **moe,
        )
