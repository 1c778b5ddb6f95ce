"""A llama/qwen3 decoder stack in one C++ call (`decoder_stack.cpp`) on the kernel paths (int8 / q4): the same
kernels in the same order as the Python layer loop of model/transformer.py, which is its reference (the same
bits, tests/ops/test_decoder_stack.py), without the Python module calls between them."""
from __future__ import annotations

import torch

from drafttree.ops.cpu_extension import ISA_CODES, extension

_NONE = torch.empty(0)


def _linear_tensors(linear) -> tuple[list[torch.Tensor], int, int] | None:
    """(tensors, kind, n_out) of a kernel linear layer, or None for any other layer."""
    from drafttree.model.linear import Int8Linear, Q4Linear

    bias = _NONE if linear.bias is None else linear.bias
    if isinstance(linear, Q4Linear):
        return [linear.weight_q4, linear.weight_d, linear.weight_m, bias], 1, linear.out_features
    if isinstance(linear, Int8Linear) and linear.isa != "reference":
        return [linear.weight_packed, linear.weight_scale, linear.weight_sum, bias], 0, linear.out_features
    return None


class DecoderStack:
    """The decoder layers of a Transformer as one kernel call; `of(model)` is None where they do not fit it
    (a float path, a reference linear, mixed ISAs), and the model keeps its layer loop."""

    def __init__(self, layers: list[list[torch.Tensor]], meta: list[int], isa: str, n_heads: int, n_kv: int,
                 scale: float, norm_eps: float, qk_norm_eps: float):
        self.layers, self.meta, self.isa = layers, meta, ISA_CODES[isa]
        self.n_heads, self.n_kv, self.scale, self.norm_eps, self.qk_norm_eps = n_heads, n_kv, scale, norm_eps, qk_norm_eps

    @classmethod
    def of(cls, model) -> "DecoderStack | None":
        isa = model.attention_kernel
        if isa is None or model.dtype != torch.float32 or not len(model.layers):
            return None
        layers, meta, eps, qk_eps = [], [], set(), set()
        for layer in model.layers:
            attn, mlp = layer.attn, layer.mlp
            if {layer.input_norm.kernel_isa, layer.post_norm.kernel_isa, mlp.kernel_isa} != {isa}:
                return None
            if (attn.q_norm is None) != (attn.k_norm is None):
                return None
            tensors = [layer.input_norm.weight, layer.post_norm.weight,
                       _NONE if attn.q_norm is None else attn.q_norm.weight,
                       _NONE if attn.k_norm is None else attn.k_norm.weight]
            for linear in (attn.qkv, attn.o, mlp.gate_up, mlp.down):
                found = _linear_tensors(linear)
                if found is None or linear.isa != isa:
                    return None
                tensors += found[0]
                meta += found[1:]
            layers.append([t.detach() for t in tensors])
            eps |= {layer.input_norm.eps, layer.post_norm.eps}
            if attn.q_norm is not None:
                qk_eps |= {attn.q_norm.eps, attn.k_norm.eps}
        if len(eps) != 1 or len(qk_eps) > 1:
            return None
        a = model.layers[0].attn
        return cls(layers, meta, isa, a.n_heads, a.n_kv, a.head_dim**-0.5, eps.pop(), qk_eps.pop() if qk_eps else 0.0)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, past: int,
                 tree: torch.Tensor | None, capture_layers) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """x [T, hidden] -> (hidden after the last layer, {layer: hidden after it} for capture_layers)."""
        capture = sorted(set(capture_layers))
        out = extension().decoder_stack(x, self.layers, self.meta, cos, sin, cache.k, cache.v, past, tree,
                                        self.n_heads, self.n_kv, self.scale, self.norm_eps, self.qk_norm_eps,
                                        capture, self.isa)
        return out[0], dict(zip(capture, out[1:]))
