"""The row-by-row attention kernel against softmax attention, and its batch invariance."""
import pytest
import torch

from drafttree.compute import cpu_info
from drafttree.ops.attention import tree_attention, tree_attention_ref

ISAS = ["scalar"] + [isa for isa, flag in (("avx2", "avx2"), ("avx512_vnni", "avx512f")) if cpu_info().has(flag)]


def ancestor_mask(parents):
    m = torch.eye(len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] |= m[p]
    return m


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_heads,group,t,past,d", [(3, 3, 1, 100, 64), (3, 3, 16, 37, 64), (2, 1, 5, 0, 16),
                                                     (1, 2, 7, 3, 12), (4, 2, 9, 130, 128)])
def test_kernel_matches_softmax_attention(isa, kv_heads, group, t, past, d):
    gen = torch.Generator().manual_seed(t + past)
    keys, values = torch.randn(kv_heads, past + t, d, generator=gen), torch.randn(kv_heads, past + t, d, generator=gen)
    q = torch.randn(kv_heads, group * t, d, generator=gen)
    tree = ancestor_mask([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, t)])
    for visible in (None, tree):
        out = tree_attention(q, keys, values, past, visible, d**-0.5, isa)
        ref = tree_attention_ref(q, keys, values, past, visible, d**-0.5)
        assert torch.allclose(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_tree_row_equals_the_one_token_step_bit_for_bit(isa):
    """A node sees the committed keys then its ancestors in order, exactly what a one-token step at its
    position sees after the path was committed: same bits."""
    kv_heads, group, d, past = 3, 3, 64, 50
    parents = [-1, 0, 0, 1, 2, 3, 3, 4, 7]
    t, tree = len(parents), ancestor_mask(parents)
    keys, values = torch.randn(kv_heads, past + t, d), torch.randn(kv_heads, past + t, d)
    q = torch.randn(kv_heads, group * t, d)
    full = tree_attention(q, keys, values, past, tree, 0.125, isa).view(kv_heads, group, t, d)
    for i in range(t):
        path = [past + j for j in range(t) if tree[i, j]]
        k = torch.cat([keys[:, :past], keys[:, path]], 1)
        v = torch.cat([values[:, :past], values[:, path]], 1)
        one = tree_attention(q.view(kv_heads, group, t, d)[:, :, i].contiguous(), k, v, k.shape[1] - 1, None, 0.125, isa)
        assert torch.equal(one, full[:, :, i])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group,d", [(3, 64), (4, 64), (2, 128), (5, 64)])  # 5: more heads than the grouped kernel takes
def test_query_heads_side_by_side_equal_one_head_at_a_time(isa, group, d):
    """The AVX-512 kernel runs the query heads of one kv head together; each head's rows are the bits it
    gets alone (a one-head call), so grouping never changes a result."""
    kv_heads, t, past = 2, 6, 40
    gen = torch.Generator().manual_seed(group)
    keys, values = torch.randn(kv_heads, past + t, d, generator=gen), torch.randn(kv_heads, past + t, d, generator=gen)
    q = torch.randn(kv_heads, group * t, d, generator=gen)
    tree = ancestor_mask([-1, 0, 0, 1, 3, 2])
    full = tree_attention(q, keys, values, past, tree, d**-0.5, isa).view(kv_heads, group, t, d)
    for g in range(group):
        alone = tree_attention(q.view(kv_heads, group, t, d)[:, g].contiguous(), keys, values, past, tree, d**-0.5, isa)
        assert torch.equal(alone, full[:, g])
