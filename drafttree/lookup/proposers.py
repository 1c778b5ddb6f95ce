"""Lookup proposers: `LookupProposer` (the lookup alone: no drafter forward, its draft costs ~0) and
`LookupDFlashProposer` (a DFlashProposer's marginals and the lookup in one merged tree under its policy's
DDTree budget or CaDDTree's greedy stop). Per-request state (`LookupState`, `LookupDFlashState`) is created
by `begin` and held by the caller, as DFlashState is; the proposers hold settings only.

Each round: draft = query the suffix index with the root (+ the drafter's forward), build_tree = the merged
best-first stream (drafttree.lookup.merge) cut by the policy, advance = the accepted tokens go into the
index (O(new tokens)) and the drafter's context, and every verified lookup node whose parent was accepted
updates the lookup's calibration (drafttree.lookup.calibration).
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from itertools import takewhile
from typing import cast

import torch

from ..policies import CaddSelection, caddtree_select, fixed_budget_cut
from ..draft_gate import ContextGate, GateMemory
from ..marginals import Scores, log_marginals
from ..proposers import (BestFirstPolicy, CalibrationState, CostAwarePolicy, DFlashProposer, DFlashState,
                         DraftsOneByOne)
from ..protocols import Clock
from ..tree import DraftTree
from .calibration import LookupCalibrator
from .index import ContinuationNode, Continuations, SuffixIndex
from .merge import NEG_INF, MergedNode, merged_best_first


@dataclass(frozen=True)
class LookupConfig:
    max_ngram: int = 4  # n-gram lengths indexed (longer matches are measured at query time, up to match_cap)
    max_depth: int = 32  # deepest lookup node (the policy's node cap bounds it too)
    max_matches: int = 16  # occurrences of the matched suffix whose continuations form the trie
    match_cap: int = 16
    buckets: int = 8  # calibration buckets by effective match length (the last: >= buckets)
    prior: float = 0.5  # per-token acceptance before the request has shown any
    prior_weight: float = 2.0
    forget: float = 0.98


@dataclass
class LookupState:
    """One request's lookup: its suffix index, its calibration, and the last round's tree (what advance
    needs to see which lookup nodes were tried and accepted)."""

    index: SuffixIndex
    calibrator: LookupCalibrator
    tree: DraftTree | None = None
    trie_nodes: list[ContinuationNode | None] = field(default_factory=list)  # per tree node, root first

    @classmethod
    def begin(cls, prompt_ids, config: LookupConfig) -> "LookupState":
        return cls(SuffixIndex(config.max_ngram, prompt_ids),
                   LookupCalibrator(config.buckets, config.prior, config.prior_weight, config.forget))

    @property
    def nbytes(self) -> int:
        return self.index.nbytes

    def query(self, root: int, config: LookupConfig, max_depth: int) -> Continuations | None:
        return self.index.continuations(root, min(config.max_depth, max_depth), config.max_matches, config.match_cap,
                                        self.calibrator.rates())

    def remember(self, root: int, nodes: list[MergedNode]) -> DraftTree:
        """The round's tree from the selected nodes; kept for `advance`."""
        self.tree = DraftTree.from_nodes(root, [n.tree_node() for n in nodes])
        self.trie_nodes = [None, *(n.lookup for n in nodes)]
        return self.tree

    def advance(self, accepted_tokens: torch.Tensor, start: int) -> list[int]:
        """Calibrate on the last tree, then append the accepted tokens (root first) to the index. Returns the
        accepted path's tree nodes (root first)."""
        toks = accepted_tokens.reshape(-1).tolist()
        if len(self.index) != start:
            raise ValueError(f"lookup index holds {len(self.index)} tokens but the round started at {start}: "
                             "advance must see every committed token once, in order")
        path = [0]
        tree = self.tree
        if tree is not None and tree.num_nodes > 1 and toks and int(tree.tokens[0]) == toks[0]:
            for t in toks[1:]:
                nxt = tree.child_maps[path[-1]].get(t)
                if nxt is None:
                    break
                path.append(nxt)
            on_path = set(path)
            trie = self.trie_nodes
            for p in path:  # every node whose parent was accepted was tried
                for c in tree.child_maps[p].values():
                    node = trie[c]
                    if node is not None:
                        self.calibrator.observe(node.bucket, node.frac, c in on_path)
        self.tree = None
        self.index.extend(toks)
        return path


class LookupProposer(DraftsOneByOne):
    """Prompt/suffix lookup alone: best-first over the continuation trie, the nodes whose calibrated path
    probability is at least `min_prob`, at most `budget` of them (a chain when one continuation dominates,
    a small tree when the matched occurrences disagree). No drafter, no captured layers."""

    capture_layers: tuple[int, ...] = ()
    name = "lookup"

    def __init__(self, budget: int = 16, min_prob: float = 0.1, config: LookupConfig = LookupConfig()):
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget must be an int >= 1, got {budget!r}")
        if not 0 < min_prob <= 1:
            raise ValueError(f"min_prob must be in (0, 1], got {min_prob}")
        self.max_nodes, self.min_prob, self.config = budget, min_prob, config
        self._min_lp = math.log(min_prob)

    def begin(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None = None,
              clock: Clock = time.perf_counter) -> LookupState:
        return LookupState.begin(prompt_ids, self.config)

    def draft(self, state: LookupState, root: int, start: int) -> Continuations | None:
        return state.query(root, self.config, self.max_nodes)

    def build_tree(self, state: LookupState, root: int, drafted: Continuations | None, start: int) -> DraftTree:
        nodes = [] if drafted is None else list(takewhile(lambda n: n.path_logprob >= self._min_lp,
                                                          merged_best_first(drafted, None, self.max_nodes)))
        return state.remember(root, nodes)

    def advance(self, state: LookupState, accepted_tokens: torch.Tensor, accepted_features: torch.Tensor | None,
                start: int) -> None:
        state.advance(accepted_tokens, start)


@dataclass(frozen=True)
class LookupRoundPlan:
    """What a cost-aware lookup + DFlash round decided at its start (`draft`), for its `build_tree`. Whether
    the drafter runs is the DFlash state's plan."""

    alone: CaddSelection[MergedNode] | None  # the lookup-only selection (None: no match)
    overhead_ms: float  # caddtree-online's recalibrated round overhead (0 without recalibration)
    drafter_scale: float  # and the drafter's acceptance scale


@dataclass
class LookupDFlashState:
    """One request's state in a LookupDFlashProposer: the DFlash state and the lookup's."""

    dflash: DFlashState
    lookup: LookupState
    # the drafter's extra gain when the lookup has a match: EMAs of Φ and node-count differences between the
    # merged selection and the lookup-only one (cost-aware policies; None until a round has measured them)
    extra_phi: float | None = None
    extra_nodes: float = 0.0
    skipped: int = 0  # consecutive rounds that skipped the drafter
    plan: LookupRoundPlan | None = None  # the round in flight's (cost-aware policies)

    @property
    def nbytes(self) -> int:
        return self.dflash.nbytes + self.lookup.nbytes


# a LookupDFlashProposer's round: (the drafter's scores, None when it did not run; the lookup's continuations)
LookupDraft = tuple[Scores | None, Continuations | None]


class LookupDFlashProposer(DraftsOneByOne):
    """Wraps a DFlashProposer whose policy is DDTree (BestFirstPolicy) or CaDDTree (CostAwarePolicy): the
    drafter's marginals and the lookup's continuations enter one best-first stream (drafttree.lookup.merge)
    that the policy cuts: the first `budget` nodes, or CaDDTree's greedy stop (its online recalibration too
    when the policy has it; the drafter's Φ is then predicted for every node of the merged tree).

    With a cost-aware policy and `skip_drafter`, a round whose lookup alone is modelled to beat lookup +
    drafter (the drafter's extra Φ and nodes estimated from earlier rounds that had a match) skips the
    drafter's forward; every `explore_every`-th such round drafts anyway to keep the estimate fresh.
    When the DFlash proposer gates (caddtree-online), rounds with a lookup match and rounds without have a
    draft gate each (draft_gate.ContextGate): where the drafter does not pay, an unmatched round is a plain
    step and a matched one the lookup's tree alone."""

    def __init__(self, dflash: DFlashProposer, config: LookupConfig = LookupConfig(), skip_drafter: bool = True,
                 explore_every: int = 8, ema: float = 0.8):
        policy = dflash.policy
        if not isinstance(policy, (BestFirstPolicy, CostAwarePolicy)):
            raise ValueError(f"lookup merges into best-first trees: a ddtree or caddtree policy, not {policy.name!r}")
        self.dflash, self.policy, self.config = dflash, policy, config
        self.capture_layers = dflash.capture_layers
        self.max_nodes = dflash.max_nodes
        self.name = f"lookup-{policy.name}"
        self.cost_aware = isinstance(policy, CostAwarePolicy)
        self.skip_drafter = skip_drafter and self.cost_aware
        self.explore_every, self.ema = explore_every, ema
        self.gate_memories = {False: GateMemory(), True: GateMemory()}  # per kind of round, over requests
        if isinstance(policy, CostAwarePolicy):  # a lookup-only round pays no draft cost
            self._no_draft_cost = dataclasses.replace(policy.cost_model, draft_ms=0.0, draft_ms_per_context_token=0.0)

    def begin(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None, clock: Clock = time.perf_counter
              ) -> LookupDFlashState:
        dflash = self.dflash.begin(prompt_ids, prompt_features, clock)
        if dflash.gate is not None:  # a matched round and an unmatched one pay for drafting differently: a gate each
            dflash.gate = ContextGate.remembering(self.gate_memories)
        return LookupDFlashState(dflash, LookupState.begin(prompt_ids, self.config))

    # ---- one round ----

    def draft(self, state: LookupDFlashState, root: int, start: int) -> LookupDraft:
        """(drafter logits [D, Vd] or None when skipped, continuations or None)."""
        cont = state.lookup.query(root, self.config, self.max_nodes)
        policy = self.policy
        if isinstance(policy, CostAwarePolicy):
            # the round's clock starts here, skipped drafter or not
            pstate = cast(CalibrationState | None, state.dflash.policy)  # the state of the policy we checked
            overhead, scale = (0.0, 1.0) if pstate is None else policy.round_start(pstate)
            alone = None if cont is None else caddtree_select(
                merged_best_first(cont, None, policy.max_tree_nodes), self._no_draft_cost, start,
                policy.max_tree_nodes, overhead)
            state.plan = LookupRoundPlan(alone, overhead, scale)
            if alone is not None and self.skip_drafter and self._lookup_alone_wins(state, alone, start, overhead):
                state.skipped += 1
                self.dflash.skip_drafter(state.dflash)
                return None, cont
        state.skipped = 0
        gate = state.dflash.gate
        if gate is not None:
            assert isinstance(gate, ContextGate)  # begin gives a gated request one
            gate.context = cont is not None
        return self.dflash.draft(state.dflash, root, start), cont  # None too when the DFlash proposer's gate says so

    def _lookup_alone_wins(self, state: LookupDFlashState, alone: CaddSelection[MergedNode], start: int,
                           overhead: float) -> bool:
        if state.extra_phi is None or state.skipped + 1 >= self.explore_every:
            return False
        policy = self.policy
        assert isinstance(policy, CostAwarePolicy)  # only cost-aware rounds skip the drafter
        cm = policy.cost_model
        # extra_nodes is a mean difference of node counts and may be negative (a merged tree can stop earlier than
        # the lookup's alone, its drafter paying a cost the lookup does not): the estimate is a count, at least 0
        n = min(policy.max_tree_nodes, max(0, len(alone.nodes) + round(state.extra_nodes)))
        merged_ms = overhead + cm.draft_cost_ms(start) + cm.verify_ms(n, start)
        return alone.expected_tokens * merged_ms >= (alone.expected_tokens + state.extra_phi) * alone.round_ms

    def build_tree(self, state: LookupDFlashState, root: int, drafted: LookupDraft, start: int) -> DraftTree:
        logits, cont = drafted  # logits None: the drafter was skipped (here, or by the DFlash proposer's gate)
        policy = self.policy
        marginals = None if logits is None else log_marginals(logits)
        if not isinstance(policy, CostAwarePolicy):
            nodes = [] if cont is None and marginals is None else fixed_budget_cut(
                merged_best_first(cont, marginals, policy.budget, token_ids=self.dflash.draft_token_ids), policy.budget)
            return state.lookup.remember(root, nodes)
        pstate = cast(CalibrationState | None, state.dflash.policy)  # the state of the policy we checked
        plan, state.plan = state.plan, None
        assert plan is not None  # set by this round's draft
        alone, overhead, scale = plan.alone, plan.overhead_ms, plan.drafter_scale
        sel: CaddSelection[MergedNode]
        if marginals is None:  # the lookup-only selection is the tree
            sel = alone if alone is not None else caddtree_select(iter(()), self._no_draft_cost, start, 0, overhead)
        else:
            stream = merged_best_first(cont, marginals, policy.max_tree_nodes, drafter_scale=scale,
                                       token_ids=self.dflash.draft_token_ids)
            sel = caddtree_select(stream, policy.cost_model, start, policy.max_tree_nodes, overhead)
            if alone is not None:  # what the drafter added to a round the lookup alone could have served
                phi, more = sel.expected_tokens - alone.expected_tokens, len(sel.nodes) - len(alone.nodes)
                a = self.ema
                if state.extra_phi is None:
                    state.extra_phi, state.extra_nodes = phi, float(more)
                else:
                    state.extra_phi = a * state.extra_phi + (1 - a) * phi
                    state.extra_nodes = a * state.extra_nodes + (1 - a) * more
        if marginals is not None and self.dflash.follow_depth:  # the next block follows the drafter's nodes, not the lookup's
            self.dflash.follow(state.dflash, max((n.depth for n in sel.nodes if n.lookup is None), default=0))
        if pstate is not None:
            # Φ as the drafter itself predicted it; where it has no row (deeper than its head, or skipped) the
            # lookup's prediction stands in, so that accepted copies there do not inflate the drafter's scale
            policy.round_built(pstate, sel, overhead, sum(
                math.exp(n.drafter_logprob if n.drafter_logprob > NEG_INF else n.path_logprob) for n in sel.nodes))
        return state.lookup.remember(root, sel.nodes)

    def advance(self, state: LookupDFlashState, accepted_tokens: torch.Tensor, accepted_features: torch.Tensor | None,
                start: int) -> None:
        """The accepted nodes (root first) into the lookup index and (by the DFlash proposer) the drafter's context."""
        state.lookup.advance(accepted_tokens, start)
        self.dflash.advance(state.dflash, accepted_tokens, accepted_features, start)
