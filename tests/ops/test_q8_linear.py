"""The 8-bit blocks (w = d·q + m per 32, q in 0..255) through the Q4_1 kernel's 8-bit form: against the float64
reference on every ISA path, batch invariance, every ISA the scalar bits, the layout's inverse, the quantizer."""
import pytest
import torch

from drafttree.ops.q4 import pack_q8, q4_linear_ref, q8_linear, quantize_q8_1, unpack_q8
from runtime_helpers import kernel_isas

ISAS = kernel_isas()


def full_range_blocks(n, k, gen):
    """Values over the whole 0..255 range (extremes included: the AVX2 path splits them into nibbles)."""
    q = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    q[:, :32] = 255
    d = (torch.rand(n, k // 32, generator=gen) * 0.002).half()
    return q, d, (-128 * d.float()).half()


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_matches_reference(isa):
    gen = torch.Generator().manual_seed(0)
    for t, k, n in [(1, 640, 640), (3, 64, 7), (16, 1536, 576), (5, 576, 1539), (9, 32, 40), (70, 96, 33)]:
        x = torch.randn(t, k, generator=gen)
        x[0, :32] = 127.0  # extreme inputs: a block of equal values quantizes to +127 everywhere
        for q, d, m in (full_range_blocks(n, k, gen), quantize_q8_1(torch.randn(n, k, generator=gen) * 0.05)):
            packed = pack_q8(q, d, m)
            for bias in (None, torch.randn(n, generator=gen)):
                out = q8_linear(x, *packed, bias, n, isa)
                want = q4_linear_ref(x, q, d, m, bias)
                assert torch.allclose(out, want, rtol=1e-5, atol=1e-4 * float(want.abs().max())), (t, k, n)


@pytest.mark.parametrize("isa", ISAS)
def test_a_row_does_not_depend_on_the_batch(isa):
    x, w = torch.randn(16, 576), torch.randn(300, 576) * 0.05
    packed = pack_q8(*quantize_q8_1(w))
    full = q8_linear(x, *packed, None, 300, isa)
    for i in range(16):
        assert torch.equal(q8_linear(x[i:i + 1], *packed, None, 300, isa)[0], full[i])


def test_every_isa_gives_the_scalar_bits():
    """The integer sums are exact on every path and the float epilogue runs in the same order."""
    x, w = torch.randn(5, 640), torch.randn(70, 640) * 0.05
    packed = pack_q8(*quantize_q8_1(w))
    want = q8_linear(x, *packed, None, 70, "scalar")
    for isa in ISAS:
        assert torch.equal(q8_linear(x, *packed, None, 70, isa), want), isa


def test_layout_inverse():
    """The reference path (model.linear.Q8Linear isa "reference") reads the weights back from the packed layout."""
    gen = torch.Generator().manual_seed(3)
    for n, k in [(16, 32), (7, 64), (33, 96)]:
        q, d, m = quantize_q8_1(torch.randn(n, k, generator=gen))
        assert all(torch.equal(a, b) for a, b in zip(unpack_q8(*pack_q8(q, d, m), n), (q, d, m))), (n, k)


def test_quantizer_is_within_half_a_step():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    q, d, m = quantize_q8_1(w)
    step = d.float().repeat_interleave(32, 1)
    back = d.float().repeat_interleave(32, 1) * q.float() + m.float().repeat_interleave(32, 1)
    # + the fp16 rounding of the block's minimum and step (times up to 255 steps)
    slack = 2**-11 * (255 * step + w.abs().amax(1, keepdim=True))
    assert ((back - w).abs() <= 0.5 * step + slack).all()
