"""The quantized blocks of a llama GGUF file, keyed by the runtime's module names, for the q4 path:
Q4_1 matrices are used as the file stores them (rows of attn_q/attn_k put back in rotate-half order,
q/k/v and gate/up concatenated as the runtime fuses them)."""
from __future__ import annotations

from pathlib import Path

import torch

from drafttree.gguf_convert import _field, unpermute_rope_rows
from drafttree.ops.q4 import unpack_gguf_q4_1

# runtime module (in layer i) <- GGUF tensors (blk.i.*), concatenated along the output rows
_FUSED = {"attn.qkv": ("attn_q", "attn_k", "attn_v"), "attn.o": ("attn_output",),
          "mlp.gate_up": ("ffn_gate", "ffn_up"), "mlp.down": ("ffn_down",)}


def q4_1_blocks(path: str | Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """{"layers.{i}.attn.qkv": (q uint8 [N, K], d fp16 [N, K/32], m fp16 [N, K/32]), ...} for every fused
    matrix whose parts are all Q4_1 in the file (others are left to the int8 path)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    heads = {"attn_q": int(_field(reader, "llama.attention.head_count")),
             "attn_k": int(_field(reader, "llama.attention.head_count_kv"))}
    tensors = {t.name: t for t in reader.tensors}
    out = {}
    for i in range(int(_field(reader, "llama.block_count"))):
        for module, parts in _FUSED.items():
            found = [tensors.get(f"blk.{i}.{p}.weight") for p in parts]
            if any(t is None or t.tensor_type != gguf.GGMLQuantizationType.Q4_1 for t in found):
                continue
            pieces = []
            for part, t in zip(parts, found):
                q, d, m = unpack_gguf_q4_1(t.data)
                if part in heads:  # llama.cpp's interleaved-RoPE row order -> rotate-half (a row permutation)
                    q, d, m = (torch.from_numpy(unpermute_rope_rows(a.numpy(), heads[part]).copy()) for a in (q, d, m))
                pieces.append((q, d, m))
            out[f"layers.{i}.{module}"] = tuple(torch.cat(col) for col in zip(*pieces))
    return out
