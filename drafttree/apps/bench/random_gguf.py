"""Random-weight GGUF files at a model's published shape (bench/scale.py) and valid random K-quant bytes (the tests'
tiny files): what runs, and what it costs, without the weights — gguf-py has no K-quant quantizer, so the bytes are
drawn directly (values and sub-block scales at random, the fp16 super-block scales set for a chosen weight std)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

# where each K-quant block keeps its fp16 scales (d, and dmin where the type has one)
K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, None)}
# Q4_K_M as llama.cpp makes it: most matrices Q4_K, attn_v / ffn_down / the output Q6_K
Q4_K_M = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K", "token_embd": "Q4_K"}
# published configurations (Qwen3 model cards / config.json): layers, hidden, intermediate, heads, kv heads, vocab
QWEN3_SHAPES = {"qwen3-0.6b": (28, 1024, 3072, 16, 8, 151936), "qwen3-1.7b": (28, 2048, 6144, 16, 8, 151936),
                "qwen3-4b": (36, 2560, 9728, 32, 8, 151936), "qwen3-8b": (36, 4096, 12288, 32, 8, 151936)}


# z-lab's Qwen3-4B-DFlash-b16 layout (../shared/design anchors: 5 draft layers at the target's width, 537 M parameters
# besides the target's embedding and head; mask id 151669, a padding row of the target's embedding)
QWEN3_4B_DFLASH = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=5, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, target_layer_ids=[1, 9, 17, 25, 33],
                       block_size=16, mask_token_id=151669, rope_theta=1e6)


def random_drafter(layout: dict, std: float = 0.02, seed: int = 0):
    """A DFlash drafter in a published layout with random weights (fp32; `methods.load_drafter_for`'s quantization
    is the caller's)."""
    import torch

    from ...drafter.model import DFlashConfig, DFlashDrafter

    torch.manual_seed(seed)
    drafter = DFlashDrafter(DFlashConfig(**layout))
    drafter.reset_parameters(std=std)
    return drafter.eval()


def random_k_quant(type_name: str, rows: int, cols: int, rng: np.random.Generator, std: float) -> np.ndarray:
    """Valid K-quant bytes [rows, bytes per row] whose weights have about `std`."""
    import gguf
    from gguf.quants import dequantize

    qtype = gguf.GGMLQuantizationType[type_name]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, nbytes), dtype=np.uint8)
    d_at, dmin_at = K_SCALES[type_name]
    jitter = rng.uniform(0.5, 1.5, size=raw.shape[0]).astype(np.float16)
    for at in (d_at, dmin_at):
        if at is not None:
            raw[:, at:at + 2] = jitter.view(np.uint8).reshape(-1, 2)
    sample = raw[: min(len(raw), 4096)]  # the scale from a sample of blocks: a big matrix is not dequantized whole
    scale = std / dequantize(sample, qtype).std()
    for at in (d_at, dmin_at):
        if at is not None:
            raw[:, at:at + 2] = (jitter * np.float16(scale)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def write_random_qwen3(path: str | Path, shape: str | tuple[int, ...], seed: int = 0, std: float = 0.02) -> Path:
    """A Qwen3 model at a published shape (a QWEN3_SHAPES name, or its tuple) in Q4_K_M's types with random weights,
    and a tokenizer llama.cpp accepts: SmolLM2's byte-level BPE (its 49,152 tokens and merges), padded with unused
    tokens to the shape's vocabulary (at least 49,152)."""
    import gguf

    from ...gguf_convert import find_embedded_gguf
    from ...model.gguf_model import open_gguf

    layers, hidden, inter, heads, kv_heads, vocab = QWEN3_SHAPES[shape] if isinstance(shape, str) else shape
    head_dim = 128
    rng = np.random.default_rng(seed)
    src = open_gguf(find_embedded_gguf("smollm2-135m-instruct"))
    tokens = list(src.fields["tokenizer.ggml.tokens"].contents())
    types = list(src.fields["tokenizer.ggml.token_type"].contents())
    tokens += [f"<unused_{i}>" for i in range(vocab - len(tokens))]
    types += [int(gguf.TokenType.UNUSED)] * (vocab - len(types))
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_name(f"random {shape} Q4_K_M")
    for add, value in ((w.add_block_count, layers), (w.add_context_length, 4096), (w.add_embedding_length, hidden),
                       (w.add_feed_forward_length, inter), (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                       (w.add_key_length, head_dim), (w.add_value_length, head_dim),
                       (w.add_rope_dimension_count, head_dim), (w.add_vocab_size, vocab)):
        add(value)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(src.fields["tokenizer.ggml.merges"].contents()))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)

    def matrix(name: str, kind: str, rows: int, cols: int):
        type_name = Q4_K_M.get(kind, "Q4_K")
        qtype = gguf.GGMLQuantizationType[type_name]
        w.add_tensor(name, random_k_quant(type_name, rows, cols, rng, std), raw_dtype=qtype)

    def vector(name: str, n: int):
        w.add_tensor(name, (1.0 + rng.normal(0, 0.1, size=n)).astype(np.float32))

    matrix("token_embd.weight", "token_embd", vocab, hidden)
    matrix("output.weight", "output", vocab, hidden)
    vector("output_norm.weight", hidden)
    for i in range(layers):
        b = f"blk.{i}"
        for name, n in (("attn_norm", hidden), ("ffn_norm", hidden), ("attn_q_norm", head_dim),
                        ("attn_k_norm", head_dim)):
            vector(f"{b}.{name}.weight", n)
        for kind, rows, cols in (("attn_q", heads * head_dim, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                 ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, heads * head_dim),
                                 ("ffn_gate", inter, hidden), ("ffn_up", inter, hidden), ("ffn_down", hidden, inter)):
            matrix(f"{b}.{kind}.weight", kind, rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
