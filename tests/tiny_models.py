"""Tiny random-weight checkpoints built from transformers configs (unit tests only)."""
import torch

CONFIGS = {
    "llama": dict(family="llama", num_key_value_heads=2, tie_word_embeddings=True),
    "llama_untied_bias": dict(family="llama", num_key_value_heads=4, tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
    "qwen3": dict(family="qwen3", num_key_value_heads=2, tie_word_embeddings=False, head_dim=16),
}


def make_tiny_checkpoint(kind: str, path, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    spec = dict(CONFIGS[kind])
    family = spec.pop("family")
    common = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, eos_token_id=None, bos_token_id=None,
                  pad_token_id=None)
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, **spec))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, **spec))
    # random weights give near-uniform logits; scale up so argmax decisions are well separated
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.3 if p.ndim > 1 else 0.1)
    model.eval()
    model.save_pretrained(path)
    return model
