"""Speculative sampling through the whole engine matches sampling from the target alone (χ² tests).

A tiny target (small vocabulary so that joint distributions can be enumerated exactly) decodes 3
tokens per run; t1 is sampled after prefill, t2 at the root of the first verified tree and t3 either
deeper in that tree (when t2 matched a draft) or at the next round's root. The exact AR distribution
of (t2, t3) is computed by enumeration, so 20k engine runs are compared against the truth itself.
"""
import pytest
import torch

from drafttree.load import load_target
from drafttree.proposers import BestFirstPolicy, ChainPolicy
from drafttree.sampling import SamplingParams
from spec_helpers import TargetCopyProposer
from sampling_helpers import assert_sampling_matches_target

SAMPLES = 6_000  # per test; enough for chi-square at p > 1e-3 on 9 + 81 cells (≈ 75 per pair cell), and the
# suite stays inside its time budget (each sample is a whole speculative generation: ~14 ms on a Zen 3)










@pytest.mark.parametrize("params, policy", [(SamplingParams(temperature=0.7, top_p=0.9), ChainPolicy),
                                            (SamplingParams(temperature=1.0, top_k=8), lambda: BestFirstPolicy(6))],
                         ids=["chain-T0.7-top_p0.9", "ddtree6-T1.0-top_k8"])
def test_speculative_sampling_matches_target(small_vocab_target, params, policy):
    path, hf = small_vocab_target
    target = load_target(str(path))
    prompt = torch.tensor([3, 17, 5, 9])
    proposer = TargetCopyProposer(path, policy(), noise=1.0, depth=3)
    # drafts were accepted often, so deep tree sampling is exercised
    assert_sampling_matches_target(target, hf, prompt, proposer, params, SAMPLES, SAMPLES // 10)


LOOKUP_SAMPLES = 4_000  # sample-and-match is lossless for any tree: this checks the lookup's plumbing


def test_lookup_sampling_matches_target(small_vocab_target):
    """lookup-ddtree: the drafter's marginals and lookup continuations in one tree. The prompt ends with the
    target's own greedy chain, so the lookup finds the sampled first token there and proposes what followed."""
    from drafttree.engine import generate_ar
    from drafttree.lookup import LookupDFlashProposer
    from drafttree.proposers import DFlashProposer
    from spec_helpers import random_drafter_for

    path, hf = small_vocab_target
    target = load_target(str(path))
    params = SamplingParams(temperature=0.7, top_p=0.9)
    base = torch.tensor([3, 17, 5, 9])
    prompt = torch.cat([base, torch.tensor(generate_ar(target, base, 16, stop_token_ids=()).tokens)])
    proposer = LookupDFlashProposer(DFlashProposer(random_drafter_for(target.model), target.model, BestFirstPolicy(6)))
    assert_sampling_matches_target(target, hf, prompt, proposer, params, LOOKUP_SAMPLES, LOOKUP_SAMPLES // 10)


def test_greedy_token_is_torch_argmax():
    """sampling.greedy_token (numpy's argmax on CPU floats) picks what torch.argmax picks: random rows, tied maxima
    (the first), a NaN (it counts as the maximum), all -inf, a strided view, and the dtypes it hands back to torch."""
    from drafttree.sampling import greedy_token

    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(49152, generator=gen) for _ in range(20)]
    tied = torch.zeros(100)
    tied[[7, 40, 99]] = 3.0
    nan = torch.randn(64, generator=gen)
    nan[[5, 30]] = float("nan")
    rows += [tied, nan, torch.full((10,), float("-inf")), torch.randn(8, 64, generator=gen)[:, 3],
             torch.randn(300, generator=gen).double(), torch.randn(300, generator=gen).bfloat16(),
             torch.randint(0, 5, (50,), generator=gen)]
    for row in rows:
        assert greedy_token(row) == int(row.argmax()), row.dtype
    with pytest.raises(ValueError, match="one row"):
        greedy_token(torch.zeros(2, 3))


def test_greedy_tokens_are_torch_argmax_per_row():
    """sampling.greedy_tokens (the batched generators' argmax): each row's torch.argmax, ties, NaN and -inf rows
    included, on contiguous, transposed and 3-D logits."""
    from drafttree.sampling import greedy_tokens

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 1000, generator=gen)
    x[3, [10, 500]] = 9.0
    x[5, 77] = float("nan")
    x[7] = float("-inf")
    for logits in (x, x.double(), torch.randn(300, 12, generator=gen).t(), torch.randn(2, 3, 50, generator=gen),
                   x.bfloat16()):
        got = greedy_tokens(logits)
        assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1)), logits.shape
