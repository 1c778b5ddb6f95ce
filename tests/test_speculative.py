"""Every speculative method reproduces AR greedy decoding token for token (fp32, tiny models)."""
import pytest

from drafttree.engine import generate_ar, generate_speculative
from drafttree.load import load_target
from drafttree.proposers import BestFirstPolicy, ChainPolicy, CostAwarePolicy, DFlashProposer
from spec_helpers import TargetCopyProposer, prompts, random_drafter_for, synthetic_cost_model



POLICIES = {
    "chain": lambda: ChainPolicy(),
    "ddtree4": lambda: BestFirstPolicy(4),
    "ddtree16": lambda: BestFirstPolicy(16),
    "ddtree64": lambda: BestFirstPolicy(64),
    "ddtree256": lambda: BestFirstPolicy(256),
    "caddtree": lambda: CostAwarePolicy(synthetic_cost_model(), max_tree_nodes=64),
    "caddtree-recalibrated": lambda: CostAwarePolicy(synthetic_cost_model(), max_tree_nodes=64, recalibrate=True),
}




@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("noise", [0.0, 3.0])
def test_greedy_equals_ar_with_target_copy_drafts(tiny_checkpoint, policy, noise):
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    proposer = TargetCopyProposer(path, POLICIES[policy](), noise=noise)
    for ids in prompts(3, target.model.config.vocab_size):
        ar = generate_ar(target, ids, max_new_tokens=40, stop_token_ids=()).tokens
        res = generate_speculative(target, ids, proposer, max_new_tokens=40, stop_token_ids=())
        assert res.tokens == ar
        if noise == 0.0 and not policy.startswith("caddtree"):
            assert res.stats.tau > 1.5  # the perfect drafter is accepted


@pytest.mark.parametrize("policy", ["chain", "ddtree16", "caddtree"])
def test_greedy_equals_ar_with_dflash_drafter(tiny_checkpoint, policy):
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    proposer = DFlashProposer(random_drafter_for(target.model), target.model, POLICIES[policy]())
    for ids in prompts(2, target.model.config.vocab_size, seed=1):
        ar = generate_ar(target, ids, max_new_tokens=30, stop_token_ids=()).tokens
        assert generate_speculative(target, ids, proposer, max_new_tokens=30, stop_token_ids=()).tokens == ar


def test_stop_tokens_and_streaming(tiny_checkpoint):
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    ids = prompts(1, target.model.config.vocab_size)[0]
    ar = generate_ar(target, ids, max_new_tokens=30, stop_token_ids=()).tokens
    stop = ar[7]
    expected = ar[: ar.index(stop) + 1]
    streamed = []
    proposer = TargetCopyProposer(path, BestFirstPolicy(8))
    res = generate_speculative(target, ids, proposer, max_new_tokens=30, stop_token_ids=(stop,), on_tokens=streamed.extend)
    assert res.tokens == expected == streamed
    assert generate_ar(target, ids, max_new_tokens=30, stop_token_ids=(stop,)).tokens == expected
