"""The few config fields the runtime needs, read from a Hugging Face config (transformers parses config.json)."""
from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_DENSE = ("llama", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # qwen3: per-head RMSNorm on q and k before RoPE

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        mt = hf.model_type
        if mt not in SUPPORTED_DENSE:
            raise ValueError(f"unsupported architecture {mt!r}: the dense runtime supports {SUPPORTED_DENSE}")
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported rope scaling {rope_type!r}: only plain RoPE ('default') is supported")
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", None))
        if theta is None:
            raise ValueError("config has no rope_theta")
        if getattr(hf, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported by the runtime")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return cls(
            model_type=mt,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=mt == "qwen3",
        )
