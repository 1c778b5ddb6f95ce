"""Causal depthwise conv over a chain (vs transformers) and over a tree (vs the chain along each path)."""
import pytest
import torch

from drafttree.ops.conv import causal_conv1d, tree_causal_conv1d, tree_conv_index
from drafttree.ops.gdn.random_inputs import make_parents, path_of

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def test_chain_conv_matches_transformers():
    gen = torch.Generator().manual_seed(0)
    C, K, T = 12, 4, 9
    w = torch.randn(C, K, generator=gen)
    x = torch.randn(T, C, generator=gen)
    # from an empty context: transformers' prefill path
    y, E = causal_conv1d(x, w, torch.zeros(K - 1, C))
    ref = hf.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()
    torch.testing.assert_close(y, ref)
    # then one cached decode step: transformers keeps the last K pre-conv inputs
    x1 = torch.randn(1, C, generator=gen)
    conv_state = E[-K:].t()[None].clone()
    ref1 = hf.causal_conv1d_update(x1.t()[None], conv_state, w, None, "silu")[0].t()
    y1, _ = causal_conv1d(x1, w, E[-(K - 1):])
    torch.testing.assert_close(y1, ref1)


@pytest.mark.parametrize("shape", ["chain", "star", "deep", "random"])
@pytest.mark.parametrize("K", [2, 4])
def test_tree_conv_matches_chain_along_each_path(shape, K):
    gen = torch.Generator().manual_seed(K)
    C, n = 10, 30
    parents = make_parents(shape, n, gen)
    w = torch.randn(C, K, generator=gen, dtype=torch.float64)
    x = torch.randn(n, C, generator=gen, dtype=torch.float64)
    ctx = torch.randn(K - 1, C, generator=gen, dtype=torch.float64)
    idx = tree_conv_index(parents, K)
    y, E = tree_causal_conv1d(x, w, ctx, idx)
    for i in range(n):
        path = path_of(parents, i)
        y_ref, E_ref = causal_conv1d(x[path], w, ctx)
        torch.testing.assert_close(y[i], y_ref[-1], atol=1e-12, rtol=0)
        # context after accepting node i: the last K-1 raw inputs ending at i (old context if the path is short)
        torch.testing.assert_close(E[idx[i, 1:]], E_ref[-(K - 1):] if K > 1 else E_ref[:0])


def test_tree_conv_index_root_reads_context():
    idx = tree_conv_index([-1, 0, 0, 1], K=4)
    # E rows: 0..2 context (newest = 2), 3.. nodes
    assert idx[0].tolist() == [0, 1, 2, 3]
    assert idx[1].tolist() == [1, 2, 3, 4]
    assert idx[2].tolist() == [1, 2, 3, 5]
    assert idx[3].tolist() == [2, 3, 4, 6]


def test_chain_conv_index_is_the_tree_index_of_a_chain():
    from drafttree.ops.conv import chain_conv_index

    for n, K in [(1, 4), (3, 4), (9, 2), (64, 4)]:
        assert torch.equal(chain_conv_index(n, K), tree_conv_index(torch.arange(n) - 1, K)), (n, K)
