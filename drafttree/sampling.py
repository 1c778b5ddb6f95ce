"""Turning logits into the distribution a request samples from, and drawing from it.

Every decoding method (AR, chain, trees) goes through `sampling_probs`, so that speculative
sampling compares against exactly the distribution plain sampling would use.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .validate import check_sampling


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None

    def __post_init__(self):
        check_sampling(self.temperature, self.top_p, self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [..., V] (fp32) after temperature, top-k and top-p, as plain sampling uses them."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = sorted_x.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the first token always stays)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [..., V] (long tensor of shape [...]); generator None: torch's default one."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def _numpy_argmax_fits(logits: torch.Tensor) -> bool:
    """numpy's argmax gives torch's answer on non-empty CPU float32/float64 logits (first maximum, NaN as maximum)."""
    return logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and logits.numel() > 0


def greedy_token(logits: torch.Tensor) -> int:
    """The argmax of one row of logits [V]: the first of tied maxima, a NaN counting as the maximum (as torch.argmax,
    the reference: tests/test_sampling_lossless.py). Through numpy on CPU floats: ATen's argmax over SmolLM2's 49,152
    logits takes ~73 µs (1 or 2 threads, Emerald Rapids AVX-512), numpy's ~3 µs, and a greedy round takes one per
    node its walk visits: 2-3 % of a 3.5 ms decoding step each."""
    if logits.dim() != 1:
        raise ValueError(f"greedy_token takes one row of logits [V], got shape {tuple(logits.shape)}")
    if _numpy_argmax_fits(logits):
        return int(logits.detach().numpy().argmax())
    return int(logits.argmax())


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """greedy_token of every row of logits [..., V] (int64 [...]): the batched generators' step takes one per
    sequence (64 x 49,152 logits, 1 thread, Emerald Rapids AVX-512: ATen's argmax 5.0 ms, numpy's 0.45)."""
    if _numpy_argmax_fits(logits):
        return torch.from_numpy(logits.detach().numpy().argmax(-1))
    return logits.argmax(-1)


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Greedy argmax or one sample per row of logits [..., V]."""
    if params.greedy:
        return torch.tensor(greedy_token(logits)) if logits.dim() == 1 else greedy_tokens(logits)
    return sample_from(sampling_probs(logits, params), generator)
