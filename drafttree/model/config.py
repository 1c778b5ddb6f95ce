"""The few config fields the runtime needs, read from a Hugging Face config (transformers parses config.json)."""
from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_DENSE = ("llama", "qwen3")


def plain_rope(hf) -> tuple[dict, float]:
    """(rope parameters, rope_theta) of a transformers config, refusing RoPE scalings the runtime lacks."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"unsupported rope scaling {rope_type!r}: only plain RoPE ('default') is supported")
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", None))
    if theta is None:
        raise ValueError("config has no rope_theta")
    return rope, theta


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
    qk_norm: bool = False  # qwen3, gemma3: per-head RMSNorm on q and k before RoPE
    # Gemma 3 (the defaults are llama's / qwen's)
    sliding_window: int = 0  # a sliding-window layer's query at position p sees keys at p - sliding_window < j <= p
    sliding_layers: tuple[bool, ...] = ()  # per layer: True for a sliding-window (local) layer; () none
    rope_theta_local: float = 0.0  # the sliding-window layers' RoPE base
    attention_scale: float = 0.0  # what q·k is multiplied by (0: head_dim ** -0.5)
    embed_scale: float = 1.0  # the embedded tokens are multiplied by this (gemma3: sqrt(hidden_size))
    mlp_activation: str = "silu"  # "silu": SwiGLU; "gelu_tanh": GeGLU (gemma3)
    sandwich_norms: bool = False  # gemma3: an RMSNorm on the attention's output and on the MLP's, before the residual

    @property
    def plain_layers(self) -> bool:
        """Every layer the llama/qwen3 shape (what the C++ decoder stack and the batched verify run)."""
        return (not self.sliding_layers and not self.sandwich_norms and self.mlp_activation == "silu"
                and self.embed_scale == 1.0 and self.attention_scale in (0.0, self.head_dim ** -0.5))

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        mt = hf.model_type
        if mt not in SUPPORTED_DENSE:
            raise ValueError(f"unsupported architecture {mt!r}: the dense runtime supports {SUPPORTED_DENSE}")
        _, theta = plain_rope(hf)
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
