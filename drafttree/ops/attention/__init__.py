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


__all__ = ["rope_tree_attention", "rope_tree_attention_batched", "tree_attention", "tree_attention_ref", "visible_keys"]


def rope_tree_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, past: int, visible: torch.Tensor | None, n_heads: int, n_kv: int,
                        isa: str, q_norm=None, k_norm=None, scale: float | None = None) -> torch.Tensor:
    """The attention half of a layer in one call: optional per-head RMSNorm (q_norm/k_norm modules, qwen3),
    RoPE on q/k of qkv [T, (Hq+2Hkv)·d], k/v written to the cache rows [past, past+T) of
    k_cache/v_cache [Hkv, Lmax, d], then tree_attention -> [T, Hq·d]."""
    d = k_cache.shape[-1]
    eps = q_norm.eps if q_norm is not None else 0.0
    scale = d**-0.5 if scale is None else scale
    return extension().rope_tree_attention(qkv, cos, sin, k_cache, v_cache, past, visible, n_heads, n_kv, scale,
                                           None if q_norm is None else q_norm.weight,
                                           None if k_norm is None else k_norm.weight, eps, ISA_CODES[isa])


def rope_tree_attention_batched(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments, layer: int,
                                n_heads: int, n_kv: int, isa: str, q_norm=None, k_norm=None) -> torch.Tensor:
    """`rope_tree_attention` over the rows of several requests in one call, each against its own cache:
    segments are (first row, end row, past, visible [T, T] or None, KVCache) in row order. A request's
    rows get the bits `rope_tree_attention` gives them alone."""
    d = segments[0][4].k[layer].shape[-1]
    eps = q_norm.eps if q_norm is not None else 0.0
    return extension().rope_tree_attention_batched(
        qkv, cos, sin, [s[4].k[layer] for s in segments], [s[4].v[layer] for s in segments],
        [s[2] for s in segments], [s[3] for s in segments], [s[1] for s in segments], n_heads, n_kv, d**-0.5,
        None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight, eps, ISA_CODES[isa])
