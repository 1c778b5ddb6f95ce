"""Tiny random llama / qwen2 / qwen3 / gemma3 models written as GGUF files by the tests themselves (gguf.GGUFWriter), in any
of the types drafttree reads, with a small real tokenizer in the metadata; and the reference every test compares
against: a transformers model on the file's weights as gguf.quants.dequantize reads them."""
from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import torch

from drafttree.apps.bench.random_gguf import Q4_K_M  # llama.cpp's types for Q4_K_M (the tests import it from here)

# K-quants need rows that are a multiple of 256 weights: hidden 256, intermediate 512, 4 heads of 64
SHAPE = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, head_dim=64, context=512, eps=1e-6,
             theta=10000.0)
VOCAB = 1024  # the first 1024 tokens of SmolLM2's byte-level BPE (special tokens, the 256 bytes, early merges)
WEIGHT_STD = 0.15  # random weights large enough that greedy choices are well separated

# gemma3: 6 layers, so that the sixth is global (llama.cpp's pattern: every 6th layer) and five slide a window of 8
GEMMA3 = dict(layers=6, window=8, theta=1e6)


@cache
def small_tokenizer_fields() -> dict:
    """Tokenizer metadata cut from the embedded SmolLM2 file: its first VOCAB tokens and the merges among them."""
    import gguf

    from drafttree.gguf_convert import find_embedded_gguf

    r = gguf.GGUFReader(str(find_embedded_gguf("smollm2-135m-instruct")))
    tokens = r.fields["tokenizer.ggml.tokens"].contents()[:VOCAB]
    known = set(tokens)
    merges = [m for m in r.fields["tokenizer.ggml.merges"].contents()
              if (lambda a, b: a in known and b in known and a + b in known)(*m.split(" "))]
    return dict(tokens=tokens, types=r.fields["tokenizer.ggml.token_type"].contents()[:VOCAB], merges=merges,
                template=r.fields["tokenizer.chat_template"].contents())


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row order llama.cpp's converter gives llama's q/k (interleaved RoPE pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def undo_llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_quant(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid K-quant bytes with weights of about WEIGHT_STD (drafttree.apps.bench.random_gguf)."""
    from drafttree.apps.bench.random_gguf import random_k_quant as drawn

    return drawn(type_name, rows, cols, rng, WEIGHT_STD)


def encode(w: np.ndarray, type_name: str, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    """(array, raw_dtype) for GGUFWriter.add_tensor: a float matrix in one of the file types."""
    import gguf
    from gguf.quants import quantize

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "F32":
        return w.astype(np.float32), None
    if type_name == "F16":
        return w.astype(np.float16), None
    if type_name in ("Q4_K", "Q5_K", "Q6_K"):
        return random_k_quant(type_name, *w.shape, rng), qtype
    if type_name in ("Q2_K", "Q3_K"):  # types drafttree refuses: their bytes are never read, random ones do
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        return rng.integers(0, 256, size=(w.shape[0], w.shape[1] // block * nbytes), dtype=np.uint8), qtype
    return quantize(w.astype(np.float32), qtype), qtype


def write_tiny_gguf(path, arch: str = "llama", weight_type: str = "Q8_0", seed: int = 0, types: dict | None = None,
                    tied: bool | None = None, drop_keys: tuple[str, ...] = (), extra_keys: dict | None = None,
                    tokenizer: bool = True) -> Path:
    """A random `arch` model with every matrix in `weight_type` (norms F32; `types` overrides per tensor kind,
    e.g. Q4_K_M). llama ties the embedding to the head, qwen2/qwen3 have an output matrix (unless `tied`)."""
    import gguf

    path = Path(path)
    s, types = dict(SHAPE), dict(types or {})
    if arch == "gemma3":
        s.update(layers=GEMMA3["layers"], theta=GEMMA3["theta"])
    rng = np.random.default_rng(seed)
    tied = arch in ("llama", "gemma3") if tied is None else tied
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch} {weight_type}")
    w.add_block_count(s["layers"])
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["intermediate"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_dimension_count(s["head_dim"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_rope_freq_base(s["theta"])
    w.add_vocab_size(VOCAB)
    if arch == "gemma3":
        w.add_uint32("gemma3.attention.sliding_window", GEMMA3["window"])
    if tokenizer:
        tok = small_tokenizer_fields()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tok["tokens"])
        w.add_token_types(tok["types"])
        w.add_token_merges(tok["merges"])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(2)
        if arch == "gemma3":  # transformers builds a gemma3 file's tokenizer as SentencePiece, which needs an unknown
            w.add_unk_token_id(0)  # token for text the byte-level vocabulary cut here does not cover
        w.add_add_bos_token(False)
        w.add_chat_template(tok["template"])
    for key, value in (extra_keys or {}).items():
        w.add_string(key, value) if isinstance(value, str) else w.add_uint32(key, value)

    def matrix(name: str, kind: str, rows: int, cols: int, permute_heads: int | None = None):
        m = rng.normal(0, WEIGHT_STD, size=(rows, cols)).astype(np.float32)
        if permute_heads:
            m = llama_cpp_permute(m, permute_heads)
        arr, raw_dtype = encode(m, types.get(kind, weight_type), rng)
        w.add_tensor(name, arr, raw_dtype=raw_dtype)

    def vector(name: str, n: int, around: float):
        w.add_tensor(name, (around + rng.normal(0, 0.1, size=n)).astype(np.float32))

    hd, q_rows, kv_rows = s["head_dim"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    matrix("token_embd.weight", "token_embd", VOCAB, s["hidden"])
    if not tied:
        matrix("output.weight", "output", VOCAB, s["hidden"])
    vector("output_norm.weight", s["hidden"], 1.0)
    for i in range(s["layers"]):
        b = f"blk.{i}"
        vector(f"{b}.attn_norm.weight", s["hidden"], 1.0)
        vector(f"{b}.ffn_norm.weight", s["hidden"], 1.0)
        matrix(f"{b}.attn_q.weight", "attn_q", q_rows, s["hidden"], s["heads"] if arch == "llama" else None)
        matrix(f"{b}.attn_k.weight", "attn_k", kv_rows, s["hidden"], s["kv_heads"] if arch == "llama" else None)
        matrix(f"{b}.attn_v.weight", "attn_v", kv_rows, s["hidden"])
        matrix(f"{b}.attn_output.weight", "attn_output", s["hidden"], q_rows)
        matrix(f"{b}.ffn_gate.weight", "ffn_gate", s["intermediate"], s["hidden"])
        matrix(f"{b}.ffn_up.weight", "ffn_up", s["intermediate"], s["hidden"])
        matrix(f"{b}.ffn_down.weight", "ffn_down", s["hidden"], s["intermediate"])
        if arch == "qwen2":
            for part, n in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
                vector(f"{b}.{part}.bias", n, 0.0)
        if arch in ("qwen3", "gemma3"):
            vector(f"{b}.attn_q_norm.weight", hd, 1.0)
            vector(f"{b}.attn_k_norm.weight", hd, 1.0)
        if arch == "gemma3":  # stored as llama.cpp's converter writes Gemma's norms: 1 + w
            vector(f"{b}.post_attention_norm.weight", s["hidden"], 1.0)
            vector(f"{b}.post_ffw_norm.weight", s["hidden"], 1.0)
    for key in drop_keys:
        for kv in w.kv_data:
            kv.pop(key, None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_HF_GEMMA3_NAMES = {**_HF_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def dequantized_reference(path, arch: str):
    """A transformers model (fp32) on the file's weights as gguf.quants.dequantize gives them: the reference."""
    import gguf
    from gguf.quants import dequantize
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    s = SHAPE
    if arch == "gemma3":
        return _gemma3_reference(path)
    reader = gguf.GGUFReader(str(path))
    state = {}
    for t in reader.tensors:
        x = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(t.shape[::-1].tolist())
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            state["model.embed_tokens.weight"] = x
        elif t.name == "output.weight":
            state["lm_head.weight"] = x
        elif t.name == "output_norm.weight":
            state["model.norm.weight"] = x
        else:
            layer, kind, what = parts[1], parts[2], parts[3]
            if arch == "llama" and kind in ("attn_q", "attn_k"):
                x = undo_llama_cpp_permute(x, s["heads"] if kind == "attn_q" else s["kv_heads"])
            state[f"model.layers.{layer}.{_HF_NAMES[kind]}.{what}"] = x
    tied = "lm_head.weight" not in state
    common = dict(vocab_size=VOCAB, hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                  num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                  head_dim=s["head_dim"], max_position_embeddings=s["context"], rms_norm_eps=s["eps"],
                  rope_theta=s["theta"], tie_word_embeddings=tied)
    model = {"llama": lambda: LlamaForCausalLM(LlamaConfig(**common)),
             "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**common)),
             "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**common))}[arch]()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()}, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    return model.float().eval()


def _gemma3_reference(path):
    """transformers' Gemma3ForCausalLM on the file's weights: its own sliding-window masks, GeGLU, (1 + w) norms
    (the file's norms less the 1 llama.cpp's converter adds), embedding scale and per-layer-type RoPE."""
    import gguf
    from gguf.quants import dequantize
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    s = {**SHAPE, **GEMMA3}
    state = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        x = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(t.shape[::-1].tolist())
        if t.name.endswith("norm.weight"):
            x = x - 1.0
        if t.name == "token_embd.weight":
            state["model.embed_tokens.weight"] = x
        elif t.name == "output_norm.weight":
            state["model.norm.weight"] = x
        else:
            _, layer, kind, what = t.name.split(".")
            state[f"model.layers.{layer}.{_HF_GEMMA3_NAMES[kind]}.{what}"] = x
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
        max_position_embeddings=s["context"], rms_norm_eps=s["eps"], query_pre_attn_scalar=s["head_dim"],
        sliding_window=s["window"], layer_types=["full_attention" if i % 6 == 5 else "sliding_attention"
                                                 for i in range(s["layers"])],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": s["theta"]},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, attn_implementation="eager")
    model = Gemma3ForCausalLM(cfg)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()}, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    return model.float().eval()
