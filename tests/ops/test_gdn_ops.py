"""Gated delta rule: references vs transformers, tree verify vs the per-path recurrence oracle."""
import pytest
import torch

from drafttree.ops.gdn.naive import (
    chunk_gated_delta_rule,
    prepare_qk,
    recurrent_gated_delta_rule,
    tree_oracle,
    tree_per_branch,
)
from drafttree.ops.gdn.tree import (
    ancestor_mask,
    check_ancestor_mask,
    commit_gdn_path,
    parents_from_mask,
    replay_gdn_path,
    tree_gated_delta_verify,
)
from drafttree.ops.gdn.random_inputs import make_gdn_inputs, make_parents, path_of

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def rel_err(x, ref):
    return float((x.double() - ref.double()).abs().max() / (1 + ref.double().abs().max()))


# ----------------------------------------------------------------------------- references vs HF


@pytest.mark.parametrize("T", [1, 7, 70])
@pytest.mark.parametrize("Hk,Hv", [(2, 2), (2, 4)])
def test_references_match_transformers(T, Hk, Hv):
    gen = torch.Generator().manual_seed(T * 10 + Hv)
    dk, dv = 8, 6
    q = torch.randn(1, T, Hk, dk, generator=gen)
    k = torch.randn(1, T, Hk, dk, generator=gen)
    v = torch.randn(1, T, Hv, dv, generator=gen)
    g = -torch.rand(1, T, Hv, generator=gen) * 5
    beta = torch.rand(1, T, Hv, generator=gen)
    S0 = torch.randn(1, Hv, dk, dv, generator=gen)
    kw = dict(initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_rec, S_rec = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    o_chk, S_chk = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, **kw)

    qh, kh = prepare_qk(q.transpose(1, 2), k.transpose(1, 2))
    args = (qh, kh, v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2), S0)
    for ours in (recurrent_gated_delta_rule(*args), chunk_gated_delta_rule(*args, chunk_size=32)):
        o, S = ours
        torch.testing.assert_close(o.transpose(1, 2), o_rec, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(o.transpose(1, 2), o_chk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(S, S_rec, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(S, S_chk, atol=1e-5, rtol=1e-5)


def test_oracles_agree():
    gen = torch.Generator().manual_seed(0)
    parents = make_parents("random", 20, gen)
    x = make_gdn_inputs(2, 4, 20, 5, 3, gen)
    o1, states = tree_oracle(*x, parents)
    o2 = tree_per_branch(*x, parents)
    torch.testing.assert_close(o1, o2, atol=1e-12, rtol=0)
    for i in (0, 7, 19):
        path = path_of(parents, i)
        _, S = recurrent_gated_delta_rule(*(t[..., path, :] for t in x[:3]), x[3][..., path], x[4][..., path], x[5])
        torch.testing.assert_close(states[:, i], S, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------- tree structure


def test_ancestor_mask_roundtrip_and_validation():
    gen = torch.Generator().manual_seed(1)
    parents = make_parents("random", 30, gen)
    M = ancestor_mask(parents)
    check_ancestor_mask(M)
    assert torch.equal(parents_from_mask(M), parents)
    bad = M.clone()
    bad[5, 5] = False
    with pytest.raises(ValueError, match="diagonal"):
        check_ancestor_mask(bad)
    bad = M.clone()
    bad[29, :] = True
    with pytest.raises(ValueError, match="ancestor mask"):
        check_ancestor_mask(bad)
    with pytest.raises(ValueError, match="topological"):
        ancestor_mask([-1, 2, 0])


# ----------------------------------------------------------------------------- tree verify vs oracle

CASES = [("chain", 1), ("chain", 256), ("star", 64), ("deep", 256), ("random", 256), ("local", 128), ("random", 33)]


@pytest.mark.parametrize("shape,n", CASES)
def test_tree_verify_matches_path_recurrence(shape, n):
    gen = torch.Generator().manual_seed(n)
    parents = make_parents(shape, n, gen)
    x64 = make_gdn_inputs(2, 4, n, 16, 12, gen, g_min=-20.0)
    ref_o, ref_states = tree_oracle(*x64, parents)
    M = ancestor_mask(parents)
    o, stash = tree_gated_delta_verify(*(t.float() for t in x64), M)
    assert torch.isfinite(o).all()
    # fp32 against fp64: a 256-deep tree's triangular solve lands at 1.02e-5 with Intel MKL's summation order
    assert rel_err(o, ref_o) < 2e-5
    # commit (fold and replay) reproduces the path state at a few nodes
    for node in {0, n // 2, n - 1}:
        path = path_of(parents, node)
        S_fold = commit_gdn_path(x64[5].float(), stash, path)
        S_replay = replay_gdn_path(x64[5].float(), stash, path)
        assert rel_err(S_fold, ref_states[:, node]) < 1e-5
        assert rel_err(S_replay, ref_states[:, node]) < 1e-5


def test_tree_verify_fp64_exact_and_every_node_commit():
    gen = torch.Generator().manual_seed(3)
    parents = make_parents("random", 40, gen)
    x = make_gdn_inputs(1, 3, 40, 6, 5, gen)
    ref_o, ref_states = tree_oracle(*x, parents)
    o, stash = tree_gated_delta_verify(*x, ancestor_mask(parents))
    assert rel_err(o, ref_o) < 1e-12
    for node in range(40):
        assert rel_err(commit_gdn_path(x[5], stash, path_of(parents, node)), ref_states[:, node]) < 1e-12


def test_chain_tree_equals_chunk_form():
    gen = torch.Generator().manual_seed(4)
    x = make_gdn_inputs(2, 2, 50, 8, 8, gen, dtype=torch.float32)
    o_chunk, S_chunk = chunk_gated_delta_rule(*x, chunk_size=64)
    o_tree, stash = tree_gated_delta_verify(*x, torch.ones(50, 50, dtype=torch.bool).tril())
    torch.testing.assert_close(o_tree, o_chunk, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(commit_gdn_path(x[5], stash, range(50)), S_chunk, atol=1e-5, rtol=1e-5)


def test_extreme_gates_and_degenerate_rows():
    """g down to -200 (overflow if exp came before the mask), β ∈ {0, 1}, zero keys (eps path)."""
    gen = torch.Generator().manual_seed(5)
    n = 48
    parents = make_parents("random", n, gen)
    q, k, v, g, beta, S0 = make_gdn_inputs(2, 2, n, 8, 8, gen, g_min=-200.0)
    beta[:, ::3] = 0.0
    beta[:, 1::3] = 1.0
    k_raw = torch.randn(2, n, 8, generator=gen, dtype=torch.float64)
    k_raw[:, ::5] = 0.0
    q, k = prepare_qk(q, k_raw, torch.float64)
    ref_o, ref_states = tree_oracle(q, k, v, g, beta, S0, parents)
    o, stash = tree_gated_delta_verify(*(t.float() for t in (q, k, v, g, beta, S0)), ancestor_mask(parents))
    assert torch.isfinite(o).all()
    assert rel_err(o, ref_o) < 1e-5
    assert rel_err(commit_gdn_path(S0.float(), stash, path_of(parents, n - 1)), ref_states[:, n - 1]) < 1e-5


def test_branch_independence():
    """Changing a node outside anc(i) leaves o_i bit-for-bit unchanged."""
    gen = torch.Generator().manual_seed(6)
    n = 32
    parents = make_parents("random", n, gen)
    M = ancestor_mask(parents)
    x = [t.float() for t in make_gdn_inputs(2, 4, n, 8, 8, gen)]
    o, _ = tree_gated_delta_verify(*x, M)
    target = n - 1
    outside = (~M[target]).nonzero().flatten()
    assert outside.numel() > 0
    y = [t.clone() for t in x]
    y[1][:, outside] = torch.nn.functional.normalize(torch.randn_like(y[1][:, outside]), dim=-1)
    y[2][:, outside] += 100.0
    y[3][:, outside] = -150.0
    y[4][:, outside] = 1.0
    o2, _ = tree_gated_delta_verify(*y, M)
    assert torch.equal(o[:, target], o2[:, target])
    for i in range(n):  # every node whose ancestors were all left alone is unchanged too
        if not M[i, outside].any():
            assert torch.equal(o[:, i], o2[:, i])


def test_permutation_invariance():
    gen = torch.Generator().manual_seed(7)
    n = 40
    parents = make_parents("random", n, gen)
    x = make_gdn_inputs(2, 4, n, 8, 8, gen, dtype=torch.float32)
    o, _ = tree_gated_delta_verify(*x, ancestor_mask(parents))
    # another topological order: sort by (depth, random key)
    depth = ancestor_mask(parents).sum(1)
    perm = torch.argsort(depth * 1000 + torch.randperm(n, generator=gen))
    inv = torch.argsort(perm)
    new_parents = torch.tensor([-1 if parents[p] < 0 else int(inv[parents[p]]) for p in perm])
    q, k, v, g, beta, S0 = x
    xp = (q[:, perm], k[:, perm], v[:, perm], g[:, perm], beta[:, perm], S0)
    op, _ = tree_gated_delta_verify(*xp, ancestor_mask(new_parents))
    torch.testing.assert_close(op[:, inv], o, atol=1e-5, rtol=1e-5)


def test_leading_batch_dims():
    gen = torch.Generator().manual_seed(8)
    parents = make_parents("local", 16, gen)
    xs = [make_gdn_inputs(2, 4, 16, 4, 4, gen) for _ in range(3)]
    batched = [torch.stack(t) for t in zip(*xs)]
    o, stash = tree_gated_delta_verify(*batched, ancestor_mask(parents))
    for b, x in enumerate(xs):
        ref, states = tree_oracle(*x, parents)
        assert rel_err(o[b], ref) < 1e-12
    S = commit_gdn_path(batched[5], stash, path_of(parents, 15))
    assert rel_err(S[2], tree_oracle(*xs[2], parents)[1][:, 15]) < 1e-12


def test_rounds_of_verify_and_commit():
    """Three rounds; accept the root only, an interior node, then the deepest leaf. Each node's output
    must equal a from-scratch recurrence over (all committed tokens + its path)."""
    gen = torch.Generator().manual_seed(9)
    Hk, Hv, dk, dv = 2, 4, 8, 6
    S0 = torch.zeros(Hv, dk, dv)
    history = [torch.empty(Hk, 0, dk), torch.empty(Hk, 0, dk), torch.empty(Hv, 0, dv), torch.empty(Hv, 0), torch.empty(Hv, 0)]
    S = S0.clone()
    for rnd, pick in enumerate(["root", "interior", "deepest"]):
        n = 24
        parents = make_parents("random", n, gen)
        q, k, v, g, beta, _ = make_gdn_inputs(Hk, Hv, n, dk, dv, gen, dtype=torch.float32)
        M = ancestor_mask(parents)
        o, stash = tree_gated_delta_verify(q, k, v, g, beta, S, M)
        depth = M.sum(1) - 1
        for i in range(n):
            path = path_of(parents, i)
            full = [torch.cat([h, t[..., path, :] if t.ndim == 3 else t[..., path]], dim=-2 if t.ndim == 3 else -1)
                    for h, t in zip(history, (q, k, v, g, beta))]
            ref, _ = recurrent_gated_delta_rule(*(t.double() for t in full), S0.double())
            assert rel_err(o[:, i], ref[:, -1]) < 1e-5
        if pick == "root":
            leaf = 0
        elif pick == "interior":
            leaf = int(next(i for i in range(n) if 0 < depth[i] and (parents == i).any()))
        else:
            leaf = int(depth.argmax())
        path = path_of(parents, leaf)
        S_fold, S_replay = commit_gdn_path(S, stash, path), replay_gdn_path(S, stash, path)
        torch.testing.assert_close(S_fold, S_replay, atol=1e-5, rtol=1e-5)
        S = S_fold
        history = [torch.cat([h, t[..., path, :] if t.ndim == 3 else t[..., path]], dim=-2 if t.ndim == 3 else -1)
                   for h, t in zip(history, (q, k, v, g, beta))]
    assert history[2].shape[1] > 3
