"""Speculative sampling through the whole engine matches sampling from the target alone (χ² tests).

A tiny target (small vocabulary so that joint distributions can be enumerated exactly) decodes 3
tokens per run; t1 is sampled after prefill, t2 at the root of the first verified tree and t3 either
deeper in that tree (when t2 matched a draft) or at the next round's root. The exact AR distribution
of (t2, t3) is computed by enumeration, so 20k engine runs are compared against the truth itself.
"""
import pytest
import torch
from scipy.stats import chisquare

from drafttree.engine import generate_speculative
from drafttree.load import load_target
from drafttree.proposers import BestFirstPolicy, ChainPolicy
from drafttree.sampling import SamplingParams, sampling_probs
from spec_helpers import TargetCopyProposer

VOCAB = 24
SAMPLES = 6_000  # per test; enough for chi-square at p > 1e-3 on 9 + 81 cells (≈ 75 per pair cell), and the
# suite stays inside its time budget (each sample is a whole speculative generation: ~14 ms on a Zen 3)


@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None))
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.25)
    path = tmp_path_factory.mktemp("small_vocab")
    hf.eval().save_pretrained(path)
    return path, hf


def exact_pair_distribution(hf, prompt, params):
    """P(t2, t3) under plain sampling: sum over t1 of p(t1) p(t2|t1) p(t3|t1,t2), by enumeration."""
    with torch.no_grad():
        p1 = sampling_probs(hf(prompt[None]).logits[0, -1], params)
        seq1 = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], 1)
        p2 = sampling_probs(hf(seq1).logits[:, -1], params)  # [t1, t2]
        seq2 = torch.cat([seq1.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(VOCAB)[:, None]], 1)
        p3 = sampling_probs(hf(seq2).logits[:, -1], params).view(VOCAB, VOCAB, VOCAB)  # [t1, t2, t3]
    joint = (p1[:, None, None] * p2[:, :, None] * p3).sum(0)
    return p1, joint


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    probs = probs.flatten().double()
    expected = probs / probs.sum() * counts.sum()
    counts = counts.flatten().double()
    order = torch.argsort(expected, descending=True)
    expected, counts = expected[order], counts[order]
    keep = expected >= 5  # merge rare cells into one bin so the χ² approximation holds
    e = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    c = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    if e[-1] < 5:  # the merged bin is still too small: fold it into the last kept cell
        e, c = torch.cat([e[:-2], e[-2:].sum().view(1)]), torch.cat([c[:-2], c[-2:].sum().view(1)])
    return float(chisquare(c.numpy(), e.numpy()).pvalue)


def sample_three(target, prompt, proposer, params, samples):
    """Counts of the first token and of the (second, third) pair over `samples` speculative generations of 3
    tokens (seed = sample index), and how many first rounds accepted a draft."""
    first, pairs, deep = torch.zeros(VOCAB), torch.zeros(VOCAB, VOCAB), 0
    for i in range(samples):
        sp = SamplingParams(params.temperature, params.top_p, params.top_k, seed=i)
        res = generate_speculative(target, prompt, proposer, max_new_tokens=3, sampling=sp, stop_token_ids=())
        t1, t2, t3 = res.tokens
        first[t1] += 1
        pairs[t2, t3] += 1
        deep += res.stats.accept_lengths[0] > 1
    return first, pairs, deep


@pytest.mark.parametrize("params, policy", [(SamplingParams(temperature=0.7, top_p=0.9), ChainPolicy),
                                            (SamplingParams(temperature=1.0, top_k=8), lambda: BestFirstPolicy(6))],
                         ids=["chain-T0.7-top_p0.9", "ddtree6-T1.0-top_k8"])
def test_speculative_sampling_matches_target(small_vocab_target, params, policy):
    path, hf = small_vocab_target
    target = load_target(str(path))
    prompt = torch.tensor([3, 17, 5, 9])
    p1, joint = exact_pair_distribution(hf, prompt, params)
    proposer = TargetCopyProposer(path, policy(), noise=1.0, depth=3)
    first, pairs, deep = sample_three(target, prompt, proposer, params, SAMPLES)
    assert deep > SAMPLES // 10  # drafts were accepted often, so deep tree sampling is exercised
    assert chi2_pvalue(first, p1) > 1e-3
    assert chi2_pvalue(pairs, joint) > 1e-3


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
    p1, joint = exact_pair_distribution(hf, prompt, params)
    proposer = LookupDFlashProposer(DFlashProposer(random_drafter_for(target.model), target.model, BestFirstPolicy(6)))
    first, pairs, deep = sample_three(target, prompt, proposer, params, LOOKUP_SAMPLES)
    assert deep > LOOKUP_SAMPLES // 10
    assert chi2_pvalue(first, p1) > 1e-3
    assert chi2_pvalue(pairs, joint) > 1e-3
