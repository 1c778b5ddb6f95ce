"""`weaver-ddtree` and `weaver-caddtree`: the DFlash drafter's forward, trees grown from Weaver's
path-conditioned probabilities (drafttree.weaver.tree) instead of the independent marginals.

The drafter's context, prefill and advance are DFlashProposer's own (wrapped, not copied); only the
round's output differs: the hidden states beside the logits, since Weaver reads both. weaver-caddtree
is CaDDTree's greedy stop on the Weaver stream with the stream's own cost in the round: one call
for the root, then one per w nodes, each `call_ms` (measured once when the proposer is made).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..policies import caddtree_select
from ..protocols import Clock, TargetModel, TreePolicy
from ..proposers import BestFirstPolicy, CostAwarePolicy, DFlashProposer, DFlashState, DraftsOneByOne
from ..tree import DraftTree
from .model import Weaver
from .tree import LookaheadWeaverStream, RoundInputs, WeaverStream, round_inputs


# Pop-w steps place a step's nodes before the first children still waiting for its call: a fan of shallow
# siblings at small budgets. Measured (Zen 3, AVX2, w = 8, 6 prompts, docs/weaver/zen3-avx2): τ -12 % at 16 nodes,
# -6 % at 32, equal at 64, where they build in 0.22 of w = 1's time (look-ahead: 0.46, always w = 1's tree).
POP_STEPS_FROM_CALLS = 8


@dataclass
class WeaverDraft:
    """One round's drafter output: logits [D, Vd] (column j = token_ids[j], or the ids themselves) and the
    hidden states [D, H] that produced them."""

    logits: torch.Tensor
    hidden: torch.Tensor
    token_ids: torch.Tensor | None = None


class WeaverProposer(DraftsOneByOne):
    def __init__(self, drafter, target_model: TargetModel, weaver: Weaver, policy: TreePolicy, width: int = 8,
                 call_ms: float | None = None, lookahead: bool | None = None):
        if not isinstance(policy, (BestFirstPolicy, CostAwarePolicy)) or (isinstance(policy, CostAwarePolicy)
                                                                          and policy.recalibrate):
            raise ValueError("a Weaver proposer takes a fixed budget (BestFirstPolicy) or CaDDTree's stop (CostAwarePolicy "
                             "without recalibration)")
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"--weaver-width must be an integer >= 1, got {width!r}")
        self.inner = DFlashProposer(drafter, target_model, policy)
        self.drafter, self.model, self.policy, self.weaver, self.width = drafter, target_model, policy, weaver, width
        self.capture_layers, self.max_nodes = self.inner.capture_layers, self.inner.max_nodes
        self.cost_aware = isinstance(policy, CostAwarePolicy)
        # lookahead: w=1's exact order with up to w rows per call; else the paper's pop-w-then-expand steps
        # (None: pop-w steps for fixed trees of at least POP_STEPS_FROM_CALLS * w nodes, look-ahead otherwise)
        if lookahead is None:
            lookahead = self.cost_aware or self.max_nodes < POP_STEPS_FROM_CALLS * width
        self.stream_class = LookaheadWeaverStream if lookahead else WeaverStream
        self.draft_depth = min(self.inner.draft_depth, weaver.config.max_depth)
        self.name = "weaver-" + policy.name
        self.call_ms = (call_ms if call_ms is not None else measure_call_ms(weaver, width, stream_class=self.stream_class)) \
            if self.cost_aware else 0.0

    def begin(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None,
              clock: Clock = time.perf_counter) -> DFlashState:
        return self.inner.begin(prompt_ids, prompt_features, clock)

    def draft(self, state: DFlashState, root: int, start: int) -> WeaverDraft:
        d = self.drafter
        self.inner.catch_up(state)
        hidden = d.draft(state.context, self.inner.block_embeds(root), start)[1:1 + self.draft_depth]
        # columns over the draft vocabulary (all ids when it is not reduced: draft_token_ids is then None)
        return WeaverDraft(d.draft_scores(hidden, self.inner.lm_head), hidden, d.draft_token_ids)

    def stream(self, root: int, drafted: WeaverDraft, max_nodes: int | None = None) -> WeaverStream:
        inputs = round_inputs(self.weaver, drafted.logits, drafted.hidden, self.model.embed, drafted.token_ids)
        return self.stream_class(self.weaver, inputs, root, self.max_nodes if max_nodes is None else max_nodes, self.width)

    def build_tree(self, state: DFlashState, root: int, drafted: WeaverDraft, start: int) -> DraftTree:
        stream = self.stream(root, drafted)
        if not isinstance(self.policy, CostAwarePolicy):  # = not self.cost_aware (the check mypy narrows on)
            return DraftTree.from_nodes(root, list(stream))
        # the root's call is paid by any tree with a node; then one call per `width` nodes
        sel = caddtree_select(iter(stream), self.policy.cost_model, start, self.max_nodes, overhead_ms=self.call_ms,
                              node_ms=self.call_ms / self.width)
        return DraftTree.from_nodes(root, sel.nodes)

    def advance(self, state: DFlashState, accepted_tokens: torch.Tensor, accepted_features: torch.Tensor | None,
                start: int) -> None:
        self.inner.advance(state, accepted_tokens, accepted_features, start)


@torch.inference_mode()
def measure_call_ms(weaver: Weaver, width: int, nodes: int = 64, repeats: int = 3, seed: int = 0,
                    stream_class=LookaheadWeaverStream) -> float:
    """Median ms of one Weaver call expanding `width` nodes, on a synthetic round (random drafter outputs of
    the Weaver's own shapes), measured over whole `nodes`-node builds so Python overhead counts too."""
    cfg = weaver.config
    g = torch.Generator().manual_seed(seed)
    D, K = cfg.max_depth, cfg.num_candidates
    lp = torch.randn(D, K, generator=g).mul(2).log_softmax(-1).sort(-1, descending=True).values - 0.1
    rows = min(cfg.vocab_size, 4096)  # a stand-in embedding: the cost of a row gather does not depend on the table size
    table = torch.randn(rows, cfg.embed_size, generator=g)
    inputs = RoundInputs(torch.randint(0, rows, (D, K), generator=g), lp,
                         torch.full((D,), -2.4), torch.randn(D, K, cfg.embed_size, generator=g),
                         torch.randn(D, cfg.drafter_hidden_size, generator=g), lambda ids: table[ids])
    times = []
    for _ in range(repeats + 1):  # the first build warms allocations up
        stream = stream_class(weaver, inputs, 0, nodes, width)
        t0 = time.perf_counter()
        for _ in stream:
            pass
        times.append((time.perf_counter() - t0) * 1e3 / max(1, stream.calls))
    return statistics.median(times[1:])
