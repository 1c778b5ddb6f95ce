"""A llama/qwen3 decoder stack in one C++ call (`decoder_stack.cpp`) on the kernel paths (int8 / q4): the same
kernels in the same order as the Python layer loop of model/transformer.py, which is its reference (the same
bits, tests/ops/test_decoder_stack.py), without the Python module calls between them."""
from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import torch

from drafttree.ops.cpu_extension import ISA_CODES, extension

_NONE = torch.empty(0)


@runtime_checkable
class StackLinear(Protocol):
    """A linear layer the C++ stack can run (model.linear's Int8Linear, Q4Linear and Q8Linear)."""

    isa: str

    def stack_tensors(self) -> tuple[list[torch.Tensor], int, int] | None:
        """(tensors, kind: 0 int8 / 1 Q4_1 / 2 8-bit blocks, n_out) in decoder_stack.cpp's order (the last, the bias, may be None),
        or None (a reference path)."""


def _linear_tensors(linear) -> tuple[list[torch.Tensor], int, int] | None:
    found = linear.stack_tensors() if isinstance(linear, StackLinear) else None
    if found is None:
        return None
    tensors, kind, n_out = found
    return [_NONE if t is None else t for t in tensors], kind, n_out  # the C++ side reads "none" as empty


class StackLayer(NamedTuple):
    """What one decoder layer brings to the stack (each model names its modules its own way): the norms, the
    attention module (n_heads, n_kv, head_dim, q_norm, k_norm), the MLP module (kernel_isa) and the four linears
    (None where the layer has no fused form)."""

    input_norm: object
    post_norm: object
    attn: object
    qkv: object
    o: object
    mlp: object
    gate_up: object
    down: object


class DecoderStack:
    """Decoder layers as one kernel call; `of(model)` is None where they do not fit it (a float path, a reference
    linear, mixed ISAs), and the model keeps its layer loop. The cache is anything with k/v [layers, Hkv, Lmax, d]:
    a target's KVCache, a drafter's DraftContext (its block's rows are scratch rows after the context)."""

    def __init__(self, layers: list[list[torch.Tensor]], meta: list[int], isa: str, n_heads: int, n_kv: int,
                 scale: float, norm_eps: float, qk_norm_eps: float):
        self.layers, self.meta, self.isa = layers, meta, ISA_CODES[isa]
        self.n_heads, self.n_kv, self.scale, self.norm_eps, self.qk_norm_eps = n_heads, n_kv, scale, norm_eps, qk_norm_eps

    @classmethod
    def of(cls, model) -> "DecoderStack | None":
        """The stack of `model.stack_layers()` (a Transformer's decoder layers, a DFlash drafter's) on the model's
        attention kernel ISA; None where they do not fit it."""
        isa = model.attention_kernel
        if isa is None or model.dtype != torch.float32:
            return None
        parts = model.stack_layers()
        if not parts:
            return None
        layers, meta, eps, qk_eps = [], [], set(), set()
        for p in parts:
            attn = p.attn
            if {p.input_norm.kernel_isa, p.post_norm.kernel_isa, p.mlp.kernel_isa} != {isa}:
                return None
            if (attn.q_norm is None) != (attn.k_norm is None):
                return None
            tensors = [p.input_norm.weight, p.post_norm.weight,
                       _NONE if attn.q_norm is None else attn.q_norm.weight,
                       _NONE if attn.k_norm is None else attn.k_norm.weight]
            for linear in (p.qkv, p.o, p.gate_up, p.down):
                found = None if linear is None else _linear_tensors(linear)
                if found is None or linear.isa != isa:
                    return None
                tensors += found[0]
                meta += found[1:]
            layers.append([t.detach() for t in tensors])
            eps |= {p.input_norm.eps, p.post_norm.eps}
            if attn.q_norm is not None:
                qk_eps |= {attn.q_norm.eps, attn.k_norm.eps}
        if len(eps) != 1 or len(qk_eps) > 1:
            return None
        a = parts[0].attn
        return cls(layers, meta, isa, a.n_heads, a.n_kv, a.head_dim**-0.5, eps.pop(), qk_eps.pop() if qk_eps else 0.0)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, past: int,
                 tree: torch.Tensor | None, capture_layers) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """x [T, hidden] -> (hidden after the last layer, {layer: hidden after it} for capture_layers)."""
        capture = sorted(set(capture_layers))
        out = extension().decoder_stack(x, self.layers, self.meta, cos, sin, cache.k, cache.v, past, tree,
                                        self.n_heads, self.n_kv, self.scale, self.norm_eps, self.qk_norm_eps,
                                        capture, self.isa)
        return out[0], dict(zip(capture, out[1:]))

    def many(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments,
             capture_layers) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Several requests' rows (a batched verify): segments are (end row, past, tree mask or None, cache) in row
        order; the linears run once over all rows, attention per request against its own cache (each row gets the
        bits it gets alone). Returns as __call__."""
        capture = sorted(set(capture_layers))
        out = extension().decoder_stack_batched(x, self.layers, self.meta, cos, sin, [s[3].k for s in segments],
                                                [s[3].v for s in segments], [s[1] for s in segments],
                                                [s[2] for s in segments], [s[0] for s in segments], self.n_heads,
                                                self.n_kv, self.scale, self.norm_eps, self.qk_norm_eps, capture,
                                                self.isa)
        return out[0], dict(zip(capture, out[1:]))
