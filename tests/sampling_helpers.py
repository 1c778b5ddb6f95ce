"""Exact joint distributions of a small-vocabulary target and χ² tests against speculative sampling."""
import torch
from scipy.stats import chisquare

from drafttree.engine import generate_speculative
from drafttree.sampling import SamplingParams, sampling_probs


VOCAB = 24


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


def assert_sampling_matches_target(target, hf, prompt, proposer, params, samples: int, min_deep: int) -> None:
    """χ² against the exact distributions: the first token, and the (second, third) pair; at least `min_deep`
    first rounds accepted a draft, so sampling deep in a tree is exercised."""
    p1, joint = exact_pair_distribution(hf, prompt, params)
    first, pairs, deep = sample_three(target, prompt, proposer, params, samples)
    assert deep > min_deep
    assert chi2_pvalue(first, p1) > 1e-3
    assert chi2_pvalue(pairs, joint) > 1e-3
