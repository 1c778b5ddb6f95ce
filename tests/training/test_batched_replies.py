"""Bulk self-distillation through transformers' batched generate: left-padded prompts of different
lengths give the same replies as our AR and the same features as our runtime's prefill."""
import torch
from transformers import AutoModelForCausalLM

from drafttree.training.batched_replies import generate_batch
from drafttree.engine import generate_ar
from drafttree.load import load_target
from drafttree.sampling import SamplingParams


def test_batched_replies_match_runtime(tiny_checkpoint):
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    layers = (0, target.model.config.num_layers - 2)
    prompts = [torch.tensor([5, 9, 2, 33]), torch.tensor([7]), torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9])]
    out = generate_batch(hf, prompts, 12, SamplingParams(), layers, stop_ids=set(), pad_id=0)
    model = target.model
    for p, (tokens, feats, plen, _, _) in zip(prompts, out):
        reply = generate_ar(target, p, max_new_tokens=12, stop_token_ids=()).tokens
        assert plen == p.numel() and tokens.tolist() == p.tolist() + reply[:-1]  # the last reply token is only predicted
        ref = model.prefill(model.new_state(64), tokens, capture_layers=layers).features
        assert feats.shape == ref.shape
        torch.testing.assert_close(feats, ref, atol=1e-4, rtol=1e-4)


def test_stop_token_ends_a_reply(tiny_checkpoint):
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    p = torch.tensor([5, 9, 2, 33])
    reply = generate_ar(target, p, max_new_tokens=12, stop_token_ids=()).tokens
    stop = reply[3]
    first = reply.index(stop)
    (tokens, feats, plen, _, _), = generate_batch(hf, [p], 12, SamplingParams(), (0,), stop_ids={stop}, pad_id=0)
    assert tokens.tolist() == p.tolist() + reply[:first]  # cut at the stop token, which is only predicted
    assert feats.shape[0] == tokens.numel()


def test_last_layer_is_refused(tiny_checkpoint):
    import pytest

    path, _ = tiny_checkpoint
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with pytest.raises(ValueError, match="final norm"):
        generate_batch(hf, [torch.tensor([1, 2])], 4, SamplingParams(), (hf.config.num_hidden_layers - 1,), set(), 0)


def test_hf_model_for_a_target_has_its_weights(tiny_checkpoint):
    from drafttree.training.batched_replies import hf_model_for
    from drafttree.load import load_target

    path, _ = tiny_checkpoint
    target = load_target(str(path))
    hf, pad = hf_model_for(target, torch.float32)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    ref = target.model.prefill(target.model.new_state(16), ids[0]).logits[-1]
    torch.testing.assert_close(hf(ids).logits[0, -1], ref, atol=1e-4, rtol=1e-4)
    assert isinstance(pad, int)


def test_top_k_is_the_targets_distribution_at_each_reply_row(tiny_checkpoint):
    """Soft targets: row t of topk holds the target's top-k for token t (its forward at row t-1); prompt rows none."""
    path, _ = tiny_checkpoint
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = [torch.tensor([5, 9, 2, 33]), torch.tensor([7, 1])]
    for mode in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)):  # warpers must not touch the record
        for tokens, _, plen, ids, lps in generate_batch(hf, prompts, 8, mode, (0,), set(), 0, seed=3, top_k=4):
            assert ids.shape == lps.shape == (tokens.numel(), 4)
            assert torch.isinf(lps[:plen].float()).all()
            with torch.no_grad():
                logits = hf(tokens[None].clone()).logits[0]
            ref_lp, ref_ids = torch.log_softmax(logits[plen - 1:-1].float(), -1).topk(4, dim=-1)
            assert ids[plen:].tolist() == ref_ids.tolist()
            torch.testing.assert_close(lps[plen:].float(), ref_lp, atol=2e-3, rtol=2e-3)
            if mode.temperature == 0:
                assert ids[plen:, 0].tolist() == tokens[plen:].tolist()  # greedy: its top-1 is the token there
