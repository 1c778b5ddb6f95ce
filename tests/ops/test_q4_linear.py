"""The Q4_1 kernel against its float64 reference, its batch invariance, and the GGUF block format."""
import pytest
import torch

from drafttree.ops.q4 import dequantize_q4_1, pack_q4, q4_linear, q4_linear_ref, quantize_q4_1, unpack_gguf_q4_1
from runtime_helpers import kernel_isas

ISAS = kernel_isas()


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_matches_reference(isa):
    gen = torch.Generator().manual_seed(0)
    for t, k, n in [(1, 576, 576), (3, 64, 7), (16, 1536, 576), (5, 576, 1539), (9, 32, 40), (70, 96, 33)]:
        x, w = torch.randn(t, k, generator=gen), torch.randn(n, k, generator=gen) * 0.05
        q, d, m = quantize_q4_1(w)
        packed = pack_q4(q, d, m)
        for bias in (None, torch.randn(n, generator=gen)):
            out = q4_linear(x, *packed, bias, n, isa)
            assert torch.allclose(out, q4_linear_ref(x, q, d, m, bias), rtol=1e-5, atol=1e-5), (t, k, n)


@pytest.mark.parametrize("isa", ISAS)
def test_a_row_does_not_depend_on_the_batch(isa):
    x, w = torch.randn(16, 576), torch.randn(300, 576) * 0.05
    packed = pack_q4(*quantize_q4_1(w))
    full = q4_linear(x, *packed, None, 300, isa)
    for i in range(16):
        assert torch.equal(q4_linear(x[i:i + 1], *packed, None, 300, isa)[0], full[i])


def test_quantizer_is_within_half_a_step():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    q, d, m = quantize_q4_1(w)
    step = d.float().repeat_interleave(32, 1)
    # + fp16 rounding of the block's scale (times up to 15 steps) and minimum: ~16 * 2^-11 of the block's range
    slack = 16 * 2**-11 * (15 * step + w.abs().amax(1, keepdim=True))
    assert ((dequantize_q4_1(q, d, m) - w).abs() <= 0.5 * step + slack).all() and int(q.max()) <= 15


def test_gguf_blocks_unpack_as_gguf_dequantizes_them():
    """Our reading of the shipped file's Q4_1 bytes gives exactly gguf-py's dequantized weights."""
    import gguf

    from drafttree.gguf_convert import find_embedded_gguf

    reader = gguf.GGUFReader(str(find_embedded_gguf("smollm2-135m-instruct")))
    t = next(t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q4_1)
    ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(t.data.shape[0], -1)
    assert torch.equal(dequantize_q4_1(*unpack_gguf_q4_1(t.data)), torch.from_numpy(ref).float())


def test_unpack_inverts_the_kernel_layout():
    """The reference path (model.linear.Q4Linear isa "reference") reads the weights back from the packed layout."""
    from drafttree.ops.q4 import unpack_q4

    for n, k in [(16, 32), (7, 64), (33, 96)]:
        q, d, m = quantize_q4_1(torch.randn(n, k, generator=torch.Generator().manual_seed(n)))
        back = unpack_q4(*pack_q4(q, d, m), n)
        assert all(torch.equal(a, b) for a, b in zip(back, (q, d, m))), (n, k)


@pytest.mark.parametrize("isa", ISAS)
def test_weight_prefetch_changes_no_bit(isa):
    """The int8 / q4 / 8-bit-block kernels' software prefetch (kernels.h: weight_prefetch_bytes, from 2 rows on) only
    moves weights into cache early: every distance, none included, gives the same bits on every path."""
    from drafttree.ops.cpu_extension import extension
    from drafttree.ops.int8 import int8_linear, prepare_weight
    from drafttree.ops.q4 import pack_q8, q8_linear

    ext = extension()
    default = ext.weight_prefetch(-1)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(300, 576, generator=gen) * 0.05
    q4, q8, i8 = pack_q4(*quantize_q4_1(w)), pack_q8(*quantize_q4_1(w)), prepare_weight(w)
    try:
        for t in (1, 3, 8, 9, 20):
            x = torch.randn(t, 576, generator=gen)
            outs = []
            for distance in (0, 64, 4096, default):
                ext.weight_prefetch(distance)
                outs.append((q4_linear(x, *q4, None, 300, isa), q8_linear(x, *q8, None, 300, isa),
                             int8_linear(x, *i8, None, isa)))
            for other in outs[1:]:
                assert all(torch.equal(a, b) for a, b in zip(outs[0], other)), t
    finally:
        ext.weight_prefetch(default)
