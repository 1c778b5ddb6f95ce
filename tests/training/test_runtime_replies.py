"""Self-distillation on drafttree's runtime: sequences decoded together (more prompts than the batch's width,
so finished ones are replaced mid-run) give exactly `generate_ar`'s greedy replies on the same compute path,
the prefill's features for every fed row, and the target's top-k at every reply row."""
import pytest
import torch

from drafttree.training.runtime_replies import generate_runtime
from drafttree.engine import generate_ar
from drafttree.load import load_target
from drafttree.sampling import SamplingParams

PROMPTS = [[5, 9, 2, 33], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [40, 41], [3, 1, 4, 1, 5, 9, 2, 6]]


@pytest.mark.parametrize("compute", ["q4", "int8", "fp32"])
def test_greedy_replies_equal_ar_with_features_and_top_k(tiny_checkpoint, compute):
    path, _ = tiny_checkpoint
    target = load_target(str(path), compute=compute)
    model, layers = target.model, (0, target.model.config.num_layers - 2)
    prompts = [torch.tensor(p) for p in PROMPTS]
    replies = [generate_ar(target, p, max_new_tokens=9, stop_token_ids=()).tokens for p in prompts]
    stop = replies[0][4]  # a stop token that ends some replies early and not others
    out = generate_runtime(model, prompts, 9, SamplingParams(), layers, {stop}, top_k=3, width=2)
    for p, ar, r in zip(prompts, replies, out):
        ar = ar[: ar.index(stop) + 1] if stop in ar else ar
        assert r.prompt_len == p.numel() and r.tokens.tolist() == p.tolist() + ar[:-1]  # the last one is only predicted
        ref = model.prefill(model.new_state(64), r.tokens, capture_layers=layers).features
        torch.testing.assert_close(r.features, ref, atol=1e-4, rtol=1e-4)
        assert r.topk_ids.shape == r.topk_logprobs.shape == (r.tokens.numel(), 3)
        assert torch.isinf(r.topk_logprobs[: p.numel()]).all()  # prompt rows: no soft target
        assert r.topk_ids[p.numel():, 0].tolist() == ar[:-1]  # greedy: each reply token is its row's top-1
        assert (r.topk_logprobs[p.numel():] <= 0).all()


def test_sampled_replies_run_to_their_length(tiny_checkpoint):
    path, _ = tiny_checkpoint
    target = load_target(str(path), compute="q4")
    prompts = [torch.tensor(p) for p in PROMPTS]
    out = generate_runtime(target.model, prompts, 6, SamplingParams(temperature=0.8, top_p=0.95), (0,), set(),
                           torch.Generator().manual_seed(0), width=3)
    assert [r.tokens.numel() - r.prompt_len for r in out] == [5] * len(prompts)
    assert all(r.features.shape[0] == r.tokens.numel() and r.topk_ids is None for r in out)
