"""Reference for the Q4_1 kernel, and the GGUF Q4_1 block format: unpacking a GGUF tensor's bytes,
quantizing float weights the way llama.cpp does, packing for the kernel.

Q4_1 block of 32 weights: fp16 d, fp16 m, 16 bytes of nibbles (weight j in the low nibble of byte j,
weight j + 16 in the high nibble); w = d * q + m with q in 0..15.

The same kernel runs 8-bit blocks (w = d * q + m, q in 0..255; `pack_q8`): GGUF's Q8_0 / Q5_0 / Q5_1 blocks carried
over exactly (drafttree.model.gguf_model), anything else quantized per block of 32 (`quantize_q8_1`).
"""
from __future__ import annotations

import numpy as np
import torch

from drafttree.ops.int8.naive import quantize_rows

BLOCK = 32
BLOCK_BYTES = 20


def unpack_gguf_q4_1(raw: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF Q4_1 tensor's bytes [N, K/32 * 20] -> q uint8 [N, K], d fp16 [N, K/32], m fp16 [N, K/32]."""
    raw = np.asarray(raw, dtype=np.uint8)
    n, nb = raw.shape[0], raw.shape[1] // BLOCK_BYTES
    blocks = raw.reshape(n, nb, BLOCK_BYTES)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
    m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0]
    qs = blocks[:, :, 4:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, nb * BLOCK)
    return torch.from_numpy(q.copy()), torch.from_numpy(d.copy()), torch.from_numpy(m.copy())


def quantize_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float weights [N, K] (K a multiple of 32) -> (q, d, m) as llama.cpp's Q4_1 quantizer makes them."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"Q4_1 needs in_features divisible by {BLOCK}, got {k}")
    b = w.float().reshape(n, k // BLOCK, BLOCK)
    lo, hi = b.amin(-1), b.amax(-1)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = ((b - lo[..., None]) * inv[..., None] + 0.5).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), d.half(), lo.half()


def quantize_q8_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float weights [N, K] -> (q uint8 [N, K], d, m fp16 [N, K/32]) with w ≈ d·q + m: each block of 32 between its
    minimum and maximum in 255 steps (fp16 d and m, the rounding of q against them)."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"8-bit blocks need in_features divisible by {BLOCK}, got {k}")
    b = w.float().reshape(n, k // BLOCK, BLOCK)
    lo, hi = b.amin(-1).half(), b.amax(-1)
    d = ((hi - lo.float()) / 255).half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(hi))
    q = ((b - lo.float()[..., None]) * inv[..., None]).round().clamp(0, 255).to(torch.uint8)
    return q.reshape(n, k), d, lo


def dequantize_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (d.float().repeat_interleave(BLOCK, 1) * q.float() + m.float().repeat_interleave(BLOCK, 1))


PANEL = 16


def _padded_rows(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] with zero rows up to a multiple of PANEL."""
    n, k = q.shape
    qp = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=torch.uint8)
    qp[:n] = q
    return qp


def _scale_panels(s: torch.Tensor) -> torch.Tensor:
    """Per-block scales or offsets [N, K/32] -> fp16 [P, K/32, 16] (zero for the padding columns)."""
    n = s.shape[0]
    out = torch.zeros(-(-n // PANEL) * PANEL, s.shape[1], dtype=torch.float16)
    out[:n] = s
    return out.view(-1, PANEL, s.shape[1]).permute(0, 2, 1).contiguous()


def _scale_rows(packed: torch.Tensor, n: int) -> torch.Tensor:
    """_scale_panels' inverse (the padding rows dropped)."""
    return packed.permute(0, 2, 1).reshape(-1, packed.shape[1])[:n].contiguous()


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K], d, m [N, K/32]) -> the kernel's layout: q uint8 [P, K/8, 16, 4] (low nibble k = 8j..8j+3,
    high nibble k = 8j+4..8j+7), d and m fp16 [P, K/32, 16]; N padded to 16 with zero weights."""
    qp = _padded_rows(q)
    g = qp.view(qp.shape[0] // PANEL, PANEL, q.shape[1] // 8, 2, 4)
    packed = (g[:, :, :, 0] | (g[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
    return packed, _scale_panels(d), _scale_panels(m)


def pack_q8(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """8-bit (q [N, K], d, m [N, K/32]) -> the kernel's layout: q uint8 [P, K/4, 16, 4] (group 2j: k = 8j..8j+3,
    group 2j+1: k = 8j+4..8j+7, each column's 4 bytes together), d and m as pack_q4's."""
    qp = _padded_rows(q)
    packed = qp.view(qp.shape[0] // PANEL, PANEL, q.shape[1] // 4, 4).permute(0, 2, 1, 3).contiguous()
    return packed, _scale_panels(d), _scale_panels(m)


def unpack_q8(packed_q: torch.Tensor, packed_d: torch.Tensor, packed_m: torch.Tensor, n: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_q8's inverse (the padding rows dropped)."""
    p, k4 = packed_q.shape[:2]
    q = packed_q.permute(0, 2, 1, 3).reshape(p * PANEL, k4 * 4)[:n]
    return q.contiguous(), _scale_rows(packed_d, n), _scale_rows(packed_m, n)


def unpack_q4(packed_q: torch.Tensor, packed_d: torch.Tensor, packed_m: torch.Tensor, n: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_q4's inverse: the kernel's layout -> (q [n, K], d, m [n, K/32]), the padding rows dropped."""
    p, k8 = packed_q.shape[:2]
    q = torch.stack([packed_q & 15, packed_q >> 4], dim=3)  # [P, K/8, 16, 2, 4]
    q = q.permute(0, 2, 1, 3, 4).reshape(p * PANEL, k8 * 8)[:n]
    return q.contiguous(), _scale_rows(packed_d, n), _scale_rows(packed_m, n)


def q4_linear_ref(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = Σ_b sx_b · (d_b · Σ_{k∈b} q·xq + m_b · Σ_{k∈b} xq), the input quantized per block of 32, in
    float64 (the kernel sums in fp32); q 4- or 8-bit alike."""
    t, k = x.shape
    nb = k // BLOCK
    xq, sx = quantize_rows(x.reshape(t * nb, BLOCK))
    xb = xq.double().view(t, 1, nb, BLOCK)
    isum = (q.double().view(1, -1, nb, BLOCK) * xb).sum(-1)  # [T, N, nb], exact
    xsum = xb.sum(-1)  # [T, 1, nb]
    y = ((d.double()[None] * isum + m.double()[None] * xsum) * sx.double().view(t, 1, nb)).sum(-1).float()
    return y if bias is None else y + bias.float()
