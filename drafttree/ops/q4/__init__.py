"""GGUF Q4_1 weights run as the file stores them, times int8 activations per block of 32 (and the same for 8-bit
blocks): the reference and the block formats in `naive.py`, the C++ kernel (AVX-512 VNNI / AVX2 / scalar) in
`q4_linear.cpp`."""
from __future__ import annotations

import torch

from drafttree.ops.cpu_extension import ISA_CODES, extension
from drafttree.ops.q4.naive import (dequantize_q4_1, pack_q4, pack_q8, q4_linear_ref, quantize_q4_1,
                                   quantize_q8_1, unpack_gguf_q4_1, unpack_q4, unpack_q8)


def q4_linear(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None,
              n_out: int, isa: str) -> torch.Tensor:
    """x [T, K] float32 and packed (q, d, m) from pack_q4 -> [T, n_out]."""
    return extension().q4_linear(x, q, d, m, bias, n_out, ISA_CODES[isa])


def q8_linear(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None,
              n_out: int, isa: str) -> torch.Tensor:
    """x [T, K] float32 and packed 8-bit (q, d, m) from pack_q8 -> [T, n_out]."""
    return extension().q8_linear(x, q, d, m, bias, n_out, ISA_CODES[isa])


__all__ = ["dequantize_q4_1", "pack_q4", "pack_q8", "q4_linear", "q4_linear_ref", "q8_linear", "quantize_q4_1",
           "quantize_q8_1", "unpack_gguf_q4_1", "unpack_q4", "unpack_q8"]
