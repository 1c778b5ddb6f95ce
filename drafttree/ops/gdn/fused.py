"""The fused C++ tree verification (`gdn_tree.cpp`): same inputs and returns as the composed
`tree.tree_gated_delta_verify`, which stays the reference. fp32 on CPU; rows walk their ancestor lists.
Paths: AVX-512F, AVX2 + FMA (both take k̂S₀ / q̂S₀ from ATen's batched GEMM) and scalar (all plain loops)."""
from __future__ import annotations

import functools

import torch

from drafttree.compute import cpu_info
from drafttree.ops.cpu_extension import ISA_CODES, extension, kernel_error
from drafttree.ops.gdn.tree import GDNTreeStash, check_ancestor_mask, tree_gated_delta_verify


@functools.cache
def default_isa() -> str:
    """The widest path this CPU runs, honouring DRAFTTREE_ISA=avx2: AVX-512F (named "avx512_vnni" like the other
    kernels' code 2; this kernel needs only AVX-512F), AVX2 + FMA, else scalar."""
    info = cpu_info()
    if info.has("avx512f"):
        return "avx512_vnni"
    return "avx2" if info.has("avx2") and info.has("fma") else "scalar"


@functools.cache
def fused_available() -> bool:
    return kernel_error() is None


def _check(q, k, v, g, beta, initial_state, mask, check_mask: bool):
    if q.ndim < 3 or k.shape != q.shape:
        raise ValueError(f"q and k must share a shape [..., Hk, n, dk], got {tuple(q.shape)} and {tuple(k.shape)}")
    *lead, Hk, n, dk = q.shape
    if v.ndim != q.ndim or tuple(v.shape[:-3]) != tuple(lead) or v.shape[-2] != n:
        raise ValueError(f"v must be [..., Hv, n, dv] with q's leading dims and n = {n}, got {tuple(v.shape)}")
    Hv, dv = v.shape[-3], v.shape[-1]
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (*lead, Hv, n):
            raise ValueError(f"{name} must be [..., Hv, n] = {(*lead, Hv, n)}, got {tuple(t.shape)}")
    if tuple(initial_state.shape) != (*lead, Hv, dk, dv):
        raise ValueError(f"initial_state must be [..., Hv, dk, dv] = {(*lead, Hv, dk, dv)}, got {tuple(initial_state.shape)}")
    if mask.shape != (n, n):
        raise ValueError(f"mask must be [n, n] = ({n}, {n}), got {tuple(mask.shape)}")
    for t in (q, k, v, g, beta, initial_state, mask):
        if t.device.type != "cpu":
            raise ValueError("the fused GDN tree op runs on CPU tensors only")
    if check_mask:
        check_ancestor_mask(mask)


def tree_gated_delta_verify_fused(q, k, v, g, beta, initial_state, mask, isa: str | None = None,
                                  check_mask: bool = True):
    """`tree_gated_delta_verify` in one C++ pass per (batch, key head); computes in fp32.
    Returns (o [..., Hv, n, dv], GDNTreeStash) like the composed op. check_mask=False skips the O(n²)
    ancestor-mask check for callers whose mask comes from the tree builder (the model, per layer)."""
    _check(q, k, v, g, beta, initial_state, mask, check_mask)
    isa = default_isa() if isa is None else isa
    if isa not in ISA_CODES:
        raise ValueError(f"unknown isa {isa!r}; one of {sorted(ISA_CODES)}")
    *lead, Hk, n, dk = q.shape
    Hv, dv = v.shape[-3], v.shape[-1]
    f32 = lambda t, *shape: t.to(torch.float32).reshape(*shape).contiguous()  # noqa: E731
    k32 = k.to(torch.float32)
    o, u, gamma = extension().gdn_tree_verify(
        f32(q, -1, Hk, n, dk), f32(k32, -1, Hk, n, dk), f32(v, -1, Hv, n, dv), f32(g, -1, Hv, n),
        f32(beta, -1, Hv, n), f32(initial_state, -1, Hv, dk, dv), mask.to(torch.bool).contiguous(), ISA_CODES[isa])
    stash = GDNTreeStash(k=k32, u=u.reshape(*lead, Hv, n, dv), gamma=gamma.reshape(*lead, Hv, n), v=v, g=g, beta=beta)
    return o.reshape(*lead, Hv, n, dv), stash


# The model's switch: False routes every GDN layer through the composed reference instead.
USE_FUSED = True


def gdn_tree_verify(q, k, v, g, beta, initial_state, mask):
    """What the hybrid model calls: the fused op for fp32 CPU inputs when the kernels load, else the
    composed reference."""
    tensors = (q, k, v, g, beta, initial_state)
    if (USE_FUSED and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
            and fused_available()):
        return tree_gated_delta_verify_fused(q, k, v, g, beta, initial_state, mask, check_mask=False)
    return tree_gated_delta_verify(q, k, v, g, beta, initial_state, mask)
