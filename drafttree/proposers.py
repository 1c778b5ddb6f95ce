"""Proposers: what a speculative round verifies. A DFlash drafter gives per-position marginals;
a tree policy turns them into a chain, a fixed-budget DDTree or a cost-aware CaDDTree.
Interfaces: drafttree.protocols; per-request state: DFlashState (the caller holds it)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from .costmodel import VerifyCostModel, build_caddtree
from .drafter.model import DraftContext
from .model.linear import head_rows_source
from .protocols import Clock
from .recalibrate import RoundCalibrator
from .tree import DraftTree, build_best_first_tree, build_chain_tree


class _Stateless:
    """Policies whose trees depend on the marginals alone."""

    def new_state(self, clock) -> None:
        return None

    def record_acceptance(self, state, accepted_draft_nodes: int) -> None:
        pass

    def max_depth(self, depth: int) -> int:
        """The deepest node this policy can place (a tree of n nodes is at most n deep): the drafter's
        head runs for no deeper position."""
        return min(depth, self.max_nodes(depth))


@dataclass
class ChainPolicy(_Stateless):
    """The drafter's argmax at every depth (DFlash's own loop)."""

    name = "chain"

    def max_nodes(self, depth: int) -> int:
        return depth

    def build(self, state, root: int, logits: torch.Tensor, context_len: int) -> DraftTree:
        return build_chain_tree(root, logits.argmax(-1))


@dataclass
class BestFirstPolicy(_Stateless):
    """DDTree: the `budget` most probable prefixes under the drafter's marginals."""

    budget: int
    name = "ddtree"

    def max_nodes(self, depth: int) -> int:
        return self.budget

    def build(self, state, root: int, logits: torch.Tensor, context_len: int) -> DraftTree:
        return build_best_first_tree(root, logits.log_softmax(-1), self.budget)


@dataclass
class CalibrationState:
    """caddtree-online's per-request memory: what its rounds took and accepted."""

    clock: Clock
    calibrator: RoundCalibrator = field(default_factory=RoundCalibrator)
    last_round: tuple[float, float, float] | None = None  # (build time, modelled ms, Φ) of the round in flight


@dataclass
class CostAwarePolicy:
    """CaDDTree: grow the best-first tree while modelled throughput (1 + Φ)/(C_d + C_v(n, ℓ)) improves.

    With `recalibrate`, the round times and acceptances seen so far in the request correct the cost
    model's unmodelled overhead and the drafter's confidence (drafttree.recalibrate)."""

    cost_model: VerifyCostModel
    max_tree_nodes: int = 128
    recalibrate: bool = False
    max_tree_depth: int = 8  # deeper nodes' path probabilities rarely pay for the head rows they need on CPU
    name = "caddtree"

    def __post_init__(self):
        self.name = "caddtree-online" if self.recalibrate else "caddtree"

    def new_state(self, clock: Clock) -> CalibrationState | None:
        return CalibrationState(clock) if self.recalibrate else None

    def max_nodes(self, depth: int) -> int:
        return self.max_tree_nodes

    def max_depth(self, depth: int) -> int:
        return min(depth, self.max_tree_nodes, self.max_tree_depth)

    def build(self, state: CalibrationState | None, root: int, logits: torch.Tensor, context_len: int) -> DraftTree:
        if state is None:  # the paper's rule: no bookkeeping on the hot path
            return build_caddtree(root, logits.log_softmax(-1), self.cost_model, context_len, self.max_tree_nodes)[0]
        now, cal = state.clock(), state.calibrator
        if state.last_round is not None:
            # build-to-build = this round's verify + commit + context update + next draft
            cal.observe_time(state.last_round[1], (now - state.last_round[0]) * 1e3)
        overhead = cal.overhead_ms
        tree, sel = build_caddtree(root, logits.log_softmax(-1), self.cost_model, context_len, self.max_tree_nodes,
                                   overhead, cal.accept_scale)
        phi = sum(math.exp(n.path_logprob) for n in sel.nodes)  # unscaled: what the drafter itself predicted
        state.last_round = (now, sel.round_ms - overhead, phi)
        return tree

    def record_acceptance(self, state: CalibrationState | None, accepted_draft_nodes: int) -> None:
        if state is not None and state.last_round is not None:
            state.calibrator.observe_acceptance(state.last_round[2], accepted_draft_nodes)


@dataclass
class DFlashState:
    """One request's proposer state: the drafter's context and the policy's memory."""

    context: DraftContext
    policy: object | None

    @property
    def nbytes(self) -> int:
        return self.context.nbytes


class DFlashProposer:
    """Drafts with a DFlash drafter whose per-request context K/V grow only by newly committed tokens."""

    def __init__(self, drafter, target_model, policy):
        self.drafter, self.model, self.policy = drafter, target_model, policy
        self.capture_layers = tuple(drafter.config.target_layer_ids)
        self.depth = drafter.config.block_size - 1
        self.max_nodes = policy.max_nodes(self.depth)
        self.draft_depth = policy.max_depth(self.depth)
        self.name = policy.name
        # A reduced draft vocabulary needs the head's rows; otherwise the target's own head (its path) is used.
        self.lm_head = head_rows_source(target_model) if drafter.config.draft_vocab_size else target_model.logits

    def begin(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor, clock: Clock = time.perf_counter) -> DFlashState:
        """Drafter prefill: context K/V of the whole prompt."""
        state = DFlashState(self.drafter.new_context(prompt_features.shape[0] + self.drafter.config.block_size + 64),
                            self.policy.new_state(clock))
        self.drafter.extend_context(state.context, prompt_features, torch.arange(prompt_features.shape[0]))
        return state

    def draft(self, state: DFlashState, root: int, start: int) -> torch.Tensor:
        """[D, V] drafter logits for positions start+1 .. start+D, D = the deepest node the policy can place
        (a tree of n nodes is at most n deep): no head rows for depths no tree reaches."""
        block = self.drafter.block_embeds(root, self.model.embed)
        hidden = self.drafter.draft(state.context, block, start)
        return self.drafter.draft_logits(hidden[1:1 + self.draft_depth], self.lm_head)

    def build_tree(self, state: DFlashState, root: int, logits: torch.Tensor, start: int) -> DraftTree:
        return self.policy.build(state.policy, root, logits, start)

    def advance(self, state: DFlashState, accepted_tokens: torch.Tensor, accepted_features: torch.Tensor,
                start: int) -> None:
        """Append the accepted nodes (root first) to the drafter's context."""
        n = accepted_features.shape[0]
        self.policy.record_acceptance(state.policy, n - 1)
        self.drafter.extend_context(state.context, accepted_features, torch.arange(start, start + n))
