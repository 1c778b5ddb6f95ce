"""GGUF Q4_1 weights run as the file stores them, times per-row int8 activations: the reference and the
block format in `naive.py`, the C++ kernel (AVX-512 VNNI / AVX2 / scalar) in `q4_linear.cpp`."""
from __future__ import annotations

import torch

from drafttree.ops.cpu_extension import ISA_CODES, extension
from drafttree.ops.q4.naive import (dequantize_q4_1, pack_q4, q4_linear_ref, quantize_q4_1, unpack_gguf_q4_1,
                                   unpack_q4)


def q4_linear(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None,
              n_out: int, isa: str) -> torch.Tensor:
    """x [T, K] float32 and packed (q, d, m) from pack_q4 -> [T, n_out]."""
    return extension().q4_linear(x, q, d, m, bias, n_out, ISA_CODES[isa])


__all__ = ["dequantize_q4_1", "pack_q4", "q4_linear", "q4_linear_ref", "quantize_q4_1", "unpack_gguf_q4_1", "unpack_q4"]
