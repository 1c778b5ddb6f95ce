"""Linear layers per compute path, swapped in after loading (quantization as a module swap, as in gpt-fast).

`int8`: weights int8 per output row, activations quantized per row on the fly, integer dot products
(drafttree.ops.int8). Everything around the matmuls (norms, RoPE, attention, KV cache) stays fp32.
A tied embedding shares the LM head's int8 rows, so the model holds each weight once, in 8 bits.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from drafttree.ops.int8 import int8_linear, int8_linear_ref, pack_weight, packed_rows, prepare_weight, unpack_weight


class Int8Linear(nn.Module):
    """Drop-in for nn.Linear: y = x·Wᵀ + b with int8 W (per-row scale) and per-row int8 x."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, isa: str = "avx2"):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed, scale, row_sum = prepare_weight(weight.detach())
        self.register_buffer("weight_packed", packed)  # int8 [N/16, K/4, 16, 4] (ops.int8.pack_weight)
        self.register_buffer("weight_scale", scale)    # [N] fp32
        self.register_buffer("weight_sum", row_sum)    # [N] int32, for the VNNI kernel's unsigned inputs
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.isa = isa  # "scalar" | "avx2" | "avx512_vnni" | "reference" (the plain-PyTorch naive path)

    @classmethod
    def from_linear(cls, linear: nn.Linear, isa: str) -> "Int8Linear":
        return cls(linear.weight.float(), linear.bias, isa)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.isa == "reference":
            y = int8_linear_ref(flat, self.weight_int8(), self.weight_scale, self.bias)
        else:
            y = int8_linear(flat, self.weight_packed, self.weight_scale, self.weight_sum, self.bias, self.isa)
        return y.view(*x.shape[:-1], self.out_features)

    def weight_int8(self) -> torch.Tensor:
        """The unpacked int8 weight [N, K]."""
        return unpack_weight(self.weight_packed, self.out_features, self.in_features)

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 weight rows [n, K] (all rows when `rows` is None): what the integer path multiplies by."""
        if rows is None:
            return self.weight_int8().float() * self.weight_scale[:, None]
        return packed_rows(self.weight_packed, rows, self.in_features).float() * self.weight_scale[rows, None]

    def select_rows(self, rows: torch.Tensor) -> "Int8Linear":
        """The same layer restricted to some output rows (a reduced draft vocabulary's head)."""
        sub = Int8Linear(torch.zeros(rows.numel(), self.in_features), None, self.isa)
        sub.weight_packed = pack_weight(packed_rows(self.weight_packed, rows, self.in_features))
        sub.weight_scale, sub.weight_sum = self.weight_scale[rows].contiguous(), self.weight_sum[rows].contiguous()
        sub.bias = None if self.bias is None else self.bias[rows].contiguous()
        return sub

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, isa={self.isa}"


class Int8TiedEmbedding(nn.Module):
    """Token embedding read from the int8 LM head it is tied to (rows dequantized on lookup)."""

    def __init__(self, head: Int8Linear, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.head, self.dtype = head, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self.head.dequantized(flat).to(self.dtype).view(*ids.shape, -1)


def quantize_linears(module: nn.Module, isa: str) -> nn.Module:
    """Replace every nn.Linear below `module` by an Int8Linear (in place; returns `module`)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear.from_linear(child, isa))
        else:
            quantize_linears(child, isa)
    return module


def quantize_target(model: nn.Module, isa: str) -> nn.Module:
    """int8 target: every linear, the LM head, and a tied embedding sharing the head's rows."""
    if model.lm_head is None:  # tied: one int8 copy serves as head and as embedding
        model.lm_head = Int8Linear(model.embed_tokens.weight.float(), None, isa)
        model.embed_tokens = Int8TiedEmbedding(model.lm_head)
    quantize_linears(model, isa)
    model.attention_kernel = isa  # batch-invariant attention: a tree row rounds as the one-token step does
    return model


def head_rows_source(model: nn.Module) -> torch.Tensor | Int8Linear:
    """What a reduced vocabulary slices rows from: the int8 head layer, or the float head weight."""
    if isinstance(model.lm_head, Int8Linear):
        return model.lm_head
    return model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
