"""The lookup methods on the real model (fp32, the shipped drafter): greedy output equals AR token for token, and
on a prompt whose reply copies it the lookup's candidates are accepted."""
import pytest

from drafttree.costmodel import ConvexCost, VerifyCostModel
from drafttree.datasets import load_prompts
from drafttree.engine import generate_ar, generate_speculative
from drafttree.methods import SHIPPED_DRAFTERS, load_drafter_for, make_proposer

pytestmark = pytest.mark.skipif(not (SHIPPED_DRAFTERS["smollm2-135m-instruct"] / "config.json").exists(),
                                reason="no drafter shipped yet")
NEW_TOKENS = 64


def cpu_like_cost_model() -> VerifyCostModel:
    # as in test_smollm2_speculative: the shape measured on these machines, fixed so the test is deterministic
    curve = ConvexCost(knots=(1.0, 8.0, 32.0, 128.0), values=(30.0, 36.0, 66.0, 200.0))
    return VerifyCostModel(context_lens=(0,), curves=(curve,), draft_ms=8.0)


@pytest.fixture(scope="module")
def copy_cases(smollm2):
    """(prompt ids, AR's 64 greedy tokens, copies?) for a copy-set prompt (type hints on a stdlib function: the reply
    restates it); fp32 on two cores is slow, so one prompt keeps this test short."""
    target, _ = smollm2
    texts = [(load_prompts("copy", 1)[0], True)]  # HumanEval and the rest: check-lossless, and the tiny models
    cases = []
    for text, copies in texts:
        ids = target.encode_chat(text)
        cases.append((ids, generate_ar(target, ids, NEW_TOKENS, stop_token_ids=()).tokens, copies))
    return cases


@pytest.mark.parametrize("method", ["lookup", "lookup-ddtree", "lookup-caddtree"])
def test_lookup_greedy_equals_ar(smollm2, copy_cases, method):
    target, _ = smollm2
    proposer = make_proposer(method, target, None if method == "lookup" else load_drafter_for(target), budget=16,
                             cost_model=cpu_like_cost_model())
    for ids, ar, copies in copy_cases:
        res = generate_speculative(target, ids, proposer, max_new_tokens=NEW_TOKENS, stop_token_ids=())
        assert res.tokens == ar
        if copies:  # the reply copies its prompt: lookup candidates are verified and accepted
            assert sum(res.stats.accept_lengths) - res.stats.rounds > 0
            assert res.stats.tau > 1.3, res.stats.accept_lengths
