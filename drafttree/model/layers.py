"""Small building blocks shared by the target models and the drafter."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class FusedKernel:
    """A module with a fused C++ form (ops.pointwise, ops.attention): model.linear.use_cpu_kernels sets its ISA."""

    kernel_isa: str | None = None


class KernelAttention:
    """A model whose attention runs the batch-invariant C++ kernel once use_cpu_kernels sets its ISA."""

    attention_kernel: str | None = None


class StackedLayers:
    """A model whose layers run as one C++ call (ops.decoder.DecoderStack) once use_cpu_kernels builds it."""

    decoder_stack = None


class RMSNorm(FusedKernel, nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernel_isa: str | None = None  # one C++ call (ops.pointwise) on the int8 path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_isa is not None and x.dtype == torch.float32:
            from drafttree.ops.pointwise import rms_norm

            return rms_norm(x, self.weight, self.eps, self.kernel_isa)
        # Normalise in fp32 (as transformers does), cast back before the weight.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryTable(nn.Module):
    """cos/sin of rotate-half RoPE, precomputed for every position up to max_positions."""

    def __init__(self, rotary_dim: int, theta: float, max_positions: int):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
        emb = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if int(positions.max()) >= self.cos.shape[0]:
            raise ValueError(f"position {int(positions.max())} exceeds the model's maximum {self.cos.shape[0] - 1}")
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D] with cos/sin [T, D] (rotate-half layout, as Hugging Face checkpoints use)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class SwiGLU(FusedKernel, nn.Module):
    """gate/up fused into one matmul: one GEMM instead of two on the decode hot path."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down = nn.Linear(intermediate, hidden, bias=bias)
        self.kernel_isa: str | None = None  # silu(gate) * up in one C++ call on the int8 path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_isa is not None and x.dim() == 2:
            from drafttree.ops.pointwise import silu_mul

            return self.down(silu_mul(self.gate_up(x), self.kernel_isa))
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down(F.silu(gate) * up)


@dataclass
class AttentionMask:
    """What the T new rows of one forward see: every committed key, and among the new keys `tree`."""

    past: int  # committed keys, all visible
    tree: torch.Tensor | None  # bool [T, T] among the new keys; None: causal
    additive: torch.Tensor | None  # [group*T, past+T] for the matmul path (None: nothing masked)
    kernel_isa: str | None = None  # run the batch-invariant C++ kernel (ops.attention) with this ISA


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """Grouped-query attention with the query heads sharing a KV head stacked on the row axis:
    q [kv_heads, group*T, d], keys/values [kv_heads, past+T, d] -> [kv_heads, group*T, d]."""
    d = q.shape[-1]
    if mask.kernel_isa is not None:
        from drafttree.ops.attention import tree_attention

        return tree_attention(q, keys, values, mask.past, mask.tree, d**-0.5, mask.kernel_isa)
    scores = torch.matmul(q, keys.transpose(1, 2)) * d**-0.5
    if mask.additive is not None:
        scores = scores + mask.additive
    probs = scores.float().softmax(-1).to(values.dtype)
    return torch.matmul(probs, values)
