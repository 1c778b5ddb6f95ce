"""Per-request state: sequences of one model are independent, so interleaving their rounds in any
order gives each exactly the tokens it gets alone (fp32 greedy, tiny models)."""
import pytest
import torch

from drafttree.engine import Sequence, generate_ar
from drafttree.load import load_target
from drafttree.methods import Decoder
from drafttree.proposers import BestFirstPolicy, ChainPolicy, CostAwarePolicy, DFlashProposer
from drafttree.sampling import SamplingParams
from spec_helpers import TargetCopyProposer, random_drafter_for
from spec_helpers import prompts, synthetic_cost_model


def interleave(seqs: list[Sequence], order_seed: int) -> None:
    """Step the unfinished sequences in a random order until all are done."""
    g = torch.Generator().manual_seed(order_seed)
    while any(not s.done for s in seqs):
        live = [s for s in seqs if not s.done]
        live[int(torch.randint(0, len(live), (1,), generator=g))].step()


def decoded_alone(make, ids) -> list[list[int]]:
    """The tokens of each sequence make(i, ids[i]) stepped to its end by itself."""
    out = []
    for i, p in enumerate(ids):
        seq = make(i, p)
        while not seq.done:
            seq.step()
        out.append(seq.tokens)
    return out


def test_interleaved_sequences_equal_each_alone(tiny_checkpoint):
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    drafter = random_drafter_for(target.model)
    policies = [ChainPolicy(), BestFirstPolicy(8), CostAwarePolicy(synthetic_cost_model(), 32, recalibrate=True)]
    proposers = [None] + [DFlashProposer(drafter, target.model, p) for p in policies] \
        + [TargetCopyProposer(path, BestFirstPolicy(6), noise=1.0)]
    ids = prompts(len(proposers) * 2, target.model.config.vocab_size, seed=4)
    truth = [generate_ar(target, p, max_new_tokens=25, stop_token_ids=()).tokens for p in ids]
    # two sequences per proposer: the same proposer object serves both at once
    seqs = [Sequence(target, p, proposers[i % len(proposers)], max_new_tokens=25, stop_token_ids=())
            for i, p in enumerate(ids)]
    interleave(seqs, order_seed=1)
    assert [s.tokens for s in seqs] == truth
    assert all(s.finish_reason == "length" and s.state_bytes == 0 for s in seqs)  # done frees the state


def test_sampled_sequences_are_independent_of_interleaving(tiny_checkpoint):
    """With a seed per request, a sampled reply does not depend on what else runs beside it."""
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    proposer = DFlashProposer(random_drafter_for(target.model), target.model, BestFirstPolicy(6))
    ids = prompts(3, target.model.config.vocab_size, seed=8)
    sp = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(3)]
    alone = []
    for p, s in zip(ids, sp):
        seq = Sequence(target, p, proposer, 20, s, stop_token_ids=())
        while not seq.done:
            seq.step()
        alone.append(seq.tokens)
    seqs = [Sequence(target, p, proposer, 20, s, stop_token_ids=()) for p, s in zip(ids, sp)]
    interleave(seqs, order_seed=3)
    assert [s.tokens for s in seqs] == alone


def test_state_is_bounded_reported_and_freed(tiny_checkpoint):
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    cfg = target.model.config
    proposer = DFlashProposer(random_drafter_for(target.model), target.model, BestFirstPolicy(8))
    seq = Sequence(target, torch.tensor([1, 2, 3]), proposer, max_new_tokens=10)
    rows = 3 + 10 + 8  # prompt + new tokens + one tree's scratch rows (the last token never enters the cache)
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * rows * cfg.head_dim * 4
    assert seq.state_bytes == kv  # the drafter's context exists after the first step
    seq.step()
    assert seq.state_bytes > kv
    seq.close()
    assert seq.state_bytes == 0 and seq.done and seq.finish_reason == "cancelled" and seq.step() == []


def test_stop_token_and_zero_tokens(tiny_checkpoint):
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    p = torch.tensor([5, 9, 2])
    ar = generate_ar(target, p, max_new_tokens=12, stop_token_ids=()).tokens
    seq = Sequence(target, p, None, 12, stop_token_ids=(ar[4],))
    while not seq.done:
        seq.step()
    assert seq.tokens == ar[:ar.index(ar[4]) + 1] and seq.finish_reason == "stop"
    empty = Sequence(target, p, None, 0)
    assert empty.done and empty.finish_reason == "length" and empty.step() == []


def test_decoder_makes_sequences_for_every_method(tiny_checkpoint):
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    dec = Decoder(target, drafter=random_drafter_for(target.model), budget=6, cost_model=synthetic_cost_model())
    p = torch.tensor([4, 8, 15, 16])
    truth = generate_ar(target, p, max_new_tokens=16, stop_token_ids=()).tokens
    for method in ("ar", "chain", "ddtree", "caddtree", "caddtree-online"):
        seq = dec.sequence(method, p, 16, stop_token_ids=())
        while not seq.done:
            seq.step()
        assert seq.tokens == truth, method
    assert dec.proposer("chain") is dec.proposer("chain")  # shared, stateless
    with pytest.raises(ValueError, match="unknown method"):
        dec.sequence("beam", p)


def test_trees_shrink_at_the_end_of_the_context(tiny_checkpoint):
    """prompt + max_new_tokens may fill the whole context: the last rounds verify smaller trees."""
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    context = target.model.config.max_position_embeddings
    proposer = DFlashProposer(random_drafter_for(target.model), target.model, BestFirstPolicy(16))
    ids = torch.arange(context - 12) % target.model.config.vocab_size
    truth = generate_ar(target, ids, max_new_tokens=12, stop_token_ids=()).tokens
    seq = Sequence(target, ids, proposer, 12, stop_token_ids=())
    assert seq.state.max_len == context
    while not seq.done:
        seq.step()
    assert seq.tokens == truth and seq.stats.tree_sizes[-1] < 16
    with pytest.raises(ValueError, match="exceed the model's context"):
        Sequence(target, ids, None, 13)


def test_truncated_tree_is_the_prefix_closed_subtree():
    from drafttree.tree import random_tree

    tree = random_tree(30, 50, "random", torch.Generator().manual_seed(3))
    cut = tree.truncated(max_nodes=12, max_depth=3)
    assert cut.num_nodes <= 12 and int(cut.depths.max()) <= 3
    kept = [i for i in range(tree.num_nodes) if int(tree.depths[i]) <= 3][:12]
    assert cut.tokens.tolist() == tree.tokens[kept].tolist()
    for j, i in enumerate(kept):  # every kept node's path maps onto the cut tree's path
        assert cut.tokens[cut.path(j)].tolist() == tree.tokens[tree.path(i)].tolist()
    assert tree.truncated(100, 100) is tree


@pytest.mark.parametrize("compute", ["fp32", "q4"])
def test_batched_rounds_equal_each_alone(tiny_checkpoint, compute):
    """step_many verifies several requests' trees in one forward (q4: batched; fp32: one after another);
    every request gets exactly its own tokens, greedy or seeded sampling, AR and speculative mixed."""
    from drafttree.engine import step_many

    path, _ = tiny_checkpoint
    target = load_target(str(path), compute=compute)
    assert (target.model.attention_kernel is not None) == (compute == "q4")
    proposers = [None, DFlashProposer(random_drafter_for(target.model), target.model, BestFirstPolicy(8)),
                 TargetCopyProposer(path, BestFirstPolicy(6), noise=1.0)]
    ids = prompts(6, target.model.config.vocab_size, seed=6)
    sampling = [SamplingParams(), SamplingParams(temperature=0.9, seed=3)]

    def make(i, p):
        return Sequence(target, p, proposers[i % 3], 24, sampling[i % 2], stop_token_ids=())

    alone = decoded_alone(make, ids)
    seqs = [make(i, p) for i, p in enumerate(ids)]
    while any(not s.done for s in seqs):
        live = [s for s in seqs if not s.done]
        for r in step_many(live):
            assert not isinstance(r, Exception), r
    assert [s.tokens for s in seqs] == alone
    assert all(s.state_bytes == 0 for s in seqs)


def test_a_failing_round_in_a_batch_fails_alone(tiny_checkpoint, monkeypatch):
    from drafttree.engine import step_many

    path, _ = tiny_checkpoint
    target = load_target(str(path), compute="q4")
    ids = prompts(3, target.model.config.vocab_size, seed=9)
    truth = [generate_ar(target, p, max_new_tokens=10, stop_token_ids=()).tokens for p in ids]
    seqs = [Sequence(target, p, None, 10, stop_token_ids=()) for p in ids]
    step_many(seqs)  # prefills
    bad = seqs[1]
    monkeypatch.setattr(bad, "_begin_round", lambda *drafted: (_ for _ in ()).throw(RuntimeError("boom")))
    out = step_many(seqs)
    assert isinstance(out[1], RuntimeError) and not isinstance(out[0], Exception)
    others = [seqs[0], seqs[2]]
    while any(not s.done for s in others):
        step_many([s for s in others if not s.done])
    assert [s.tokens for s in others] == [truth[0], truth[2]]


@pytest.mark.parametrize("tiny_checkpoint", ["llama"], indirect=True)
def test_a_turn_drafts_its_requests_together(tiny_checkpoint, monkeypatch):
    """step_many drafts the rounds of one DFlash proposer's requests in one draft_many call (the drafter on the
    kernels: one forward), and every request still gets its own tokens: greedy and seeded sampling, gated and
    cost-aware policies, AR requests beside them."""
    from drafttree.engine import step_many
    from drafttree.model.linear import quantize_linears, use_cpu_kernels

    path, _ = tiny_checkpoint
    target = load_target(str(path), compute="q4")
    drafter = random_drafter_for(target.model)
    use_cpu_kernels(quantize_linears(drafter.fuse_projections(), target.compute.isa), target.compute.isa)
    proposers = [DFlashProposer(drafter, target.model, BestFirstPolicy(8)),
                 DFlashProposer(drafter, target.model, CostAwarePolicy(synthetic_cost_model(), 32, recalibrate=True),
                                gate=True), None]
    calls = []
    for p in proposers[:2]:
        many = p.draft_many
        monkeypatch.setattr(p, "draft_many", lambda st, r, s, many=many: calls.append(len(st)) or many(st, r, s))
    ids = prompts(8, target.model.config.vocab_size, seed=11)
    sampling = [SamplingParams(), SamplingParams(temperature=0.8, seed=5)]

    def make(i, p):
        return Sequence(target, p, proposers[i % 3], 20, sampling[(i // 3) % 2], stop_token_ids=())

    alone = decoded_alone(make, ids)
    assert not calls  # alone, a request drafts itself
    seqs = [make(i, p) for i, p in enumerate(ids)]
    while any(not s.done for s in seqs):
        for r in step_many([s for s in seqs if not s.done]):
            assert not isinstance(r, Exception), r
    assert [s.tokens for s in seqs] == alone
    assert calls and max(calls) == 3  # requests 0, 3, 6 share the first proposer


@pytest.mark.parametrize("tiny_checkpoint", ["llama"], indirect=True)
def test_a_turn_sizes_its_cost_aware_trees_together(tiny_checkpoint, monkeypatch):
    """step_many hands a cost-aware proposer's drafted requests to one build_many (their trees sized for the turn,
    an AR request's row counted in it), and greedy output stays the target's own."""
    from drafttree.costmodel import ConvexCost, VerifyCostModel
    from drafttree.engine import step_many

    path, _ = tiny_checkpoint
    target = load_target(str(path), compute="q4")
    cheap_rows = VerifyCostModel((0,), (ConvexCost((1.0, 64.0), (10.0, 10.5)),), draft_ms=1.0)  # trees pay
    policy = CostAwarePolicy(cheap_rows, 12, recalibrate=True)
    proposer = DFlashProposer(random_drafter_for(target.model), target.model, policy)
    turns = []
    many = policy.build_many
    monkeypatch.setattr(policy, "build_many", lambda st, r, x, c, t, turn:
                        turns.append((len(st), turn.requests)) or many(st, r, x, c, t, turn))
    ids = prompts(5, target.model.config.vocab_size, seed=12)
    truth = [generate_ar(target, p, max_new_tokens=16, stop_token_ids=()).tokens for p in ids]
    seqs = [Sequence(target, p, proposer if i < 4 else None, 16, stop_token_ids=()) for i, p in enumerate(ids)]
    while any(not s.done for s in seqs):
        for r in step_many([s for s in seqs if not s.done]):
            assert not isinstance(r, Exception), r
    assert [s.tokens for s in seqs] == truth
    assert turns and max(turns) == (4, 5)
    assert sum(sum(s.stats.tree_sizes) for s in seqs[:4]) > 0
