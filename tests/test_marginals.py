"""Lazy draft scores (drafttree.marginals): rows computed when a tree first reaches their depth give the
trees of the dense scores, and rows no tree reaches are never computed."""
import math

import pytest
import torch

from drafttree.costmodel import ConvexCost, VerifyCostModel
from drafttree.policies import build_caddtree
from drafttree.engine import generate_ar, generate_speculative
from drafttree.load import load_target
from drafttree.lookup.index import SuffixIndex
from drafttree.lookup.merge import merged_best_first
from drafttree.marginals import LazyDraftScores, dense_logits, log_marginals
from drafttree.model.linear import quantize_linears, use_cpu_kernels
from drafttree.proposers import BestFirstPolicy, CostAwarePolicy, DFlashProposer
from drafttree.tree import best_first_nodes
from spec_helpers import random_drafter_for
from spec_helpers import prompts


def lazy_of(logits: torch.Tensor, calls: list | None = None, first_chunk: int = 2) -> LazyDraftScores:
    def compute(a, b):
        if calls is not None:
            calls.append((a, b))
        return logits[a:b]

    return LazyDraftScores(compute, *logits.shape, first_chunk=first_chunk)


def peaked_logits(depth, vocab, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=g) * 3
    if ties:  # equal log-probs within and across rows: the rank tuples break them
        logits = logits.round()
        logits[:, :4] = 5.0
    return logits


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ties", [False, True])
def test_lazy_best_first_stream_is_the_dense_one(seed, ties):
    logits = peaked_logits(9, 50, seed, ties)
    for budget in (1, 3, 17, 60):
        dense = list(best_first_nodes(logits.log_softmax(-1), budget))
        assert list(best_first_nodes(lazy_of(logits), budget)) == dense


def test_rows_the_search_does_not_reach_are_not_computed():
    logits = torch.full((12, 30), -10.0)
    logits[:, 0] = 10.0  # a confident chain
    calls = []
    nodes = list(best_first_nodes(lazy_of(logits, calls), 2))
    assert [n.depth for n in nodes] == [1, 2]
    assert calls == [(0, 2)]  # depths 1-2: the third depth's row was never asked for
    calls.clear()
    scores = lazy_of(logits, calls)
    assert len(list(best_first_nodes(scores, 12))) == 12
    assert calls == [(0, 2), (2, 4), (4, 8), (8, 12)]  # doubling chunks
    assert torch.equal(scores.dense(), logits)
    calls.clear()
    list(best_first_nodes(LazyDraftScores(lambda a, b: calls.append((a, b)) or logits[a:b], *logits.shape), 12))
    assert calls == [(0, 4), (4, 8), (8, 12)]  # the default first chunk: 4 rows


def test_lazy_caddtree_is_the_dense_one():
    cost = VerifyCostModel(context_lens=[0], curves=[ConvexCost([1, 8, 64], [5.0, 6.0, 30.0])], draft_ms=2.0)
    sizes = []
    for seed in range(4):
        logits = peaked_logits(8, 40, seed)
        tree, sel = build_caddtree(3, logits.log_softmax(-1), cost, 0, 64)
        sizes.append(len(sel.nodes))
        lazy_tree, lazy_sel = build_caddtree(3, lazy_of(logits), cost, 0, 64)
        assert lazy_sel == sel
        assert torch.equal(lazy_tree.tokens, tree.tokens) and torch.equal(lazy_tree.parents, tree.parents)
    assert max(sizes) >= 2, sizes


@pytest.mark.parametrize("seed", range(3))
def test_lazy_merged_stream_is_the_dense_one(seed):
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 12, (200,), generator=g)
    index = SuffixIndex(3, text.tolist())
    logits = peaked_logits(7, 12, seed, ties=seed == 2)
    for root in range(4):
        cont = index.continuations(root, max_depth=10, rates=[0.6] * 10)
        for budget in (1, 5, 30):
            dense = list(merged_best_first(cont, logits.log_softmax(-1), budget, drafter_scale=0.7))
            assert list(merged_best_first(cont, lazy_of(logits), budget, drafter_scale=0.7)) == dense


def test_forms_convert():
    logits = torch.randn(3, 5)
    assert torch.equal(dense_logits(logits), logits)
    assert torch.equal(log_marginals(logits), logits.log_softmax(-1))
    lazy = lazy_of(logits)
    assert log_marginals(lazy) is lazy and torch.equal(dense_logits(lazy), logits)
    assert torch.allclose(lazy.logprobs_from(2), logits[2:3].log_softmax(-1))
    with pytest.raises(IndexError, match="depth index 3"):
        lazy.logprobs_from(3)
    bad = LazyDraftScores(lambda a, b: torch.zeros(b - a, 4), 3, 5)
    with pytest.raises(ValueError, match="expected shape"):
        bad.dense()


def kernel_target_and_drafter(path, compute="q4"):
    target = load_target(str(path), compute=compute)
    drafter = random_drafter_for(target.model, layers=2, block_size=8)
    isa = target.compute.isa
    use_cpu_kernels(quantize_linears(drafter.fuse_projections(), isa), isa)
    return target, drafter


def test_block_rows_are_the_drafted_rows_bit_for_bit(tiny_checkpoint):
    """On the kernel paths a row's result does not depend on the rows beside it: the last layer's tail run
    for a few rows at a time gives `draft`'s hidden states exactly."""
    target, d = kernel_target_and_drafter(tiny_checkpoint[0])
    ctx = d.new_context()
    d.extend_context(ctx, torch.randn(9, d.config.context_dim), torch.arange(9))
    block = d.block_embeds(3, target.model.embed)
    full = d.draft(ctx, block, 9)
    rows = d.draft_rows(ctx, block, 9)
    assert torch.equal(torch.cat([rows.rows(0, 1), rows.rows(1, 3), rows.rows(3, 8)]), full)


@pytest.mark.parametrize("compute", ["int8", "q4"])
def test_drafter_stack_drafts_the_layer_loops_bits(tiny_checkpoint, compute):
    """The drafter's block through the target's C++ decoder stack (one call, every layer whole) gives the hidden
    states of its Python layer loop (the stack's reference) bit for bit, context and block scratch rows alike."""
    target, d = kernel_target_and_drafter(tiny_checkpoint[0], compute)
    assert d.decoder_stack is not None
    feats = torch.randn(9, d.config.context_dim)
    drafted = []
    for stack in (d.decoder_stack, None):
        d.decoder_stack = stack
        ctx = d.new_context()
        d.extend_context(ctx, feats, torch.arange(9))
        rows = d.draft_rows(ctx, d.block_embeds(3, target.model.embed, 6), 9)
        drafted.append((rows.rows(0, rows.count), ctx.k[:, :, :15].clone(), ctx.v[:, :, :15].clone()))
    for a, b in zip(*drafted):
        assert torch.equal(a, b)


def test_fused_context_kv_is_the_per_layer_kv_bit_for_bit(tiny_checkpoint):
    """Every layer's context k/v from one matmul (DFlashDrafter.context_kv) equal the per-layer projections exactly
    on the kernel paths, whose output columns do not depend on the columns beside them."""
    _, d = kernel_target_and_drafter(tiny_checkpoint[0])
    feats, contexts = torch.randn(11, d.config.context_dim), []
    for fused in (d.context_kv, None):
        d.context_kv = fused
        ctx = d.new_context()
        d.extend_context(ctx, feats[:9], torch.arange(9))
        d.extend_context(ctx, feats[9:], torch.arange(9, 11))
        contexts.append(ctx)
    assert torch.equal(contexts[0].k[:, :, :11], contexts[1].k[:, :, :11])
    assert torch.equal(contexts[0].v[:, :, :11], contexts[1].v[:, :, :11])


@pytest.mark.parametrize("method", ["ddtree", "caddtree"])
def test_lazy_rows_decode_as_dense_rows(tiny_checkpoint, method):
    """The proposer's lazy rows build the dense rows' trees (same accept lengths) and stay lossless."""
    target, drafter = kernel_target_and_drafter(tiny_checkpoint[0])
    cost = VerifyCostModel(context_lens=[0], curves=[ConvexCost([1, 8, 64], [1.0, 1.3, 4.0])], draft_ms=0.5)
    policy = BestFirstPolicy(6) if method == "ddtree" else CostAwarePolicy(cost)
    for ids in prompts(2, target.model.config.vocab_size, seed=3):
        ar = generate_ar(target, ids, 24, stop_token_ids=())
        runs = [generate_speculative(target, ids, DFlashProposer(drafter, target.model, policy, lazy_rows=lazy), 24,
                                     stop_token_ids=()) for lazy in (False, True)]
        assert runs[0].tokens == runs[1].tokens == ar.tokens
        assert runs[0].stats.accept_lengths == runs[1].stats.accept_lengths
        assert runs[0].stats.tree_sizes == runs[1].stats.tree_sizes
        assert not math.isnan(runs[1].stats.tau)


def test_cost_aware_blocks_follow_the_trees_depth(tiny_checkpoint):
    """With the policy's follow_depth (CaDDTree's default) a round's block stops one depth past the previous tree's deepest node (at least the first
    chunk of head rows, at most the depth cap); the first round drafts to the cap; output = AR's."""
    target, drafter = kernel_target_and_drafter(tiny_checkpoint[0])  # block of 8 rows: depths 1..7
    cost = VerifyCostModel(context_lens=[0], curves=[ConvexCost([1, 8, 64], [1.0, 1.05, 1.5])], draft_ms=0.5)
    policy = CostAwarePolicy(cost)  # follows by default
    proposer = DFlashProposer(drafter, target.model, policy)
    assert proposer.follow_depth and proposer.draft_depth == 7 and proposer.first_chunk == 2
    rows_seen, depths = [], []
    draft_rows, build_tree = drafter.draft_rows, proposer.build_tree
    drafter.draft_rows = lambda ctx, block, start: rows_seen.append(block.shape[0]) or draft_rows(ctx, block, start)
    proposer.build_tree = lambda *a: depths.append(int((t := build_tree(*a)).depths.max())) or t
    for ids in prompts(2, target.model.config.vocab_size, seed=6):
        rows_seen.clear(), depths.clear()
        res = generate_speculative(target, ids, proposer, 24, stop_token_ids=())
        assert res.tokens == generate_ar(target, ids, 24, stop_token_ids=()).tokens
        assert rows_seen[0] == 8 and len(rows_seen) == len(depths)
        assert rows_seen[1:] == [1 + min(7, max(2, d + 1)) for d in depths[:-1]]


def test_cost_aware_blocks_stop_at_the_depth_cap(tiny_checkpoint):
    """CaDDTree runs the drafter over the root and one mask per depth it can place (not the whole trained block);
    fixed-budget trees keep the whole block; both stay lossless."""
    target, drafter = kernel_target_and_drafter(tiny_checkpoint[0])  # block of 8 rows
    cost = VerifyCostModel(context_lens=[0], curves=[ConvexCost([1, 8, 64], [1.0, 1.3, 4.0])], draft_ms=0.5)
    rows_seen = []
    draft_rows = drafter.draft_rows
    drafter.draft_rows = lambda ctx, block, start: rows_seen.append(block.shape[0]) or draft_rows(ctx, block, start)
    still = CostAwarePolicy(cost, max_tree_depth=3, follow_depth=False)  # the block stays at the cap (following: above)
    for policy, rows in ((still, 4), (BestFirstPolicy(6), 8)):
        proposer = DFlashProposer(drafter, target.model, policy)
        assert proposer.block_rows() == rows
        for ids in prompts(2, target.model.config.vocab_size, seed=5):
            rows_seen.clear()
            res = generate_speculative(target, ids, proposer, 24, stop_token_ids=())
            assert res.tokens == generate_ar(target, ids, 24, stop_token_ids=()).tokens
            assert rows_seen and set(rows_seen) == {rows}
    assert DFlashProposer(drafter, target.model, CostAwarePolicy(cost, max_tree_depth=3), trim_block=False).block_rows() == 8
