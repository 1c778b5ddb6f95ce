"""Activation smoothing for the int8 path: the fold changes nothing in float arithmetic, leaves the residual stream
(the drafter's input) alone, and brings the int8 path closer to the float model when inputs have outlier channels."""
import copy

import torch

from drafttree.compute import choose_compute
from drafttree.engine import generate_ar
from drafttree.load import load_target
from drafttree.model.linear import quantize_target
from drafttree.model.smoothing import calibration_tokens, input_absmax, smooth_for_int8, smoothing_factors
from drafttree.ops.int8.naive import int8_linear_ref, quantize_rows


def float_model(path):
    return load_target(str(path), compute="fp32").model


def logits_and_hidden(model, ids):
    out = model.forward(model.new_state(ids.numel() + 1), ids, capture_layers=(0, 1),
                        logits_rows=torch.arange(ids.numel()))
    return out.logits, out.features


def test_the_fold_is_exact_in_float(tiny_checkpoint):
    """Every tiny family (GQA, biases, q/k norms): logits and the captured layers' outputs unchanged."""
    model = float_model(tiny_checkpoint[0])
    ids = torch.arange(5, 45) % model.config.vocab_size
    before_logits, before_hidden = logits_and_hidden(model, ids)
    smoothed = copy.deepcopy(model)
    assert smooth_for_int8(smoothed, calibration_tokens(None, model.config.vocab_size))
    after_logits, after_hidden = logits_and_hidden(smoothed, ids)
    torch.testing.assert_close(after_logits, before_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(after_hidden, before_hidden, rtol=1e-4, atol=1e-4)
    assert not torch.equal(smoothed.layers[0].input_norm.weight, model.layers[0].input_norm.weight)


def test_calibration_sees_every_linear_input(tiny_checkpoint):
    model = float_model(tiny_checkpoint[0])
    stats = input_absmax(model, calibration_tokens(None, model.config.vocab_size))
    cfg = model.config
    widths = {"qkv": cfg.hidden_size, "o": cfg.num_heads * cfg.head_dim, "gate_up": cfg.hidden_size,
              "down": cfg.intermediate_size}
    assert len(stats) == cfg.num_layers
    for layer in stats:
        assert {name: t.shape[0] for name, t in layer.items()} == widths
        assert all(bool((t > 0).all()) for t in layer.values())
    assert not any(h for layer in model.layers for lin in (layer.attn.qkv, layer.mlp.down)
                   for h in lin._forward_pre_hooks.values())  # hooks removed


def test_smoothing_shrinks_the_int8_error_of_outlier_channels():
    """A few input channels 40x larger than the rest (as real models have) leave per-row int8 activations a
    handful of levels for the others; the factors move that range into the weights' per-row scales."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g)
    x[:, :3] *= 40.0
    w = torch.randn(96, 128, generator=g) * 0.1
    exact = x @ w.T

    def int8_error(x, w):
        wq, ws = quantize_rows(w)
        return (int8_linear_ref(x, wq, ws) - exact).abs().mean().item()

    s = smoothing_factors(x.abs().amax(0), w.abs().amax(0), 0.6)
    assert int8_error(x / s, w * s) < 0.5 * int8_error(x, w)


def test_smoothing_brings_the_real_int8_model_closer_to_float(smollm2):
    """SmolLM2-135M: next-token KL to the fp32 model on two prompts' replies, int8 path with and without."""
    target = smollm2[0]
    model = target.model
    seqs = []
    for text in ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?", "Write a function to reverse a list."):
        ids = target.encode_chat(text)
        reply = generate_ar(target, ids, 24, stop_token_ids=()).tokens
        seqs.append(torch.cat([ids, torch.tensor(reply, dtype=torch.long)]))

    def logprobs(m):
        return torch.cat([m.forward(m.new_state(q.numel() + 1), q, logits_rows=torch.arange(q.numel() - 25, q.numel()))
                          .logits.log_softmax(-1) for q in seqs])

    ref = logprobs(model)
    kl = {}
    for smooth in (False, True):
        m = copy.deepcopy(model)
        if smooth:
            smooth_for_int8(m, calibration_tokens(target.tokenizer, m.config.vocab_size))
        got = logprobs(quantize_target(m, choose_compute("int8").isa))
        kl[smooth] = (ref.exp() * (ref - got)).sum(-1).mean().item()
    assert kl[True] < 0.75 * kl[False], kl


def test_hybrid_models_are_left_alone():
    class NotDense(torch.nn.Module):
        pass

    assert smooth_for_int8(NotDense(), []) is False


def test_calibration_text_uses_the_chat_template(smollm2):
    target = smollm2[0]
    seqs = calibration_tokens(target.tokenizer, target.model.config.vocab_size)
    assert len(seqs) == 3 and all(s.dtype == torch.long and 40 < s.numel() < 200 for s in seqs)
    text = target.tokenizer.decode(seqs[1])
    assert "fibonacci" in text and "<|im_start|>" in text
