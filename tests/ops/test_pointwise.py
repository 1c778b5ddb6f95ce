"""The row-wise C++ ops (ops/pointwise: RMSNorm, silu(gate) * up) against their references in naive.py, on every
ISA path this CPU has, at widths that are and are not multiples of the vector width; a row's result does not
depend on how many rows share the call."""
import pytest
import torch

from drafttree.ops.cpu_extension import kernel_error
from drafttree.ops.pointwise import rms_norm, rms_norm_ref, silu_mul, silu_mul_ref
from runtime_helpers import kernel_isas

pytestmark = pytest.mark.skipif(kernel_error() is not None, reason="CPU kernels unavailable")




@pytest.mark.parametrize("isa", kernel_isas("avx512f"))
@pytest.mark.parametrize("width", [7, 16, 64, 576, 579])
def test_rms_norm_equals_the_reference_and_rows_are_alone(isa, width):
    gen = torch.Generator().manual_seed(width)
    x, w = torch.randn(5, width, generator=gen) * 3, torch.randn(width, generator=gen)
    out = rms_norm(x, w, 1e-5, isa)
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    for i in range(x.shape[0]):
        assert torch.equal(rms_norm(x[i:i + 1], w, 1e-5, isa), out[i:i + 1])


@pytest.mark.parametrize("isa", kernel_isas("avx512f"))
@pytest.mark.parametrize("width", [7, 16, 64, 1536, 1539])
def test_silu_mul_equals_the_reference_and_rows_are_alone(isa, width):
    gen = torch.Generator().manual_seed(width)
    gate_up = torch.randn(5, 2 * width, generator=gen) * 4
    out = silu_mul(gate_up, isa)
    torch.testing.assert_close(out, silu_mul_ref(gate_up), rtol=1e-5, atol=1e-6)
    for i in range(gate_up.shape[0]):
        assert torch.equal(silu_mul(gate_up[i:i + 1], isa), out[i:i + 1])
