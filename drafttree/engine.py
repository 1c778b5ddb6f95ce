"""Decode loops: plain autoregressive decoding (the reference) and speculative decoding with any proposer.

Speculation is lossless by construction: every emitted token is the target's own choice (its argmax,
or a sample from `sampling_probs`) given the committed prefix; drafts only decide how many of those
choices one target forward can confirm.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from .sampling import SamplingParams, next_token, sampling_probs
from .stats import GenerationStats
from .target import Target
from .verify import Acceptance, accept_greedy, accept_sampling


@dataclass
class GenerationResult:
    tokens: list[int]
    stats: GenerationStats
    text: str | None = None


class _Emitter:
    """Collects new tokens, stops at a stop token or max_new_tokens, streams to a callback."""

    def __init__(self, max_new_tokens: int, stop_ids: set[int], on_tokens: Callable[[list[int]], None] | None):
        self.tokens: list[int] = []
        self.max_new, self.stop_ids, self.on_tokens = max_new_tokens, stop_ids, on_tokens
        self.done = max_new_tokens <= 0

    def add(self, new: list[int]) -> None:
        room = self.max_new - len(self.tokens)
        kept = new[:room]
        for i, t in enumerate(kept):
            if t in self.stop_ids:
                kept = kept[: i + 1]
                self.done = True
                break
        self.tokens.extend(kept)
        if len(self.tokens) >= self.max_new:
            self.done = True
        if kept and self.on_tokens is not None:
            self.on_tokens(kept)


def _check_prompt(prompt_ids: torch.Tensor) -> torch.Tensor:
    prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if prompt_ids.ndim != 1 or prompt_ids.numel() == 0:
        raise ValueError(f"prompt must be a non-empty 1-D sequence of token ids, got shape {tuple(prompt_ids.shape)}")
    return prompt_ids


def _start(target: Target, prompt_ids, max_new_tokens, slack, stop_token_ids, method):
    prompt_ids = _check_prompt(prompt_ids)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    model = target.model
    vocab = model.config.vocab_size
    if int(prompt_ids.max()) >= vocab or int(prompt_ids.min()) < 0:
        raise ValueError(f"prompt token ids must lie in [0, {vocab})")
    model.reset()
    model.setup_cache(prompt_ids.numel() + max_new_tokens + slack + 1)
    stops = set(target.stop_token_ids if stop_token_ids is None else stop_token_ids)
    return prompt_ids, model, stops, GenerationStats(method, prompt_tokens=prompt_ids.numel())


def generate_ar(
    target: Target,
    prompt_ids,
    max_new_tokens: int = 256,
    sampling: SamplingParams = SamplingParams(),
    stop_token_ids=None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """Plain autoregressive decoding: one target forward per token."""
    prompt_ids, model, stops, stats = _start(target, prompt_ids, max_new_tokens, 0, stop_token_ids, "ar")
    gen = None if sampling.greedy else sampling.generator()
    out = _Emitter(max_new_tokens, stops, on_tokens)
    if out.done:
        return GenerationResult(out.tokens, stats)
    t0 = time.perf_counter()
    logits = model.prefill(prompt_ids).logits[-1]
    stats.prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    first = torch.zeros(1, dtype=torch.long)
    while True:
        token = next_token(logits, sampling, gen).view(1)
        out.add([int(token)])
        stats.rounds += 1
        stats.accept_lengths.append(1)
        if out.done:
            break
        with stats.timed("verify_s"):
            logits = model.forward(token).logits[-1]
            model.commit(first)
    stats.total_s = time.perf_counter() - t0
    stats.new_tokens = len(out.tokens)
    return GenerationResult(out.tokens, stats)


def walk_tree(tree, logits: torch.Tensor, sampling: SamplingParams, gen) -> Acceptance:
    """Greedy: follow the target's argmax; sampling: sample the target at each visited node (lossless)."""
    if sampling.greedy:
        return accept_greedy(tree, logits.argmax(-1))
    return accept_sampling(tree, lambda i: sampling_probs(logits[i], sampling), gen)


def generate_speculative(
    target: Target,
    prompt_ids,
    proposer,
    max_new_tokens: int = 256,
    sampling: SamplingParams = SamplingParams(),
    stop_token_ids=None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """Draft a tree, verify it in one target forward, commit the accepted path, repeat."""
    prompt_ids, model, stops, stats = _start(target, prompt_ids, max_new_tokens, proposer.max_nodes, stop_token_ids,
                                             proposer.name)
    gen = None if sampling.greedy else sampling.generator()
    out = _Emitter(max_new_tokens, stops, on_tokens)
    if out.done:
        return GenerationResult(out.tokens, stats)
    layers = proposer.capture_layers
    t0 = time.perf_counter()
    pre = model.prefill(prompt_ids, capture_layers=layers)
    proposer.begin(prompt_ids, pre.features)  # the drafter's prompt pass counts as prefill, and is reported
    root = int(next_token(pre.logits[-1], sampling, gen))
    stats.prefill_s = time.perf_counter() - t0
    out.add([root])
    t0 = time.perf_counter()
    while not out.done:
        start = model.cache_len
        with stats.timed("draft_s"):
            drafted = proposer.draft(root, start)
        with stats.timed("tree_s"):
            tree = proposer.build_tree(root, drafted, start)
        with stats.timed("verify_s"):
            res = model.forward(tree.tokens, tree.positions(start), tree.ancestor_mask, capture_layers=layers)
            acc = walk_tree(tree, res.logits, sampling, gen)
            model.commit(acc.nodes)
        with stats.timed("draft_s"):
            proposer.observe(tree.tokens[acc.nodes], None if layers == () else res.features[acc.nodes], start)
        out.add(acc.committed_tokens(tree).tolist())
        stats.rounds += 1
        stats.accept_lengths.append(acc.nodes.numel())
        stats.tree_sizes.append(tree.num_draft_nodes)
        root = acc.bonus_token
    stats.total_s = time.perf_counter() - t0
    stats.new_tokens = len(out.tokens)
    return GenerationResult(out.tokens, stats)
