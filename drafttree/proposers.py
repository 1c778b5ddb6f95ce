"""Proposers: what a speculative round verifies. A DFlash drafter gives per-position marginals;
a tree policy turns them into a chain, a fixed-budget DDTree or a cost-aware CaDDTree.
Interfaces: drafttree.protocols; per-request state: DFlashState (the caller holds it)."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn as nn

from .costmodel import VerifyCostModel
from .policies import CaddSelection, build_best_first_tree, build_caddtree, caddtree_select_batch
from .draft_gate import DraftGate, Gate, GateMemory
from .drafter.model import BlockRows, DraftContext
from .marginals import FIRST_CHUNK, FOLLOW_FIRST_CHUNK, LazyDraftScores, Scores, dense_logits, log_marginals
from .model.linear import head_rows_source
from .protocols import BatchTurn, Clock, Proposer, TargetModel, TreePolicy
from .recalibrate import RoundCalibrator
from .tree import DraftTree, best_first_nodes, build_chain_tree


class _Stateless:
    """Policies whose trees depend on the marginals alone."""

    trim_block = False  # the drafter's block keeps all its rows (DDTree's trees may use any depth)
    follow_depth = False

    def new_state(self, clock: Clock) -> None:
        return None

    def max_nodes(self, depth: int) -> int:
        raise NotImplementedError  # each policy's own

    def build_many(self, states: list, roots: list[int], logits: list[Scores], context_lens: list[int],
                   token_ids: torch.Tensor | None, turn: BatchTurn) -> list[DraftTree]:
        """A fixed-shape tree does not depend on the batch: each request's alone."""
        build = cast(TreePolicy, self).build
        return [build(state, root, x, n, token_ids) for state, root, x, n in zip(states, roots, logits, context_lens)]

    def record_acceptance(self, state, accepted_draft_nodes: int) -> None:
        pass

    def interrupt(self, state) -> None:
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

    def build(self, state: None, root: int, logits: Scores, context_len: int,
              token_ids: torch.Tensor | None = None) -> DraftTree:
        best = dense_logits(logits).argmax(-1)
        return build_chain_tree(root, best if token_ids is None else token_ids[best])


@dataclass
class BestFirstPolicy(_Stateless):
    """DDTree: the `budget` most probable prefixes under the drafter's marginals."""

    budget: int
    name = "ddtree"

    def max_nodes(self, depth: int) -> int:
        return self.budget

    def build(self, state: None, root: int, logits: Scores, context_len: int,
              token_ids: torch.Tensor | None = None) -> DraftTree:
        return build_best_first_tree(root, log_marginals(logits), self.budget, token_ids)


@dataclass
class CalibrationState:
    """caddtree-online's per-request memory: what its rounds took and accepted."""

    clock: Clock
    calibrator: RoundCalibrator = field(default_factory=RoundCalibrator)
    last_round: tuple[float, float, float] | None = None  # (build time, modelled ms, Φ) of the round in flight
    round_t0: float = 0.0  # the clock at the current round's build


@dataclass
class CostAwarePolicy:
    """CaDDTree: grow the best-first tree while modelled throughput (1 + Φ)/(C_d + C_v(n, ℓ)) improves.

    With `recalibrate`, the round times and acceptances seen so far in the request correct the cost
    model's unmodelled overhead and the drafter's confidence (drafttree.recalibrate)."""

    cost_model: VerifyCostModel
    max_tree_nodes: int = 128
    recalibrate: bool = False
    max_tree_depth: int = 8  # deeper nodes' path probabilities rarely pay for the head rows they need on CPU
    # nor for the drafter's rows: its block stops at the cap (measured on Zen 3: layers 4.0 -> 2.9 ms, τ -2 %)
    trim_block = True
    # the block also follows the request's trees (DFlashProposer.follow): on a Zen 3 (AVX2, 2 threads, 9 prompts)
    # draft 2.69 -> 2.00 ms a round with 2-row first head chunks, τ 1.61 -> 1.58. Replay (drafttree.apps.bench.replay)
    # records full-depth chain blocks, so it models blocks that do not follow (follow_depth=False; τ 1-2 % above)
    follow_depth: bool = True
    name = "caddtree"

    def __post_init__(self):
        self.name = "caddtree-online" if self.recalibrate else "caddtree"

    def new_state(self, clock: Clock) -> CalibrationState | None:
        return CalibrationState(clock) if self.recalibrate else None

    def max_nodes(self, depth: int) -> int:
        return self.max_tree_nodes

    def max_depth(self, depth: int) -> int:
        return min(depth, self.max_tree_nodes, self.max_tree_depth)

    def build(self, state: CalibrationState | None, root: int, logits: Scores, context_len: int,
              token_ids: torch.Tensor | None = None) -> DraftTree:
        if state is None:  # the paper's rule: no bookkeeping on the hot path
            return build_caddtree(root, log_marginals(logits), self.cost_model, context_len, self.max_tree_nodes,
                                  token_ids=token_ids)[0]
        overhead, scale = self.round_start(state)
        tree, sel = build_caddtree(root, log_marginals(logits), self.cost_model, context_len, self.max_tree_nodes,
                                   overhead, scale, token_ids)
        # unscaled: what the drafter itself predicted
        self.round_built(state, sel, overhead, sum(math.exp(n.path_logprob) for n in sel.nodes))
        return tree

    def build_many(self, states: list[CalibrationState | None], roots: list[int], logits: list[Scores],
                   context_lens: list[int], token_ids: torch.Tensor | None, turn: BatchTurn) -> list[DraftTree]:
        """Trees of requests whose rows share one verify forward (engine.step_many), sized together to maximise the
        turn's tokens per ms (policies.caddtree_select_batch). The turn's fixed cost: its measured drafting and each
        request's recalibrated overhead; its verify: the profiled curve at the requests' mean context (the rows go
        through the same weights; attention, which differs per context, is the smaller part at these lengths)."""
        starts = [self.round_start(s) if s is not None else (0.0, 1.0) for s in states]
        streams = [best_first_nodes(log_marginals(x), self.max_tree_nodes, token_ids) if self.max_tree_nodes
                   else iter(()) for x in logits]
        curve = self.cost_model.verify_curve(round(statistics.fmean(context_lens)))
        overhead = sum(o for o, _ in starts)
        sel = caddtree_select_batch(streams, curve, turn.draft_ms + overhead, turn.requests, turn.requests,
                                    [self.max_tree_nodes] * len(states), [scale for _, scale in starts])
        modelled = sel.turn_ms - overhead  # what each request's round shares; its overhead is its own
        for state, (own, _), nodes in zip(states, starts, sel.nodes):
            if state is not None:
                phi = sum(math.exp(n.path_logprob) for n in nodes)
                self.round_built(state, CaddSelection(nodes, 1 + phi, modelled + own), own, phi)
        return [DraftTree.from_nodes(root, nodes) for root, nodes in zip(roots, sel.nodes)]

    def round_start(self, state: CalibrationState) -> tuple[float, float]:
        """(overhead ms, the drafter's acceptance scale) for the round being built; observes the time since the
        last build. With round_built, the bookkeeping of `build` for trees built elsewhere (drafttree.lookup)."""
        now, cal = state.clock(), state.calibrator
        if state.last_round is not None:
            # build-to-build = this round's verify + commit + context update + next draft
            cal.observe_time(state.last_round[1], (now - state.last_round[0]) * 1e3)
        state.round_t0 = now
        return cal.overhead_ms, cal.accept_scale

    def round_built(self, state: CalibrationState, sel: CaddSelection, overhead_ms: float,
                    predicted_phi: float) -> None:
        """Record the round just selected: its modelled time and the Φ the drafter predicted for its tree."""
        state.last_round = (state.round_t0, sel.round_ms - overhead_ms, predicted_phi)

    def record_acceptance(self, state: CalibrationState | None, accepted_draft_nodes: int) -> None:
        if state is not None and state.last_round is not None:
            state.calibrator.observe_acceptance(state.last_round[2], accepted_draft_nodes)

    def interrupt(self, state: CalibrationState | None) -> None:
        """Rounds of something else ran since the last build: its build-to-build time is not a round."""
        if state is not None:
            state.last_round = None


class DraftsOneByOne:
    """`Proposer.draft_many` and `build_trees` for proposers whose drafts share nothing across requests and whose
    trees are sized alone: one after another."""

    batch_drafts = False

    def draft_many(self, states: list, roots: list[int], starts: list[int]) -> list:
        proposer = cast(Proposer, self)  # the proposer class this is mixed into
        return [proposer.draft(state, root, start) for state, root, start in zip(states, roots, starts)]

    def build_trees(self, states: list, roots: list[int], drafted: list, starts: list[int],
                    turn: BatchTurn) -> list[DraftTree]:
        proposer = cast(Proposer, self)
        return [proposer.build_tree(*args) for args in zip(states, roots, drafted, starts)]


@dataclass(frozen=True)
class RoundPlan:
    """What a DFlash round does, decided once at its start (`draft`, or `skip_drafter` when a lookup tree
    serves it) and read by the rest of the round (`build_tree`, `advance`)."""

    drafts: bool  # the drafter runs (False: the gate's plain round, or a lookup-only tree)
    depth: int  # the deepest depth it drafts: the block's rows when trimmed, the head rows at most


@dataclass
class DFlashState:
    """One request's proposer state: the drafter's context and the policy's memory."""

    context: DraftContext
    policy: object | None  # the policy's own (TreePolicy.new_state)
    clock: Clock
    gate: Gate | None = None
    round: list | None = None  # [drafted, start time, tokens committed] of the round in flight (gated only)
    deferred: list = field(default_factory=list)  # features committed since the last draft: the context's at the next
    deferred_start: int = 0
    plan: RoundPlan = RoundPlan(drafts=True, depth=0)  # the round in flight's
    depth_cap: int = 0  # deepest depth the next round drafts: the proposer's draft_depth unless follow_depth lowers it

    @property
    def nbytes(self) -> int:
        return self.context.nbytes


class DFlashProposer:
    """Drafts with a DFlash drafter whose per-request context K/V grow only by newly committed tokens.

    With `gate`, each request also measures plain one-token rounds and drafts only while drafting is
    the faster choice (drafttree.draft_gate); the drafter catches up on the skipped tokens in one call."""

    batch_drafts = True  # the drafter's forward takes several requests' blocks (draft_many)

    def __init__(self, drafter, target_model: TargetModel, policy: TreePolicy, gate: bool = False,
                 lazy_rows: bool = True, trim_block: bool | None = None):
        self.drafter, self.model, self.policy, self.gate, self.lazy_rows = drafter, target_model, policy, gate, lazy_rows
        # the block's rows stop at the deepest depth the policy can place (None: as the policy prefers)
        self.trim_block = policy.trim_block if trim_block is None else trim_block
        # a trimmed block follows the request's trees: one depth past the last tree's deepest node, at least a chunk
        self.follow_depth = self.trim_block and policy.follow_depth
        # head rows of a round's first lazy chunk: blocks that follow shallow trees read few depths
        self.first_chunk = FOLLOW_FIRST_CHUNK if self.follow_depth else FIRST_CHUNK
        self.capture_layers = tuple(drafter.config.target_layer_ids)
        self.depth = drafter.config.block_size - 1
        self.max_nodes = policy.max_nodes(self.depth)
        self.draft_depth = policy.max_depth(self.depth)
        self.name = policy.name
        # A reduced draft vocabulary needs the head's rows (from the CausalLM's own modules, which TargetModel does
        # not name); otherwise the target's own head (its path) is used.
        self.lm_head = (head_rows_source(cast(nn.Module, target_model)) if drafter.config.draft_vocab_size
                        else target_model.logits)
        if drafter.config.draft_vocab_size:  # the head's draft rows are sliced (and packed) now, never in a round
            drafter.head_weight(self.lm_head)
        self.draft_token_ids = drafter.draft_token_ids  # [Vd] target id per marginal column, or None (all ids)
        self.vocab_size = drafter.config.draft_vocab_size or drafter.config.vocab_size
        self.gate_memory = GateMemory()  # what drafting and plain rounds earned in this proposer's earlier requests

    def begin(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None,
              clock: Clock = time.perf_counter) -> DFlashState:
        """Drafter prefill: context K/V of the whole prompt."""
        assert prompt_features is not None  # the target captures our capture_layers
        state = DFlashState(self.drafter.new_context(prompt_features.shape[0] + self.drafter.config.block_size + 64),
                            self.policy.new_state(clock), clock, DraftGate(memory=self.gate_memory) if self.gate else None,
                            depth_cap=self.draft_depth)
        self.drafter.extend_context(state.context, prompt_features, torch.arange(prompt_features.shape[0]))
        return state

    def draft(self, state: DFlashState, root: int, start: int) -> Scores | None:
        """[D, Vd] drafter logits for positions start+1 .. start+D over the draft vocabulary (column j is
        token `draft_token_ids[j]`), D = the deepest node the policy can place (a tree of n nodes is at
        most n deep): no head rows for depths no tree reaches. With `lazy_rows` (the default) a
        marginals.LazyDraftScores: rows computed when the tree first reaches their depth. None: the gate
        chose a plain round (the tree is the root alone)."""
        if not self._plan_round(state):
            return None
        self.catch_up(state)
        return self._scores(state, self.drafter.draft_rows(state.context, self.block_embeds(root, state.plan.depth),
                                                           start))

    def draft_many(self, states: list[DFlashState], roots: list[int], starts: list[int]) -> list[Scores | None]:
        """`draft` for several requests (a batched serving turn): the drafting ones' context updates and blocks run
        through the drafter together (DFlashDrafter.extend_context_many, draft_rows_many: each request's rows get
        the bits they get alone)."""
        drafting = [i for i, state in enumerate(states) if self._plan_round(state, len(states))]
        behind = [states[i] for i in drafting if states[i].deferred]
        pending = [self._take_pending(state) for state in behind]
        self.drafter.extend_context_many([state.context for state in behind], [f for f, _ in pending],
                                         [p for _, p in pending])
        rows = self.drafter.draft_rows_many([states[i].context for i in drafting],
                                            [self.block_embeds(roots[i], states[i].plan.depth) for i in drafting],
                                            [starts[i] for i in drafting])
        out: list[Scores | None] = [None] * len(states)
        for i, block in zip(drafting, rows):
            out[i] = self._scores(states[i], block)
        return out

    def _plan_round(self, state: DFlashState, batch: int = 1) -> bool:
        """Decide the round (RoundPlan): whether the drafter runs (`batch`: requests drafting in this turn)."""
        plan = state.plan = RoundPlan(drafts=state.gate is None or self._gate_drafts(state, batch),
                                      depth=state.depth_cap)
        if not plan.drafts:
            self.policy.interrupt(state.policy)
        return plan.drafts

    def catch_up(self, state: DFlashState) -> None:
        """Bring the drafter's context up to date: the committed tokens since it last drafted, in one call."""
        if state.deferred:
            self.drafter.extend_context(state.context, *self._take_pending(state))

    @staticmethod
    def _take_pending(state: DFlashState) -> tuple[torch.Tensor, torch.Tensor]:
        """The features and positions of the tokens committed since the last draft, taken off the state."""
        feats = torch.cat(state.deferred)
        state.deferred = []
        return feats, torch.arange(state.deferred_start, state.deferred_start + feats.shape[0])

    def _scores(self, state: DFlashState, rows: BlockRows) -> Scores:
        depth = min(state.plan.depth, rows.count - 1)
        if not self.lazy_rows:
            return self.drafter.draft_scores(rows.rows(1, 1 + depth), self.lm_head)
        # block row i scores depth i: the head and the last layer's tail run for the depths the tree reaches
        return LazyDraftScores(lambda a, b: self.drafter.draft_scores(rows.rows(1 + a, 1 + b), self.lm_head),
                               depth, self.vocab_size, self.first_chunk)

    def block_rows(self, depth: int | None = None) -> int:
        """Rows of the drafter's block: the root and a mask per depth (default draft_depth); all the trained ones
        unless trimmed."""
        depth = self.draft_depth if depth is None else depth
        return max(2, 1 + depth) if self.trim_block else self.drafter.config.block_size

    def block_embeds(self, root: int, depth: int | None = None) -> torch.Tensor:
        """[block_rows(depth), H] the drafter's input for a round rooted at `root`."""
        return self.drafter.block_embeds(root, self.model.embed, self.block_rows(depth))

    def _gate_drafts(self, state: DFlashState, batch: int = 1) -> bool:
        assert state.gate is not None  # a gated request's
        now = self._end_gated_round(state)
        drafted = state.gate.choose(batch)
        state.round = [drafted, now, 0]
        return drafted

    @staticmethod
    def _end_gated_round(state: DFlashState) -> float:
        """The gate measures the round in flight (if any) up to now; returns now."""
        now = state.clock()
        if state.round is not None:  # only a gated request has rounds in flight
            assert state.gate is not None
            drafted, t0, tokens = state.round
            state.gate.observe(drafted, tokens, (now - t0) * 1e3)
            state.round = None
        return now

    def build_tree(self, state: DFlashState, root: int, logits: Scores | None, start: int) -> DraftTree:
        if logits is None:
            return DraftTree.root_only(root)
        return self._followed(state, self.policy.build(state.policy, root, logits, start, self.draft_token_ids))

    def build_trees(self, states: list[DFlashState], roots: list[int], drafted: list[Scores | None],
                    starts: list[int], turn: BatchTurn) -> list[DraftTree]:
        """`build_tree` for the requests of one batched turn: the policy builds the drafted ones' trees (CaDDTree sizes
        them together); plain rounds are the root alone."""
        drafting = [(i, x) for i, x in enumerate(drafted) if x is not None]
        trees = [DraftTree.root_only(root) for root in roots]  # plain rounds: the root alone
        if not drafting:
            return trees
        built = self.policy.build_many([states[i].policy for i, _ in drafting], [roots[i] for i, _ in drafting],
                                       [x for _, x in drafting], [starts[i] for i, _ in drafting],
                                       self.draft_token_ids, turn)
        for (i, _), tree in zip(drafting, built):
            trees[i] = self._followed(states[i], tree)
        return trees

    def _followed(self, state: DFlashState, tree: DraftTree) -> DraftTree:
        """`tree`, after the request's next block is set to follow it (follow_depth)."""
        if self.follow_depth:
            self.follow(state, int(tree.depths.max()))
        return tree

    def follow(self, state: DFlashState, deepest: int) -> None:
        """For follow_depth (its callers check it): the next round drafts one depth past this round's deepest drafted
        node (at least a chunk of head rows, at most draft_depth): most CPU trees stay a few nodes deep, and block
        rows cost work."""
        state.depth_cap = min(self.draft_depth, max(self.first_chunk, deepest + 1))

    def advance(self, state: DFlashState, accepted_tokens: torch.Tensor, accepted_features: torch.Tensor | None,
                start: int) -> None:
        """The accepted nodes (root first) join the drafter's context at its next draft (catch_up): all rounds since
        in one call, and in a batched turn all requests' in one call (a context update costs about the same for one
        token as for twenty: its calls, not its rows)."""
        assert accepted_features is not None  # the target captures our capture_layers
        n = accepted_features.shape[0]
        plain = state.round is not None and not state.round[0]  # the gate's plain round
        if state.round is not None:
            state.round[2] = n
        if not plain:
            self.policy.record_acceptance(state.policy, n - 1)
        if not state.deferred:
            state.deferred_start = start
        state.deferred.append(accepted_features)

    def skip_drafter(self, state: DFlashState) -> None:
        """The round in flight does without the drafter (its tree comes from elsewhere): its context update
        waits, and the gate's round in flight (if any) ends here, so it measures that round alone."""
        state.plan = RoundPlan(drafts=False, depth=state.depth_cap)
        if state.gate is not None:
            self._end_gated_round(state)
