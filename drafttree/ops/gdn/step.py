"""One Gated DeltaNet decode step (one token, one layer) in one C++ call (`gdn_step.cpp`): everything the
layer computes between its in- and out-projections (conv + silu, l2-normalised q̂ / k̂, the gates, the state
update, the gated RMSNorm). It reads the committed conv context and recurrent state and returns fresh ones,
which the layer's commit swaps in.

The layer's composed PyTorch ops stay the reference (`USE_STEP = False` routes the model back through them);
`gdn_step_reference` is the same step as plain PyTorch in the inputs' dtype (fp64: the tests' oracle).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from drafttree.ops.cpu_extension import ISA_CODES, extension, kernel_error

# The model's switch: False runs the one-token step through the composed PyTorch ops (the reference).
USE_STEP = True


@functools.cache
def step_available() -> bool:
    return kernel_error() is None


def gdn_step(proj, conv_wt, conv_ctx, A_log, dt_bias, norm_w, S0, num_key_heads: int, norm_eps: float,
             isa: str = "scalar"):
    """proj [1, C + Hv·dv + 2·Hv] (the in-projection's row: [q | k | v | z | b | a]), conv_wt [K, C] (the conv
    weight transposed), conv_ctx [K-1, C], A_log / dt_bias [Hv], norm_w [dv], S0 [Hv, dk, dv], all fp32 on CPU.
    Returns (y [1, Hv·dv]: the out-projection's input, the new conv context [K-1, C], the new state S₁);
    conv_ctx and S0 are not written."""
    if isa not in ISA_CODES:
        raise ValueError(f"unknown isa {isa!r}; one of {sorted(ISA_CODES)}")
    if proj.ndim == 2 and proj.shape[0] != 1:
        raise ValueError(f"gdn_step runs one token: proj must be [1, width], got {tuple(proj.shape)}")
    return extension().gdn_step(proj.contiguous(), conv_wt.contiguous(), conv_ctx.contiguous(), A_log.contiguous(),
                                dt_bias.contiguous(), norm_w.contiguous(), S0.contiguous(), int(num_key_heads),
                                float(norm_eps), ISA_CODES[isa])


def gdn_step_reference(proj, conv_weight, conv_ctx, A_log, dt_bias, norm_w, S0, num_key_heads: int, norm_eps: float):
    """The same step in plain PyTorch, in the dtype of the inputs: the causal conv over [context; token], the
    token-by-token gated delta rule (naive.recurrent_gated_delta_rule), the gated norm. conv_weight is [C, K]
    (the layer's layout). Returns what `gdn_step` returns."""
    from drafttree.ops.gdn.naive import prepare_qk, recurrent_gated_delta_rule

    Hv, dk, dv = S0.shape
    Hk = num_key_heads
    key_dim, value_dim = Hk * dk, Hv * dv
    C = conv_weight.shape[0]
    proj = proj.reshape(-1)
    x, z, b, a = proj.split([C, value_dim, Hv, Hv])
    E = torch.cat([conv_ctx, x[None]], dim=0)                           # [K, C]
    mixed = F.silu((E.t() * conv_weight).sum(-1))
    q, k, v = mixed.split([key_dim, key_dim, value_dim])
    q, k = prepare_qk(q.view(Hk, 1, dk), k.view(Hk, 1, dk), dtype=proj.dtype)
    beta = b.sigmoid()[:, None]
    g = (-A_log.exp() * F.softplus(a + dt_bias))[:, None]
    o, S1 = recurrent_gated_delta_rule(q, k, v.view(Hv, 1, dv), g, beta, S0)
    o = o[:, 0]                                                          # [Hv, dv]
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + norm_eps)
    y = (norm_w * o * F.silu(z.view(Hv, dv))).reshape(1, value_dim)
    return y, E[1:].clone(), S1
