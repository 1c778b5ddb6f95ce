"""Row-wise ops fused into one C++ call each (`pointwise.cpp`), references in `naive.py`."""
from __future__ import annotations

import torch

from drafttree.ops.cpu_extension import ISA_CODES, extension
from drafttree.ops.pointwise.naive import rms_norm_ref, silu_mul_ref


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, isa: str) -> torch.Tensor:
    return extension().rms_norm(x, w, eps, ISA_CODES[isa])


def silu_mul(gate_up: torch.Tensor, isa: str) -> torch.Tensor:
    """[T, 2n] -> [T, n]: silu(gate) * up."""
    return extension().silu_mul(gate_up, ISA_CODES[isa])


__all__ = ["rms_norm", "rms_norm_ref", "silu_mul", "silu_mul_ref"]
