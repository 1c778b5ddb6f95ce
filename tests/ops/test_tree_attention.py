"""The row-by-row attention kernel against softmax attention, and its batch invariance; K/V stored as float32 or
float16 (the kernel paths' caches), float16 rows widened exactly, so the reference runs on the widened rows."""
import pytest
import torch

from drafttree.ops.attention import tree_attention, tree_attention_ref
from runtime_helpers import kernel_isas

ISAS = kernel_isas("avx512f")
KV = [torch.float32, torch.float16]


def ancestor_mask(parents):
    m = torch.eye(len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] |= m[p]
    return m


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("kv_heads,group,t,past,d", [(3, 3, 1, 100, 64), (3, 3, 16, 37, 64), (2, 1, 5, 0, 16),
                                                     (1, 2, 7, 3, 12), (4, 2, 9, 130, 128)])
def test_kernel_matches_softmax_attention(isa, kv, kv_heads, group, t, past, d):
    gen = torch.Generator().manual_seed(t + past)
    keys, values = torch.randn(kv_heads, past + t, d, generator=gen), torch.randn(kv_heads, past + t, d, generator=gen)
    keys, values = keys.to(kv), values.to(kv)
    q = torch.randn(kv_heads, group * t, d, generator=gen)
    tree = ancestor_mask([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, t)])
    for visible in (None, tree):
        out = tree_attention(q, keys, values, past, visible, d**-0.5, isa)
        ref = tree_attention_ref(q, keys.float(), values.float(), past, visible, d**-0.5)
        assert torch.allclose(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv", KV)
def test_tree_row_equals_the_one_token_step_bit_for_bit(isa, kv):
    """A node sees the committed keys then its ancestors in order, exactly what a one-token step at its
    position sees after the path was committed: same bits."""
    kv_heads, group, d, past = 3, 3, 64, 50
    parents = [-1, 0, 0, 1, 2, 3, 3, 4, 7]
    t, tree = len(parents), ancestor_mask(parents)
    keys, values = torch.randn(kv_heads, past + t, d).to(kv), torch.randn(kv_heads, past + t, d).to(kv)
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


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("kv", KV)
def test_batched_requests_equal_each_request_alone(isa, qk_norm, kv):
    """Several requests' rows in one rope_tree_attention_batched call: each request's output and cache rows
    are the bits of its own rope_tree_attention call (the serving and data-generation batches rely on it)."""
    from types import SimpleNamespace

    from drafttree.model.layers import RMSNorm
    from drafttree.ops.attention import rope_tree_attention, rope_tree_attention_batched

    n_heads, n_kv, d, lmax = 6, 2, 64, 64
    gen = torch.Generator().manual_seed(int(qk_norm))
    norms = (RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)) if qk_norm else (None, None)
    for m in filter(None, norms):
        m.weight.data = torch.rand(d, generator=gen) + 0.5
    requests = [(1, 30, None), (5, 0, ancestor_mask([-1, 0, 0, 1, 3])), (1, 0, None), (3, 47, ancestor_mask([-1, 0, 1]))]
    caches = [SimpleNamespace(k=[torch.randn(n_kv, lmax, d, generator=gen).to(kv)],
                              v=[torch.randn(n_kv, lmax, d, generator=gen).to(kv)]) for _ in requests]
    rows = sum(t for t, _, _ in requests)
    qkv = torch.randn(rows, (n_heads + 2 * n_kv) * d, generator=gen)
    angles = torch.rand(rows, d, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    alone_caches = [SimpleNamespace(k=[c.k[0].clone()], v=[c.v[0].clone()]) for c in caches]
    segments, a = [], 0
    for (t, past, mask), cache in zip(requests, caches):
        segments.append((a, a + t, past, mask, cache))
        a += t
    out = rope_tree_attention_batched(qkv, cos, sin, segments, 0, n_heads, n_kv, isa, *norms)
    for (a, b, past, mask, _), cache, alone in zip(segments, caches, alone_caches):
        one = rope_tree_attention(qkv[a:b], cos[a:b], sin[a:b], alone.k[0], alone.v[0], past, mask, n_heads, n_kv, isa,
                                  *norms)
        assert torch.equal(out[a:b], one)
        assert torch.equal(cache.k[0], alone.k[0]) and torch.equal(cache.v[0], alone.v[0])


@pytest.mark.parametrize("isa", ISAS)
def test_float16_cache_rows_are_the_float_rows_rounded(isa):
    """rope_tree_attention writes a float16 cache's new rows as torch rounds the float32 rows (nearest even)."""
    from drafttree.ops.attention import rope_tree_attention

    n_heads, n_kv, d, lmax, past, t = 6, 2, 64, 48, 20, 4
    gen = torch.Generator().manual_seed(7)
    k16, v16 = torch.randn(n_kv, lmax, d, generator=gen).half(), torch.randn(n_kv, lmax, d, generator=gen).half()
    k32, v32 = k16.float(), v16.float()
    qkv = torch.randn(t, (n_heads + 2 * n_kv) * d, generator=gen) * 3
    angles = torch.rand(t, d, generator=gen) * 6
    mask = ancestor_mask([-1, 0, 1, 1])
    out16 = rope_tree_attention(qkv, angles.cos(), angles.sin(), k16, v16, past, mask, n_heads, n_kv, isa)
    out32 = rope_tree_attention(qkv, angles.cos(), angles.sin(), k32, v32, past, mask, n_heads, n_kv, isa)
    assert torch.equal(k16, k32.half()) and torch.equal(v16, v32.half())
    assert torch.allclose(out16, out32, atol=1e-2)  # the float32 call attends over its unrounded new rows


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group,d", [(3, 64), (2, 128), (1, 64)])
def test_float16_rows_are_widened_exactly(isa, group, d):
    """Attention over float16 K/V is attention over the same rows widened to float32, bit for bit: the kernels
    widen on load (AVX-512, several query heads a kv head: once a 16-key chunk, into a float32 copy) and run the
    float32 instructions after."""
    kv_heads, past, t = 3, 70, 5
    gen = torch.Generator().manual_seed(8)
    keys = torch.randn(kv_heads, past + t, d, generator=gen).half()
    values = torch.randn(kv_heads, past + t, d, generator=gen).half()
    q = torch.randn(kv_heads, group * t, d, generator=gen)
    tree = ancestor_mask([-1, 0, 0, 2, 1])
    for visible in (None, tree):
        half = tree_attention(q, keys, values, past, visible, 0.125, isa)
        assert torch.equal(half, tree_attention(q, keys.float(), values.float(), past, visible, 0.125, isa))
