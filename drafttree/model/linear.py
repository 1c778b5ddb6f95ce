"""Linear layers per compute path, swapped in after loading (quantization as a module swap, as in gpt-fast).

`int8`: weights int8 per output row, activations quantized per row on the fly, integer dot products
(drafttree.ops.int8). Everything around the matmuls (norms, RoPE, attention, KV cache) stays fp32.
A tied embedding shares the LM head's int8 rows, so the model holds each weight once, in 8 bits.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from drafttree.ops.int8 import int8_linear, int8_linear_ref, pack_weight, packed_rows, prepare_weight, unpack_weight
from drafttree.ops.q4 import (pack_q4, pack_q8, q4_linear, q4_linear_ref, q8_linear, quantize_q4_1,
                              unpack_q4, unpack_q8)

from .arena import pack_weights
from .layers import FusedKernel, KernelAttention, StackedLayers


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

    @classmethod
    def from_int8(cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                  isa: str = "avx2") -> "Int8Linear":
        """From rows already quantized as ops.int8.quantize_rows makes them (a GGUF's tensors, converted a few
        rows at a time): the float matrix never exists in full."""
        layer = cls(torch.zeros(1, q.shape[1]), bias, isa)  # a one-row placeholder, replaced below
        layer.out_features = q.shape[0]
        layer.weight_packed = pack_weight(q)
        layer.weight_scale = scale.float().contiguous()
        # row sums a few thousand rows at a time: a sum to int32 widens its input first (Gemma 3's 262 k-row
        # embedding: a 670 MB temporary)
        layer.weight_sum = torch.cat([rows.sum(dim=1, dtype=torch.int32) for rows in q.split(4096)])
        return layer

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
        pack_weights(sub)  # read every drafted round, like the model's own weights
        return sub

    def stack_tensors(self) -> tuple[list[torch.Tensor], int, int] | None:
        """(tensors, kind 0, n_out) as ops.decoder's C++ stack reads an int8 layer (bias None when it has none);
        None for the reference path."""
        if self.isa == "reference":
            return None
        return [self.weight_packed, self.weight_scale, self.weight_sum, self.bias], 0, self.out_features

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, isa={self.isa}"


class Q4Linear(nn.Module):
    """Drop-in for nn.Linear with GGUF Q4_1 weights (w = d·q + m per block of 32, as the file stores them)
    and int8 activations per block of 32 (drafttree.ops.q4)."""

    kind, buffer = 1, "weight_q4"  # kind: how ops.decoder's C++ stack names the layer's kernel
    pack, unpack, kernel = staticmethod(pack_q4), staticmethod(unpack_q4), staticmethod(q4_linear)

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None,
                 isa: str = "avx2"):
        super().__init__()
        self.out_features, self.in_features = q.shape
        packed_q, packed_d, packed_m = self.pack(q, d, m)
        self.register_buffer(self.buffer, packed_q)  # uint8 [N/16, K/8, 16, 4], two nibbles a byte (8-bit: K/4)
        self.register_buffer("weight_d", packed_d)   # fp16 [N/16, K/32, 16] block scales
        self.register_buffer("weight_m", packed_m)   # fp16 [N/16, K/32, 16] block minimums
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.isa = isa  # "scalar" | "avx2" | "avx512_vnni" | "reference" (ops.q4.naive, float64 sums)

    @property
    def packed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return getattr(self, self.buffer), self.weight_d, self.weight_m

    @classmethod
    def from_linear(cls, linear: nn.Linear, isa: str) -> "Q4Linear":
        return cls(*quantize_q4_1(linear.weight.detach()), linear.bias, isa)

    def stack_tensors(self) -> tuple[list[torch.Tensor], int, int] | None:
        """(tensors, kind, n_out) as ops.decoder's C++ stack reads a block layer (bias None when it has none);
        None for the reference path."""
        if self.isa == "reference":
            return None
        return [*self.packed, self.bias], self.kind, self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.isa == "reference":
            y = q4_linear_ref(flat, *self.unpack(*self.packed, self.out_features), self.bias)
        else:
            y = self.kernel(flat, *self.packed, self.bias, self.out_features, self.isa)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, isa={self.isa}"


class Q8Linear(Q4Linear):
    """8-bit blocks of 32 (w = d·q + m, q in 0..255) on the same kernel: GGUF's Q8_0 / Q5_0 / Q5_1 tensors as the file
    stores them, other types requantized per block (model.gguf_model)."""

    kind, buffer = 2, "weight_q8"
    pack, unpack, kernel = staticmethod(pack_q8), staticmethod(unpack_q8), staticmethod(q8_linear)


class Int8TiedEmbedding(nn.Module):
    """Token embedding read from the int8 LM head it is tied to (rows dequantized on lookup)."""

    def __init__(self, head: Int8Linear, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.head, self.dtype = head, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self.head.dequantized(flat).to(self.dtype).view(*ids.shape, -1)


def quantize_linears(module: nn.Module, isa: str, q4: dict[str, tuple] | bool = False, prefix: str = "") -> nn.Module:
    """Replace every nn.Linear below `module` (in place; returns `module`) by an Int8Linear, or with `q4`
    by a Q4Linear: from the given GGUF blocks {module name: (q, d, m)}, or (True) quantized here."""
    for name, child in module.named_children():
        full = f"{prefix}{name}"
        if isinstance(child, nn.Linear):
            if isinstance(q4, dict) and full in q4:
                new = Q4Linear(*q4[full], child.bias, isa)
            elif q4 is True and child.in_features % 32 == 0:
                new = Q4Linear.from_linear(child, isa)
            else:
                new = Int8Linear.from_linear(child, isa)
            setattr(module, name, new)
        else:
            quantize_linears(child, isa, q4, full + ".")
    return module


def quantize_target(model: nn.Module, isa: str, q4: dict[str, tuple] | bool = False) -> nn.Module:
    """A quantized target: the LM head int8 (a tied embedding shares its rows), every other linear int8,
    or Q4_1 with `q4` (see quantize_linears)."""
    if model.lm_head is None:  # tied: one int8 copy serves as head and as embedding
        model.lm_head = Int8Linear(model.embed_tokens.weight.float(), None, isa)
        model.embed_tokens = Int8TiedEmbedding(model.lm_head)
    elif isinstance(model.lm_head, nn.Linear):  # int8 even with q4: a reduced draft vocabulary slices its rows
        model.lm_head = Int8Linear.from_linear(model.lm_head, isa)
    quantize_linears(model, isa, q4)
    use_cpu_kernels(model, isa)
    return model


def use_cpu_kernels(model: nn.Module, isa: str) -> nn.Module:
    """Route norms, SwiGLU and attention through the fused C++ ops (fewer calls per decode step) and the
    batch-invariant attention kernel (a tree row rounds exactly as the one-token step does)."""
    kernel = "avx512_vnni" if isa == "avx512_vnni" else "avx2" if isa == "avx2" else "scalar"
    for m in model.modules():
        if isinstance(m, FusedKernel):  # norms, MLPs and attention that have a fused C++ form
            m.kernel_isa = kernel
    if isinstance(model, KernelAttention):
        model.attention_kernel = kernel
    pack_weights(model)  # before the stack takes its views: every weight it streams on 2 MB pages
    if isinstance(model, StackedLayers):
        from drafttree.ops.decoder import DecoderStack

        model.decoder_stack = DecoderStack.of(model)
    return model


def head_rows_source(model: nn.Module) -> torch.Tensor | Int8Linear:
    """What a reduced vocabulary slices rows from: the int8 head layer, or the float head weight."""
    if isinstance(model.lm_head, Int8Linear):
        return model.lm_head
    return model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
