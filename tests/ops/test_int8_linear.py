"""The int8 kernel against its plain-PyTorch reference: bit for bit, on every code path this CPU runs."""
import pytest
import torch

from drafttree.ops.int8 import (int8_linear, int8_linear_ref, pack_weight, packed_rows, prepare_weight, quantize_rows,
                                unpack_weight)
from runtime_helpers import kernel_isas

ISAS = kernel_isas()


@pytest.fixture(params=["vnni-loops", "amx-tiles"])
def amx(request):
    """Both AVX-512 paths where the CPU has AMX (ops/int8 uses its tiles from 2 rows on): the tiles switched
    off, then on; back to the default after. Elsewhere one pass (the tiles are skipped)."""
    from drafttree.ops.cpu_extension import extension

    ext = extension()
    want = int(request.param == "amx-tiles")
    if want and request.node.callspec.params.get("isa") != "avx512_vnni":
        pytest.skip("AMX tiles serve the avx512_vnni path only")
    if ext.amx_mode(want) != want:
        ext.amx_mode(-1)
        pytest.skip("no AMX tiles on this CPU")
    yield request.param
    ext.amx_mode(-1)


# (rows, K, N); the last two are weights of >= 2 MiB, which AVX-512 VNNI streams one panel at a time
# (16-row tiles: 17 rows leave a 1-row tile, N = 3650 a partial last panel)
# (AMX: K = 100 and 13 leave a tail below 64 bytes, 130 and 17 rows a partial row group, 1539 a partial panel group)
SHAPES = [(1, 576, 576), (3, 100, 7), (16, 1536, 576), (5, 576, 1539), (64, 2880, 200), (7, 13, 33), (130, 64, 40),
          (17, 576, 3650), (2, 576, 3650), (33, 96, 70)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference_bit_for_bit(isa, dtype, amx):
    gen = torch.Generator().manual_seed(0)
    for t, k, n in SHAPES:
        x = torch.randn(t, k, generator=gen).to(dtype)
        w = torch.randn(n, k, generator=gen) * 0.05
        packed, scale, sums = prepare_weight(w)
        q = unpack_weight(packed, n, k)
        for bias in (None, torch.randn(n, generator=gen)):
            assert torch.equal(int8_linear(x, packed, scale, sums, bias, isa), int8_linear_ref(x, q, scale, bias)), (t, k, n)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", [300, 3650])  # a small weight, and one big enough to be streamed
def test_a_row_does_not_depend_on_the_batch(isa, n, amx):
    """Integer sums: row i of a T-row call is the one-row call on row i (what makes tree verify lossless)."""
    x, w = torch.randn(16, 576), torch.randn(n, 576) * 0.05
    packed, scale, sums = prepare_weight(w)
    full = int8_linear(x, packed, scale, sums, None, isa)
    for i in range(16):
        assert torch.equal(int8_linear(x[i:i + 1], packed, scale, sums, None, isa)[0], full[i])


def test_packing_round_trips_and_gathers_rows():
    q = torch.randint(-127, 128, (37, 21), dtype=torch.int8)
    packed = pack_weight(q)
    assert torch.equal(unpack_weight(packed, 37, 21), q)
    rows = torch.tensor([0, 36, 17, 17])
    assert torch.equal(packed_rows(packed, rows, 21), q[rows])


def test_quantized_rows_are_symmetric_and_zero_safe():
    x = torch.tensor([[0.0, 0.0], [1.0, -2.0], [-0.3, 0.1]])
    q, scale = quantize_rows(x)
    assert scale[0] == 1.0 and q[0].tolist() == [0, 0]
    assert q[1].tolist() == [64, -127] and torch.isclose(scale[1], torch.tensor(2.0 / 127))
    assert q.abs().max() <= 127
