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
    """cos/sin of rotate-half RoPE, precomputed for every position up to max_positions (or, with
    `precompute=False`, computed for the positions asked for: the same bits, elementwise in float64, without
    a table of max_positions x rotary_dim floats, 67 MB for Gemma 3's 32 k positions of 256 dimensions)."""

    def __init__(self, rotary_dim: int, theta: float, max_positions: int, precompute: bool = True):
        super().__init__()
        self.max_positions = max_positions
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        if precompute:
            cos, sin = self._cos_sin(torch.arange(max_positions))
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        else:
            self.cos = self.sin = None

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos().float(), emb.sin().float()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if int(positions.max()) >= self.max_positions:
            raise ValueError(f"position {int(positions.max())} exceeds the model's maximum {self.max_positions - 1}")
        if self.cos is None:
            cos, sin = self._cos_sin(positions)
            return cos.to(dtype), sin.to(dtype)
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


class GeGLU(nn.Module):
    """Gemma's MLP: gelu_tanh(gate) * up, gate/up fused into one matmul. Elementwise torch ops on every path (no
    fused C++ form yet), which round each element alike whatever the number of rows: a tree row gets the bits of
    the one-token step."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down(F.gelu(gate.contiguous(), approximate="tanh") * up)


@dataclass
class AttentionMask:
    """What the T new rows of one forward see: every committed key, and among the new keys `tree`."""

    past: int  # committed keys, all visible
    tree: torch.Tensor | None  # bool [T, T] among the new keys; None: causal
    additive: torch.Tensor | None  # [group*T, past+T] for the matmul path (None: nothing masked)
    kernel_isa: str | None = None  # run the batch-invariant C++ kernel (ops.attention) with this ISA
    # a sliding-window layer on the kernel path, where the window hides some key from some row: per new row, the
    # cache rows it sees (a slice, or their indices), each row then its own kernel call; None: one call, as above
    window_keys: list | None = None


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: AttentionMask,
           scale: float | None = None) -> torch.Tensor:
    """Grouped-query attention with the query heads sharing a KV head stacked on the row axis:
    q [kv_heads, group*T, d], keys/values [kv_heads, past+T, d] -> [kv_heads, group*T, d]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if mask.kernel_isa is not None:
        from drafttree.ops.attention import tree_attention

        return tree_attention(q, keys, values, mask.past, mask.tree, scale, mask.kernel_isa)
    scores = torch.matmul(q, keys.transpose(1, 2)) * scale
    if mask.additive is not None:
        scores = scores + mask.additive
    probs = scores.float().softmax(-1).to(values.dtype)
    return torch.matmul(probs, values)
