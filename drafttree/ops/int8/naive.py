"""Reference int8 linear: per-output-row int8 weights, per-input-row dynamic int8 activations.

    y[t, n] = float(Σ_k xq[t, k] · wq[n, k]) · (sx[t] · sw[n]) + bias[n]

The integer sum is exact, so a row's result does not depend on how many rows share the call: a
batched tree verify and a one-token step give the same numbers (the fast kernel computes exactly
these float operations in this order; tests compare bit for bit).
"""
from __future__ import annotations

import torch

QMAX = 127  # symmetric: -127..127, so |x|·|w| pairs never saturate 16-bit sums in the AVX2 kernel


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise symmetric int8: x [R, K] (any float dtype) -> (q int8 [R, K], scale fp32 [R])."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(x / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def int8_linear_ref(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] float; wq int8 [N, K] (unpacked); ws fp32 [N]; bias fp32 [N] or None -> y [T, N] in x's dtype."""
    xq, xs = quantize_rows(x)
    acc = (xq.double() @ wq.double().T).to(torch.int32)  # exact: |acc| < 2^53
    y = acc.float() * (xs[:, None] * ws[None, :])
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
