"""Attention of a few new rows against a KV cache: reference in `naive.py`, the batch-invariant C++ kernel
in `tree_attention.cpp` (each row over exactly its visible keys, in order)."""
from __future__ import annotations

import torch

from drafttree.ops.attention.naive import tree_attention_ref, visible_keys
from drafttree.ops.cpu_extension import ISA_CODES, extension


def tree_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: int,
                   visible: torch.Tensor | None, scale: float, isa: str = "avx2") -> torch.Tensor:
    """q [Hkv, G*T, d] float32; keys/values [Hkv, past+T, d] (KV-cache slices); visible bool [T, T] or None."""
    return extension().tree_attention(q, keys, values, past, visible, scale, ISA_CODES[isa])


__all__ = ["tree_attention", "tree_attention_ref", "visible_keys"]
