"""int8 weights × dynamic int8 activations: the reference in `naive.py`, the C++ kernel in `int8_linear.cpp`
(AVX-512 VNNI and AVX2 paths, chosen by the caller)."""
from __future__ import annotations

import torch

from drafttree.ops.cpu_extension import ISA_CODES, extension, kernel_error
from drafttree.ops.int8.naive import QMAX, int8_linear_ref, quantize_rows

PANEL = 16  # output columns per packed panel (int8_linear.cpp)


def pack_weight(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the kernel's layout [P, Kp/4, 16, 4]: panels of 16 columns, 4 consecutive k
    together; N padded to 16 and K to 4 with zeros."""
    n, k = q.shape
    np_, kp = -(-n // PANEL) * PANEL, -(-k // 4) * 4
    if (np_, kp) == (n, k):  # no padding: no padded copy (a 262 k-row embedding's would be 168 MB more at load)
        padded = q
    else:
        padded = torch.zeros(np_, kp, dtype=torch.int8)
        padded[:n, :k] = q
    return padded.view(np_ // PANEL, PANEL, kp // 4, 4).permute(0, 2, 1, 3).contiguous()


def unpack_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of pack_weight: int8 [N, K]."""
    p, kg = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(p * PANEL, kg * 4)[:n, :k]


def packed_rows(packed: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """Rows of the unpacked matrix (an embedding lookup) without unpacking the rest: int8 [len(rows), K]."""
    return packed[rows // PANEL, :, rows % PANEL, :].reshape(rows.numel(), -1)[:, :k]


def prepare_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (packed int8 weight, scale fp32 [N], column sums int32 [N])."""
    q, scale = quantize_rows(w)
    return pack_weight(q), scale, q.sum(dim=1, dtype=torch.int32)


def int8_linear(x: torch.Tensor, packed: torch.Tensor, ws: torch.Tensor, wsum: torch.Tensor,
                bias: torch.Tensor | None = None, isa: str = "avx2") -> torch.Tensor:
    """x [T, K] float32/bfloat16 -> [T, N] in x's dtype (N = ws.numel()); `isa` one of ISA_CODES."""
    return extension().int8_linear(x, packed, ws, wsum, bias, ws.numel(), ISA_CODES[isa])


__all__ = ["QMAX", "ISA_CODES", "PANEL", "extension", "int8_linear", "int8_linear_ref", "kernel_error",
           "pack_weight", "packed_rows", "prepare_weight", "quantize_rows", "unpack_weight"]
