"""The interfaces the engine relies on, declared: a target model, a proposer and a tree policy.

Every per-request thing lives in a state object the implementation creates and the caller holds
(`TargetModel.new_state`, `Proposer.begin`, `TreePolicy.new_state`); the implementations hold weights
and settings only, so one of each serves any number of requests at once.

The tree budget travels under one name here: a proposer's `max_nodes`, the most draft nodes a round's tree
can hold (the target state keeps that many scratch rows). A DFlash proposer takes it from its policy's
`max_nodes(depth)` (a chain: the depth; DDTree: its `budget`; CaDDTree: its `max_tree_nodes` cap, under which
its stop rule picks the size); the lookup alone from its own `budget`.

mypy checks these against the code that calls them and the classes that implement them (tests/test_types.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, TypeVar

import torch

from .marginals import Scores
from .model.decoder import ForwardOutput
from .model.state import ModelState
from .model.verify_input import VerifyInput
from .tree import DraftTree

Clock = Callable[[], float]  # seconds; a request's own busy time, so other requests' rounds do not count

class RequestState(Protocol):
    """What the engine reads of a proposer's per-request state (a request's memory use, for the server)."""

    @property
    def nbytes(self) -> int: ...


S = TypeVar("S")  # a tree policy's per-request state
R = TypeVar("R", bound=RequestState)  # a proposer's per-request state
D = TypeVar("D")  # what a proposer's `draft` hands its `build_tree` (its own kind: logits, lazy scores, continuations)


@dataclass(frozen=True)
class BatchTurn:
    """What a proposer sizing several requests' trees together (Proposer.build_trees) knows of the batched turn
    their rows share: engine.step_many's one verify forward."""

    requests: int  # sequences whose rows the turn's forward holds (this proposer's and any other's): a root each
    draft_ms: float  # what drafting this proposer's requests of the turn took (shared: draft_many)


class TargetConfig(Protocol):
    """The config fields the engine reads."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_position_embeddings(self) -> int: ...


class TargetModel(Protocol):
    """What the engine and the proposers call on a target (drafttree.model.decoder.CausalLM)."""

    @property
    def config(self) -> TargetConfig: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def new_state(self, max_len: int) -> ModelState: ...

    def prefill(self, state: ModelState, tokens: torch.Tensor, capture_layers: tuple[int, ...] = ()) -> ForwardOutput: ...

    def forward(self, state: ModelState, tokens: torch.Tensor) -> ForwardOutput: ...  # AR: tokens after the cache

    def verify(self, state: ModelState, batch: VerifyInput, capture_layers: tuple[int, ...] = ()) -> ForwardOutput: ...

    def verify_many(self, states: list[ModelState], batches: list[VerifyInput],
                    capture_layers: list[tuple[int, ...]]) -> list[ForwardOutput]: ...

    def commit(self, state: ModelState, rows: torch.Tensor) -> None: ...

    def embed(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def row_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # final hidden states -> the forward's own logits


class TreePolicy(Protocol[S]):
    """How a round's marginals [D, Vd] (a tensor or marginals.LazyDraftScores) become a draft tree (token_ids
    [Vd]: the target id of each column when the drafter has a reduced vocabulary; None: the columns are the ids).
    S: the policy's per-request state (None for stateless policies)."""

    name: str
    trim_block: bool  # the drafter's block stops at max_depth (the policy never places deeper nodes)
    follow_depth: bool  # with trim_block: a block one depth past the request's last tree (DFlashProposer.follow)

    def new_state(self, clock: Clock) -> S: ...

    def max_nodes(self, depth: int) -> int: ...

    def max_depth(self, depth: int) -> int: ...

    def build(self, state: S, root: int, logits: Scores, context_len: int,
              token_ids: torch.Tensor | None = None) -> DraftTree: ...

    def build_many(self, states: list[S], roots: list[int], logits: list[Scores], context_lens: list[int],
                   token_ids: torch.Tensor | None, turn: BatchTurn) -> list[DraftTree]: ...  # build, for requests
    # whose rows share one batched verify forward (a cost-aware policy sizes their trees together)

    def record_acceptance(self, state: S, accepted_draft_nodes: int) -> None: ...

    def interrupt(self, state: S) -> None: ...  # rounds without the policy's tree ran since its last build


class Proposer(Protocol[R, D]):
    """What a speculative round verifies. R: its per-request state; D: what `draft` returns for `build_tree`.
    The engine holds both as opaque values (a bare `Proposer` is Proposer[Any, Any])."""

    name: str
    capture_layers: tuple[int, ...]  # target layers whose hidden states the proposer reads
    max_nodes: int  # the largest tree it builds (the target state needs that many scratch rows)
    batch_drafts: bool  # draft_many shares work across requests (engine.step_many then drafts a turn's together)

    def begin(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None, clock: Clock) -> R: ...

    def draft(self, state: R, root: int, start: int) -> D: ...

    def draft_many(self, states: list[R], roots: list[int], starts: list[int]) -> list[D]: ...  # one round each,
    # drafted together where the proposer can (engine.step_many: the requests of one batched turn)

    def build_tree(self, state: R, root: int, drafted: D, start: int) -> DraftTree: ...

    def build_trees(self, states: list[R], roots: list[int], drafted: list[D], starts: list[int],
                    turn: BatchTurn) -> list[DraftTree]: ...  # build_tree for requests of one batched turn, their
    # sizes chosen together where the proposer can (a cost-aware policy: policies.caddtree_select_batch)

    def advance(self, state: R, accepted_tokens: torch.Tensor, accepted_features: torch.Tensor | None,
                start: int) -> None: ...

