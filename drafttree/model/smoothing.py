"""Activation smoothing for the int8 path (SmoothQuant, Xiao et al. 2023), folded into the float weights.

The int8 kernel quantizes each activation row with one scale, so a few large input channels leave the others a
handful of levels: on SmolLM2-135M the int8 path agreed with the float model on 93 % of next tokens. Dividing
input channel j by s_j and multiplying the weight's column j by s_j changes nothing in exact arithmetic and moves
part of the range into the weights, which are quantized per output row:

    s_j = max|x_j|^α / max|W_j|^(1-α)

where max|x_j| comes from one float forward over a fixed calibration text. The division is folded into what
produces the activation, so the int8 path gains no work: the RMSNorm weight before qkv and gate/up, the value rows
before o (heads sharing a KV head share a factor), the up rows before down (silu(gate)·up and gelu(gate)·up are
linear in up). The residual stream, and so the hidden states the drafter reads, are unchanged.

Applied by `load_target` to checkpoint directories and the embedded model on `--compute int8`; a GGUF file on the
int8 path is converted tensor by tensor and is not smoothed (yet). The LM head is not smoothed: it is the tied
embedding's int8 rows and is the same on the q4 path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .transformer import Transformer

@dataclass(frozen=True)
class SmoothingAlphas:
    """α per linear kind, chosen on GSM8K *train* questions (bench/int8_fidelity.py --sweep): the most of each
    input's range that can move into its weights before the weights' own rounding costs more than it saves.
    None leaves that kind as it is (a linear that does not go int8)."""

    qkv: float | None = 0.7
    o: float | None = 0.6
    gate_up: float | None = 0.7
    down: float | None = 0.5


# A fixed calibration text, written for this purpose: a chat turn each of arithmetic, code and prose, the kinds of
# text the model answers. Only per-channel maxima are taken from it.
CALIBRATION_TURNS = (
    ("A baker sells 14 loaves on Monday and twice as many on Tuesday. Each loaf costs $3. How much money does "
     "she make on the two days?",
     "On Tuesday she sells 2 * 14 = 28 loaves. Over both days that is 14 + 28 = 42 loaves, and 42 * 3 = 126. "
     "She makes $126."),
    ("Write a Python function that returns the n-th Fibonacci number.",
     "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
     "It runs in O(n) time and keeps two integers."),
    ("Explain in two sentences why the sky looks blue.",
     "Air molecules scatter short wavelengths of sunlight much more strongly than long ones (Rayleigh scattering). "
     "So blue light reaches our eyes from every direction of the sky, while the sun itself looks slightly yellow."),
)


def calibration_tokens(tokenizer, vocab_size: int) -> list[torch.Tensor]:
    """The calibration turns as the model reads them (its chat template when it has one); without a tokenizer
    (tiny test models), fixed pseudo-random ids."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab_size, (96,), generator=g) for _ in CALIBRATION_TURNS]
    out = []
    for question, answer in CALIBRATION_TURNS:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": question},
                                                 {"role": "assistant", "content": answer}], tokenize=True,
                                                return_dict=True)["input_ids"]
        else:
            ids = tokenizer.encode(question + "\n" + answer)
        out.append(torch.tensor(ids, dtype=torch.long))
    return out


def _smoothed_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    return {"qkv": layer.attn.qkv, "o": layer.attn.o, "gate_up": layer.mlp.gate_up, "down": layer.mlp.down}


@torch.inference_mode()
def input_absmax(model: Transformer, sequences: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Per layer, per smoothed linear: the largest |input| of each channel over the sequences (float forward)."""
    stats: list[dict[str, torch.Tensor]] = [{} for _ in model.layers]
    hooks = []
    for i, layer in enumerate(model.layers):
        for name, linear in _smoothed_linears(layer).items():
            def record(_module, args, i=i, name=name):
                seen = args[0].detach().float().abs().reshape(-1, args[0].shape[-1]).amax(0)
                stats[i][name] = torch.maximum(stats[i][name], seen) if name in stats[i] else seen
            hooks.append(linear.register_forward_pre_hook(record))
    try:
        for ids in sequences:
            model.forward(model.new_state(ids.numel() + 1), ids, logits_rows=ids.new_tensor([ids.numel() - 1]))
    finally:
        for h in hooks:
            h.remove()
    return stats


def smoothing_factors(x_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = max|x|^α / max|W|^(1-α) per input channel, kept within [1e-3, 1e3]."""
    return (x_absmax.clamp_min(1e-5) ** alpha / w_absmax.clamp_min(1e-5) ** (1 - alpha)).clamp(1e-3, 1e3)


@torch.inference_mode()
def smooth_for_int8(model: nn.Module, sequences: list[torch.Tensor], alphas: SmoothingAlphas = SmoothingAlphas()
                    ) -> bool:
    """Fold SmoothQuant factors into a float dense Transformer, in place, before its linears go int8. Returns False
    (and changes nothing) for models whose layers are not the dense decoder's (the GDN hybrids)."""
    if not isinstance(model, Transformer):
        return False
    stats = input_absmax(model, sequences)
    cfg = model.config
    kv, group, hd = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    inter = cfg.intermediate_size
    for layer, seen in zip(model.layers, stats):
        lin = _smoothed_linears(layer)
        for name, norm in (("qkv", layer.input_norm), ("gate_up", layer.post_norm)):
            if getattr(alphas, name) is None:
                continue
            s = smoothing_factors(seen[name], _column_absmax(lin[name]), getattr(alphas, name))
            norm.weight.div_(s.to(norm.weight.dtype))
            lin[name].weight.mul_(s.to(lin[name].weight.dtype))
        if alphas.o is not None:  # o's input channel (head h, dim d) is value channel (h // group, d): one factor each
            x = seen["o"].view(kv, group, hd).amax(1)
            w = _column_absmax(lin["o"]).view(kv, group, hd).amax(1)
            s_v = smoothing_factors(x, w, alphas.o).reshape(-1)
            _scale_rows(lin["qkv"], slice((cfg.num_heads + kv) * hd, (cfg.num_heads + 2 * kv) * hd), 1 / s_v)
            lin["o"].weight.mul_(s_v.view(kv, 1, hd).expand(kv, group, hd).reshape(1, -1).to(lin["o"].weight.dtype))
        if alphas.down is not None:  # down's input is act(gate) * up, linear in up
            s = smoothing_factors(seen["down"], _column_absmax(lin["down"]), alphas.down)
            _scale_rows(lin["gate_up"], slice(inter, 2 * inter), 1 / s)
            lin["down"].weight.mul_(s.to(lin["down"].weight.dtype))
    return True


def _column_absmax(linear: nn.Linear) -> torch.Tensor:
    return linear.weight.detach().float().abs().amax(0)


def _scale_rows(linear: nn.Linear, rows: slice, factor: torch.Tensor) -> None:
    linear.weight[rows].mul_(factor.to(linear.weight.dtype)[:, None])
    if linear.bias is not None:
        linear.bias[rows].mul_(factor.to(linear.bias.dtype))
