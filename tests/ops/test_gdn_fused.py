"""The fused C++ GDN tree verify against the composed op (its reference) and the fp64 per-path oracle."""
import pytest
import torch
from runtime_helpers import kernel_isas

from drafttree.ops.gdn.fused import fused_available, tree_gated_delta_verify_fused
from drafttree.ops.gdn.naive import tree_oracle
from drafttree.ops.gdn.random_inputs import make_gdn_inputs, make_parents, path_of
from drafttree.ops.gdn.tree import ancestor_mask, commit_gdn_path, tree_gated_delta_verify

pytestmark = pytest.mark.skipif(not fused_available(), reason="CPU kernels unavailable")

ISAS = kernel_isas("avx512f")  # the AVX-512 path needs only AVX-512F


def rel_err(x, ref):
    return float((x.double() - ref.double()).abs().max() / (1 + ref.double().abs().max()))


CASES = [("chain", 1), ("chain", 2), ("random", 7), ("local", 16), ("star", 64), ("random", 64),
         ("chain", 256), ("deep", 256), ("random", 256)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("Hk,Hv", [(2, 2), (2, 4)])
@pytest.mark.parametrize("shape,n", CASES)
def test_fused_matches_composed_and_oracle(shape, n, Hk, Hv, isa):
    gen = torch.Generator().manual_seed(n * 7 + Hv)
    parents = make_parents(shape, n, gen)
    x64 = make_gdn_inputs(Hk, Hv, n, 16, 12, gen, g_min=-20.0)
    ref_o, ref_states = tree_oracle(*x64, parents)
    M = ancestor_mask(parents)
    x32 = [t.float() for t in x64]
    o, stash = tree_gated_delta_verify_fused(*x32, M, isa=isa)
    o_c, stash_c = tree_gated_delta_verify(*x32, M)
    assert o.dtype == torch.float32 and o.shape == ref_o.shape
    # fp32 against fp64: a 256-deep chain's forward substitution sums 255 terms per row; the composed op
    # needs the same 2e-5 there (tests/ops/test_gdn_ops.py)
    tol = 2e-5 if int(M.sum(1).max()) > 128 else 1e-5
    assert rel_err(o, ref_o) < tol
    assert rel_err(o, o_c) < 2 * tol  # each within tol of the fp64 truth, in its own summation order
    assert rel_err(stash.u, stash_c.u) < 2 * tol
    assert rel_err(stash.gamma, stash_c.gamma) < 1e-5
    for node in {0, n // 2, n - 1}:
        S = commit_gdn_path(x32[5], stash, path_of(parents, node))
        assert rel_err(S, ref_states[:, node]) < tol


@pytest.mark.parametrize("isa", ISAS)
def test_fused_batched_leading_dims(isa):
    gen = torch.Generator().manual_seed(5)
    parents = make_parents("random", 20, gen)
    xs = [make_gdn_inputs(2, 4, 20, 8, 8, gen) for _ in range(3)]
    x = [torch.stack([xb[i] for xb in xs]).float() for i in range(6)]
    o, stash = tree_gated_delta_verify_fused(*x, ancestor_mask(parents), isa=isa)
    for b in range(3):
        ref_o, _ = tree_oracle(*xs[b], parents)
        assert rel_err(o[b], ref_o) < 1e-5


@pytest.mark.parametrize("isa", ISAS)
def test_fused_rounds_with_commits(isa):
    """Several verify rounds, each committing a root-to-node path into the next round's state."""
    gen = torch.Generator().manual_seed(11)
    S_fused = S_ref = None
    for rnd in range(4):
        n = [7, 16, 33, 64][rnd]
        parents = make_parents("local", n, gen)
        q, k, v, g, beta, S0 = make_gdn_inputs(2, 4, n, 16, 16, gen, g_min=-4.0)
        if S_ref is None:
            S_ref, S_fused = S0, S0.float()
        ref_o, ref_states = tree_oracle(q, k, v, g, beta, S_ref, parents)
        o, stash = tree_gated_delta_verify_fused(q.float(), k.float(), v.float(), g.float(), beta.float(), S_fused,
                                                 ancestor_mask(parents), isa=isa)
        assert rel_err(o, ref_o) < 1e-5
        node = int(torch.randint(0, n, (1,), generator=gen))
        S_fused = commit_gdn_path(S_fused, stash, path_of(parents, node))
        S_ref = ref_states[:, node]
        assert rel_err(S_fused, S_ref) < 1e-5


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "scalar"])
@pytest.mark.parametrize("dk,dv", [(128, 128), (24, 40), (100, 132)])
def test_fused_isas_agree(isa, dk, dv):
    """The SIMD paths (GEMM for k̂S₀ / q̂S₀, register-blocked rows, four-ancestor Gram blocks) against the scalar
    loops, at the model's head size and at sizes that leave vector tails in d_k, d_v and the ancestor blocks."""
    gen = torch.Generator().manual_seed(2 + dk)
    parents = make_parents("random", 64, gen)
    x = [t.float() for t in make_gdn_inputs(2, 4, 64, dk, dv, gen)]
    M = ancestor_mask(parents)
    o_a, st_a = tree_gated_delta_verify_fused(*x, M, isa=isa)
    o_s, st_s = tree_gated_delta_verify_fused(*x, M, isa="scalar")
    o_c, _ = tree_gated_delta_verify(*x, M)
    assert rel_err(o_a, o_s) < 1e-5 and rel_err(st_a.u, st_s.u) < 1e-5
    assert rel_err(o_a, o_c) < 1e-5


@pytest.mark.parametrize("isa", ISAS)
def test_fused_takes_parents_or_mask(isa):
    """The kernel derives the parents from the bool mask itself; an int64 parents vector gives the same result."""
    gen = torch.Generator().manual_seed(3)
    parents = make_parents("random", 30, gen)
    q, k, v, g, beta, S0 = (t.float()[None] for t in make_gdn_inputs(2, 2, 30, 16, 16, gen))
    M = ancestor_mask(parents)
    from drafttree.ops.cpu_extension import ISA_CODES, extension
    from drafttree.ops.gdn.tree import parents_from_mask
    by_mask = extension().gdn_tree_verify(q, k, v, g, beta, S0, M, ISA_CODES[isa])
    by_parents = extension().gdn_tree_verify(q, k, v, g, beta, S0, parents_from_mask(M), ISA_CODES[isa])
    for a, b in zip(by_mask, by_parents):
        assert torch.equal(a, b)


def test_fused_bad_input_raises_clear_errors():
    gen = torch.Generator().manual_seed(0)
    parents = make_parents("random", 8, gen)
    q, k, v, g, beta, S0 = (t.float() for t in make_gdn_inputs(2, 4, 8, 4, 4, gen))
    M = ancestor_mask(parents)
    with pytest.raises(ValueError, match="q and k"):
        tree_gated_delta_verify_fused(q, k[..., :3], v, g, beta, S0, M)
    with pytest.raises(ValueError, match="multiple of key heads"):
        tree_gated_delta_verify_fused(q, k, v[:3], g[:3], beta[:3], S0[:3], M)
    with pytest.raises(ValueError, match="g must be"):
        tree_gated_delta_verify_fused(q, k, v, g[:, :5], beta, S0, M)
    with pytest.raises(ValueError, match="initial_state"):
        tree_gated_delta_verify_fused(q, k, v, g, beta, S0[..., :2], M)
    with pytest.raises(ValueError, match="mask must be"):
        tree_gated_delta_verify_fused(q, k, v, g, beta, S0, M[:5, :5])
    with pytest.raises(ValueError, match="lower triangular"):
        tree_gated_delta_verify_fused(q, k, v, g, beta, S0, M.t().contiguous())
    with pytest.raises(ValueError, match="unknown isa"):
        tree_gated_delta_verify_fused(q, k, v, g, beta, S0, M, isa="neon")
