"""The interfaces the engine relies on, declared: a target model, a proposer and a tree policy.

Every per-request thing lives in a state object the implementation creates and the caller holds
(`TargetModel.new_state`, `Proposer.begin`, `TreePolicy.new_state`); the implementations hold weights
and settings only, so one of each serves any number of requests at once.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from .model.decoder import ForwardOutput
from .model.state import ModelState
from .model.verify_input import VerifyInput
from .tree import DraftTree

Clock = Callable[[], float]  # seconds; a request's own busy time, so other requests' rounds do not count


class TargetModel(Protocol):
    config: object  # vocab_size, num_layers, max_position_embeddings, ...
    dtype: torch.dtype

    def new_state(self, max_len: int) -> ModelState: ...

    def prefill(self, state: ModelState, tokens: torch.Tensor, capture_layers: tuple[int, ...] = ()) -> ForwardOutput: ...

    def verify(self, state: ModelState, batch: VerifyInput, capture_layers: tuple[int, ...] = ()) -> ForwardOutput: ...

    def commit(self, state: ModelState, rows: torch.Tensor) -> None: ...

    def embed(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class TreePolicy(Protocol):
    """How a round's marginals [D, Vd] become a draft tree (token_ids [Vd]: the target id of each column
    when the drafter has a reduced vocabulary; None: the columns are the ids)."""

    name: str

    def new_state(self, clock: Clock) -> object | None: ...

    def max_nodes(self, depth: int) -> int: ...

    def max_depth(self, depth: int) -> int: ...

    def build(self, state, root: int, logits: torch.Tensor, context_len: int,
              token_ids: torch.Tensor | None = None) -> DraftTree: ...

    def record_acceptance(self, state, accepted_draft_nodes: int) -> None: ...


class Proposer(Protocol):
    """What a speculative round verifies."""

    name: str
    capture_layers: tuple[int, ...]  # target layers whose hidden states the proposer reads
    max_nodes: int  # the largest tree it builds (the target state needs that many scratch rows)

    def begin(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None, clock: Clock) -> object: ...

    def draft(self, state, root: int, start: int) -> torch.Tensor: ...

    def build_tree(self, state, root: int, drafted: torch.Tensor, start: int) -> DraftTree: ...

    def advance(self, state, accepted_tokens: torch.Tensor, accepted_features: torch.Tensor | None,
                start: int) -> None: ...
