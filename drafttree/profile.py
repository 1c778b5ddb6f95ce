"""`drafttree profile`: measure this machine's verify cost C_v(n, ℓ) and draft cost C_d for CaDDTree.

The verify measurement is the engine's verify step: one target forward over n tokens with a
tree mask, the drafter's features captured and logits for every row (the engine computes fewer: an upper
bound), on top of ℓ cached tokens.
"""
from __future__ import annotations

import time

import torch

from .costmodel import VerifyCostModel, profile_grid
from .marginals import LazyDraftScores
from .model.verify_input import VerifyInput
from .tree import random_tree

FULL_TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 129)
QUICK_TOKENS = (1, 2, 4, 8, 16, 32, 65)
FULL_CONTEXTS = (128, 512, 1024, 2048)
QUICK_CONTEXTS = (128, 1024)


def draft_cost_proposer(drafter, model):
    """The proposer whose round is C_d: CaDDTree's depth cap (the drafter's block trimmed to it), head rows computed
    lazily, so a measured round pays the drafter's layers and the first chunk of rows, what every CaDDTree round
    pays (deeper chunks are paid by the rounds that reach them; caddtree-online's recalibration sees their mean). Its
    block follows a one-deep tree, as CaDDTree's blocks follow the request's (mostly shallow) trees."""
    from .proposers import CostAwarePolicy, DFlashProposer

    policy = CostAwarePolicy(cost_model=None)  # only its depth cap: no tree is built here
    return DFlashProposer(drafter, model, policy)


def profile_costs(target, drafter, quick: bool = False, repeats: int | None = None, progress: bool = True,
                  token_counts=None, context_lens=None) -> VerifyCostModel:
    model = target.model
    proposer = draft_cost_proposer(drafter, model)
    tokens = token_counts or (QUICK_TOKENS if quick else FULL_TOKENS)
    contexts = context_lens or (QUICK_CONTEXTS if quick else FULL_CONTEXTS)
    repeats = repeats or (3 if quick else 7)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    room = max(contexts) + max(tokens) + proposer.drafter.config.block_size + 1
    prefilled = {"ctx": None, "state": None, "draft_state": None}

    def ensure_context(ctx: int) -> None:
        if prefilled["ctx"] != ctx:  # contexts are the outer loop: one prefill per context length
            prefilled["state"] = state = model.new_state(room)
            ids = torch.randint(0, vocab, (ctx,), generator=gen)
            out = model.prefill(state, ids, capture_layers=proposer.capture_layers) if ctx else None
            if out is not None:
                prefilled["draft_state"] = draft_state = proposer.begin(ids, out.features)
                if proposer.follow_depth:  # a round after a one-deep tree, as most CPU rounds follow
                    proposer.follow(draft_state, 1)
            prefilled["ctx"] = ctx

    def measure_verify(n: int, ctx: int) -> float:
        ensure_context(ctx)
        tree = random_tree(n - 1, vocab, "random", gen) if n > 1 else random_tree(0, vocab, "chain", gen)
        t0 = time.perf_counter()
        # every row's head: an upper bound of the engine's verify (the principal path's rows, one more head call a
        # walk that leaves it), which measured closer to the rounds CaDDTree's trees really cost than the principal
        # path of a random tree (Zen 4: trees sized on that curve grew 8.6 -> 10.0 ms a round for τ 1.79 -> 1.89)
        res = model.verify(prefilled["state"], VerifyInput.of_tree(tree, ctx), capture_layers=proposer.capture_layers)
        res.logits.argmax(-1)
        return (time.perf_counter() - t0) * 1e3

    def measure_draft(ctx: int) -> float:
        ensure_context(ctx)
        t0 = time.perf_counter()
        drafted = proposer.draft(prefilled["draft_state"], int(torch.randint(0, vocab, (1,), generator=gen)), ctx)
        if isinstance(drafted, LazyDraftScores):  # what every round pays: the first depths' rows
            drafted.logprobs_from(0)
        return (time.perf_counter() - t0) * 1e3

    return profile_grid(measure_verify, tokens, contexts, repeats=repeats, warmup=1,
                        draft_measure_fn=measure_draft, progress=progress)
