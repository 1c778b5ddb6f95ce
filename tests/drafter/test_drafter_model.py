import torch

from drafttree.drafter import DFlashConfig, DFlashDrafter, block_attention_mask

torch.set_num_threads(1)


def tiny_config(**kw):
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=50, target_layer_ids=[0, 2, 3],
                block_size=4, rope_theta=10000.0, max_position_embeddings=1024)
    base.update(kw)
    return DFlashConfig(**base)


def make(seed=0, **kw):
    torch.manual_seed(seed)
    d = DFlashDrafter(tiny_config(**kw)).double().eval()
    for p in d.parameters():  # non-trivial norms too
        p.data.add_(0.1 * torch.randn_like(p))
    return d


def test_incremental_context_equals_one_shot():
    d = make()
    T, s = 23, 23
    feats = torch.randn(T, d.config.context_dim, dtype=torch.float64)
    block = torch.randn(4, 32, dtype=torch.float64)
    ctx = d.new_context()
    d.extend_context(ctx, feats, torch.arange(T))
    one_shot = d.draft(ctx, block, s)
    ctx = d.new_context()
    for a, b in [(0, 5), (5, 6), (6, 6), (6, 17), (17, 23)]:
        d.extend_context(ctx, feats[a:b], torch.arange(a, b))
        d.draft(ctx, block, b)  # drafting in between must not disturb the context
    assert torch.allclose(d.draft(ctx, block, s), one_shot, atol=1e-12)
    # rollback: truncate then re-extend reproduces the same state
    ctx.truncate(10)
    d.extend_context(ctx, feats[10:], torch.arange(10, T))
    assert torch.allclose(d.draft(ctx, block, s), one_shot, atol=1e-12)


def test_cache_grows_past_initial_capacity():
    d = make()
    feats = torch.randn(600, d.config.context_dim, dtype=torch.float64)
    block = torch.randn(4, 32, dtype=torch.float64)
    ctx = d.new_context()
    d.extend_context(ctx, feats, torch.arange(600))
    ref = d.draft(ctx, block, 600)
    ctx = d.new_context(capacity=16)
    for a in range(0, 600, 100):
        d.extend_context(ctx, feats[a:a + 100], torch.arange(a, a + 100))
    assert torch.allclose(d.draft(ctx, block, 600), ref, atol=1e-12)


def test_packed_blocks_equal_inference_path():
    d = make(mask_token_id=None)
    B, H = 4, 32
    emb = torch.randn(50, H, dtype=torch.float64)
    seqs = [torch.randn(30, d.config.context_dim, dtype=torch.float64),
            torch.randn(19, d.config.context_dim, dtype=torch.float64)]
    tokens = [torch.randint(0, 50, (30,)), torch.randint(0, 50, (19,))]
    blocks = [(0, 0), (0, 7), (0, 26), (1, 3), (1, 15), (0, 12)]  # (sequence, anchor); anchor 0 sees no context
    ctx_f = torch.cat(seqs)
    ctx_pos = torch.cat([torch.arange(30), torch.arange(19)])
    ctx_seq = torch.cat([torch.zeros(30, dtype=torch.long), torch.ones(19, dtype=torch.long)])
    bseq = torch.tensor([b[0] for b in blocks])
    banchor = torch.tensor([b[1] for b in blocks])
    embeds = torch.cat([d.block_embeds(tokens[i][a], emb) for i, a in blocks])
    bpos = (banchor[:, None] + torch.arange(B)).reshape(-1)
    mask = block_attention_mask(ctx_seq, ctx_pos, bseq, banchor, B)
    packed = d(ctx_f, ctx_pos, embeds, bpos, mask).view(len(blocks), B, H)
    for j, (i, a) in enumerate(blocks):
        ctx = d.new_context()
        d.extend_context(ctx, seqs[i][:a], torch.arange(a))
        one = d.draft(ctx, d.block_embeds(tokens[i][a], emb), a)
        assert torch.allclose(packed[j], one, atol=1e-10), j


def test_mask_token_id_uses_target_row_and_draft_vocab_logits():
    d = make(mask_token_id=7, draft_vocab_size=10)
    assert not hasattr(d, "mask_embedding")
    emb = torch.randn(50, 32, dtype=torch.float64)
    be = d.block_embeds(3, emb)
    assert torch.equal(be[0], emb[3]) and torch.equal(be[1], emb[7]) and torch.equal(be[3], emb[7])
    d.set_draft_vocab(torch.arange(0, 50, 5))
    h = torch.randn(3, 32, dtype=torch.float64)
    logits = d.draft_logits(h, emb)
    full = h @ emb.t()
    keep = torch.arange(0, 50, 5)
    assert logits.dtype == torch.float32 and torch.allclose(logits[:, keep], full[:, keep].float())
    assert torch.isinf(logits[:, 1]).all() and logits.argmax(-1).remainder(5).eq(0).all()


def test_drafts_of_several_requests_together_equal_each_alone():
    """draft_rows_many: the requests' block rows share each int8 linear and one attention call, against their own
    contexts (different lengths, starts and block sizes); every row gets the bits draft_rows gives it alone."""
    from drafttree.compute import choose_compute
    from drafttree.model.linear import quantize_linears, use_cpu_kernels

    isa = choose_compute("int8").isa
    torch.manual_seed(0)
    d = DFlashDrafter(tiny_config()).eval()
    for p in d.parameters():
        p.data.add_(0.1 * torch.randn_like(p))
    use_cpu_kernels(quantize_linears(d.fuse_projections(), isa), isa)
    assert d.layers[0].self_attn.kernel_isa is not None
    lengths, blocks = [5, 17, 40], [4, 2, 3]

    def contexts():
        g = torch.Generator().manual_seed(1)
        out = []
        for n in lengths:
            ctx = d.new_context(8)
            d.extend_context(ctx, torch.randn(n, d.config.context_dim, generator=g), torch.arange(n))
            out.append(ctx)
        return out

    embeds = [torch.randn(b, 32, generator=torch.Generator().manual_seed(b)) for b in blocks]
    alone = [d.draft_rows(c, e, n) for c, e, n in zip(contexts(), embeds, lengths)]
    together = d.draft_rows_many(contexts(), embeds, lengths)
    for a, t, b in zip(alone, together, blocks):
        assert t.count == a.count == b
        assert torch.equal(t.rows(0, b), a.rows(0, b)) and torch.equal(t.rows(1, b), a.rows(1, b))
    assert d.draft_rows_many([], [], []) == []


def test_context_updates_of_several_requests_together_equal_each_alone():
    """extend_context_many on the int8 path: each request's context K/V are the bits extend_context writes."""
    from drafttree.compute import choose_compute
    from drafttree.model.linear import quantize_linears, use_cpu_kernels

    isa = choose_compute("int8").isa
    torch.manual_seed(0)
    d = DFlashDrafter(tiny_config()).eval()
    use_cpu_kernels(quantize_linears(d.fuse_projections(), isa), isa)
    g = torch.Generator().manual_seed(2)
    firsts = [torch.randn(n, d.config.context_dim, generator=g) for n in (3, 9)]
    news = [torch.randn(n, d.config.context_dim, generator=g) for n in (1, 5)]

    def contexts():
        out = []
        for f in firsts:
            ctx = d.new_context(4)
            d.extend_context(ctx, f, torch.arange(f.shape[0]))
            out.append(ctx)
        return out

    alone, together = contexts(), contexts()
    for ctx, f, new in zip(alone, firsts, news):
        d.extend_context(ctx, new, torch.arange(f.shape[0], f.shape[0] + new.shape[0]))
    d.extend_context_many(together, news, [torch.arange(f.shape[0], f.shape[0] + n.shape[0])
                                           for f, n in zip(firsts, news)])
    for a, t in zip(alone, together):
        assert a.length == t.length
        assert torch.equal(a.k[:, :, :a.length], t.k[:, :, :t.length])
        assert torch.equal(a.v[:, :, :a.length], t.v[:, :, :t.length])
