"""weaver-ddtree and weaver-caddtree by name: registered in drafttree.methods (generate, Decoder, bench,
check-lossless, the server), greedy = AR token for token (tiny models, fp32; one real SmolLM2 prompt), an
untrained Weaver decodes exactly as DDTree does, and sampling matches the target (χ²)."""
import pytest
import torch

from drafttree.engine import generate_ar, generate_speculative
from drafttree.load import load_target
from drafttree.proposers import BestFirstPolicy, CostAwarePolicy, DFlashProposer
from drafttree.weaver import Weaver, WeaverConfig, WeaverProposer
from drafttree.weaver.tree import LookaheadWeaverStream, WeaverStream
from sampling_helpers import assert_sampling_matches_target
from spec_helpers import prompts, random_drafter_for, synthetic_cost_model, weaver_for


@pytest.mark.parametrize("method, width, stream", [("ddtree", 1, WeaverStream), ("ddtree", 4, LookaheadWeaverStream),
                                                   ("ddtree", 2, WeaverStream), ("caddtree", 8, LookaheadWeaverStream)])
def test_greedy_equals_ar(tiny_checkpoint, method, width, stream):
    """Every expansion: look-ahead, and the paper's pop-w steps, which fixed trees of >= 8 w nodes use."""
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    drafter = random_drafter_for(target.model)
    policy = BestFirstPolicy(8 * width if stream is WeaverStream else 12) if method == "ddtree" \
        else CostAwarePolicy(synthetic_cost_model(), max_tree_nodes=24)
    proposer = WeaverProposer(drafter, target.model, weaver_for(target, drafter), policy, width, call_ms=0.3)
    assert proposer.name == f"weaver-{method}" and proposer.stream_class is stream
    for ids in prompts(2, target.model.config.vocab_size, seed=1):
        ar = generate_ar(target, ids, max_new_tokens=24, stop_token_ids=()).tokens
        res = generate_speculative(target, ids, proposer, max_new_tokens=24, stop_token_ids=())
        assert res.tokens == ar
        assert max(res.stats.tree_sizes) > 1


def test_untrained_weaver_decodes_exactly_as_ddtree(tiny_checkpoint):
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    drafter = random_drafter_for(target.model)
    ids = prompts(1, target.model.config.vocab_size, seed=2)[0]
    dd = generate_speculative(target, ids, DFlashProposer(drafter, target.model, BestFirstPolicy(10)), 24, stop_token_ids=())
    wv = generate_speculative(target, ids, WeaverProposer(drafter, target.model, weaver_for(target, drafter, trained=False),
                                                          BestFirstPolicy(10), width=1), 24, stop_token_ids=())
    assert wv.tokens == dd.tokens and wv.stats.accept_lengths == dd.stats.accept_lengths


def test_methods_are_registered(tiny_checkpoint, tmp_path):
    from drafttree.methods import COST_AWARE, METHODS, Decoder, make_proposer
    from drafttree.weaver.checkpoint import save_weaver

    path, _ = tiny_checkpoint
    target = load_target(str(path))
    drafter = random_drafter_for(target.model)
    assert {"weaver-ddtree", "weaver-caddtree"} <= set(METHODS) and "weaver-caddtree" in COST_AWARE
    with pytest.raises(FileNotFoundError, match="--weaver DIR"):  # none ships for the tiny model
        make_proposer("weaver-ddtree", target, drafter=drafter)
    weaver = weaver_for(target, drafter)
    save_weaver(weaver, tmp_path / "w")
    dd = make_proposer("weaver-ddtree", target, drafter=drafter, budget=9, weaver=tmp_path / "w", weaver_width=2)
    assert (dd.name, dd.max_nodes, dd.width) == ("weaver-ddtree", 9, 2)
    decoder = Decoder(target, drafter=drafter, max_tree_nodes=20, cost_model=synthetic_cost_model(), weaver=str(tmp_path / "w"))
    cadd = decoder.proposer("weaver-caddtree")
    assert cadd.name == "weaver-caddtree" and cadd.policy.cost_model is decoder.cost_model and cadd.call_ms > 0
    ids = prompts(1, target.model.config.vocab_size)[0]
    ar = generate_ar(target, ids, 16, stop_token_ids=()).tokens
    for method in ("weaver-ddtree", "weaver-caddtree"):
        seq = decoder.sequence(method, ids, max_new_tokens=16, stop_token_ids=())
        while not seq.done:
            seq.step()
        assert seq.tokens == ar and seq.stats.method == method
    other = Weaver(WeaverConfig(vocab_size=7, embed_size=3, drafter_hidden_size=5, max_depth=2, num_candidates=4))
    save_weaver(other, tmp_path / "bad")
    with pytest.raises(ValueError, match="does not fit"):
        make_proposer("weaver-ddtree", target, drafter=drafter, weaver=tmp_path / "bad")


def test_bench_runs_the_weaver_methods(tiny_checkpoint):
    from drafttree.apps.bench.methods import benchmark, parse_variants

    path, _ = tiny_checkpoint
    target = load_target(str(path))
    drafter = random_drafter_for(target.model)
    assert [v.name for v in parse_variants("weaver-ddtree,weaver-caddtree", "4,8")] == [
        "ar", "weaver-ddtree-4", "weaver-ddtree-8", "weaver-caddtree"]
    res = benchmark(target, {"tiny": prompts(1, target.model.config.vocab_size)}, ["weaver-ddtree", "weaver-caddtree"],
                    drafter=drafter, budgets=(4,), max_new_tokens=12, cost_model=synthetic_cost_model(), chat=False,
                    warmup_tokens=0, progress=False, weaver=weaver_for(target, drafter), weaver_width=2, stop_token_ids=())
    rows = res["aggregates"]["tiny"]
    assert rows["weaver-ddtree-4"]["mismatches"] == 0 and rows["weaver-caddtree"]["mismatches"] == 0


def test_replay_of_the_weaver_stream_matches_real_rounds(tiny_checkpoint):
    """`drafttree replay --weaver-stream`: fixed budgets on the recorded Weaver stream replay weaver-ddtree exactly."""
    from drafttree.apps.bench.replay import FixedBudget, record_draft_streams, replay

    path, _ = tiny_checkpoint
    target = load_target(str(path))
    drafter = random_drafter_for(target.model)
    weaver = weaver_for(target, drafter)
    cost = synthetic_cost_model()
    ids = prompts(1, target.model.config.vocab_size, seed=3)[0]
    streams = record_draft_streams(target, WeaverProposer(drafter, target.model, weaver, BestFirstPolicy(16), 2,
                                                          lookahead=True), ids, 20, 16, stop_token_ids=())
    for budget in (4, 16):
        real = generate_speculative(target, ids, WeaverProposer(drafter, target.model, weaver, BestFirstPolicy(budget), 2,
                                                                lookahead=True), 20, stop_token_ids=()).stats
        rep = replay(streams, FixedBudget(budget), cost)
        assert rep.tree_sizes == real.tree_sizes and rep.accept_lengths[:-1] == real.accept_lengths[:-1]


WEAVER_SAMPLES = 800  # sample-and-match is lossless for any fixed tree: this checks the Weaver tree's plumbing, cheaply


def test_weaver_sampling_matches_target(small_vocab_target):
    from drafttree.sampling import SamplingParams

    path, hf = small_vocab_target
    target = load_target(str(path))
    params = SamplingParams(temperature=0.8, top_p=0.95)
    base = torch.tensor([3, 17, 5, 9])
    prompt = torch.cat([base, torch.tensor(generate_ar(target, base, 8, stop_token_ids=()).tokens)])
    drafter = random_drafter_for(target.model, block_size=4)
    proposer = WeaverProposer(drafter, target.model, weaver_for(target, drafter, k=12), BestFirstPolicy(6), width=3)
    # drafts were accepted, so deep tree sampling is exercised
    assert_sampling_matches_target(target, hf, prompt, proposer, params, WEAVER_SAMPLES, WEAVER_SAMPLES // 20)


def test_smollm2_greedy_equals_ar():
    """The shipped drafter (fp32) with a Weaver whose residual is random: one short real prompt."""
    from drafttree.methods import load_drafter_for

    target = load_target("smollm2-135m-instruct", dtype="float32", threads=1)
    drafter = load_drafter_for(target)
    weaver = weaver_for(target, drafter, k=32)
    ids = target.encode_chat("What is 17 * 23?")
    ar = generate_ar(target, ids, 12, stop_token_ids=()).tokens
    for policy, width in ((BestFirstPolicy(16), 8), (CostAwarePolicy(synthetic_cost_model(), max_tree_nodes=32), 4)):
        res = generate_speculative(target, ids, WeaverProposer(drafter, target.model, weaver, policy, width, call_ms=0.3),
                                   12, stop_token_ids=())
        assert res.tokens == ar

