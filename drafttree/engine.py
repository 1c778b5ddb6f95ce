"""Decode loops: plain autoregressive decoding (the reference) and speculative decoding with any proposer.

A `Sequence` is one request: its prompt, its state in the target model and the proposer, the tokens so
far; `step()` runs one round. Sequences are independent, so a server interleaves their rounds.
Speculation is lossless by construction: every emitted token is the target's own choice (its argmax,
or a sample from `sampling_probs`) given the committed prefix; drafts only decide how many of those
choices one target forward can confirm.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, cast

import torch

from .model.decoder import ForwardOutput
from .model.state import ModelState
from .model.verify_input import VerifyInput
from .protocols import BatchTurn, Proposer, RequestState
from .sampling import SamplingParams, greedy_token, next_token, sampling_probs
from .stats import GenerationStats
from .target import Target
from .tree import DraftTree
from .validate import InputError, check_int, check_token_ids
from .verify import Acceptance, TreeLogits, accept_greedy, accept_sampling


@dataclass
class GenerationResult:
    tokens: list[int]
    stats: GenerationStats
    text: str | None = None


# Trees of up to this many nodes (root included) get every node's logits in the verify forward. The LM head reads its
# weights once whatever the rows (SmolLM2's int8 head, Emerald Rapids AVX-512, 2 threads: 1 / 3 / 6 / 8 rows = 0.64 /
# 0.73 / 0.90 / 1.09 ms), so for a few rows more than the principal path the first pass is cheaper than the second a
# walk leaving the path pays (0.64 ms). In decoding, ddtree-2 / -4 trees left the path in 10 / 21 % of rounds.
ALL_LOGITS_MAX_NODES = 6


def verify_input(tree: DraftTree, start: int) -> VerifyInput:
    """A round's verify: every node's rows through the layers; the LM head for every node of a small tree, for the
    tree's principal path only in a larger one (TreeLogits computes the rows a walk reaches off it)."""
    rows = range(tree.num_nodes) if tree.num_nodes <= ALL_LOGITS_MAX_NODES else tree.principal_path()
    return VerifyInput.of_tree(tree, start, torch.tensor(rows))


def walk_tree(tree: DraftTree, logits: TreeLogits, sampling: SamplingParams, gen: torch.Generator | None) -> Acceptance:
    """Greedy: follow the target's argmax; sampling: sample the target at each visited node (lossless). The
    logits of a node are computed when the walk first reaches it."""
    if sampling.greedy:
        return accept_greedy(tree, lambda i: greedy_token(logits(i)))
    return accept_sampling(tree, lambda i: sampling_probs(logits(i), sampling), gen)


NOT_DRAFTED = object()  # _begin_round drafts itself


class Sequence:
    """One request's decode. Without a proposer every step is one AR token; with one, a draft round."""

    def __init__(self, target: Target, prompt_ids, proposer: Proposer | None = None, max_new_tokens: int = 256,
                 sampling: SamplingParams = SamplingParams(), stop_token_ids=None):
        model = target.model
        self.prompt = check_token_ids(prompt_ids, model.config.vocab_size)
        self.max_new = check_int("max_new_tokens", max_new_tokens, minimum=0)
        self.model, self.proposer, self.sampling = model, proposer, sampling
        self.stop_ids = set(target.stop_token_ids if stop_token_ids is None else stop_token_ids)
        self.stats = GenerationStats("ar" if proposer is None else proposer.name, prompt_tokens=self.prompt.numel())
        context = model.config.max_position_embeddings
        if self.prompt.numel() + self.max_new > context:
            raise InputError(f"{self.prompt.numel()} prompt tokens + max_new_tokens {self.max_new} exceed the model's "
                             f"context of {context}: shorten the prompt or ask for fewer tokens")
        # The last emitted token never enters the cache; a tree needs its scratch rows, and near the end of
        # the context the trees shrink to the rows left (_begin_round).
        slack = 0 if proposer is None else proposer.max_nodes
        self.state: ModelState | None = model.new_state(min(self.prompt.numel() + self.max_new + slack, context))
        self.draft_state: RequestState | None = None  # the proposer's (Proposer.begin)
        self.gen = None if sampling.greedy else sampling.generator()
        self.tokens: list[int] = []
        self.root: int | None = None  # the last emitted token: not in the KV cache yet
        self.finish_reason: str | None = "length" if self.max_new == 0 else None
        self._busy = 0.0  # seconds inside step(): the request's own clock

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def state_bytes(self) -> int:
        if self.state is None:
            return 0
        return self.state.nbytes + (self.draft_state.nbytes if self.draft_state is not None else 0)

    def clock(self) -> float:
        return self._busy + (time.perf_counter() - self._step_t0)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return () if self.proposer is None else self.proposer.capture_layers

    def _target_state(self) -> ModelState:
        """The state a step works on: only close() drops it, and a closed Sequence is done (it never steps)."""
        assert self.state is not None
        return self.state

    @torch.no_grad()
    def step(self) -> list[int]:
        """One round; the first prefills. Returns the tokens it emitted ([] once done)."""
        if self.done:
            return []
        self._step_t0 = time.perf_counter()
        if self.root is None:
            return self._end_step(self._prefill())
        if self.proposer is None:
            return self._end_step(self._ar_step())
        batch, tree = self._begin_round()
        with self.stats.timed("verify_s"):
            res = self.model.verify(self._target_state(), batch, capture_layers=self.capture_layers)
        return self._end_step(self._end_round(batch, tree, res))

    def _end_step(self, new: list[int]) -> list[int]:
        self._busy += time.perf_counter() - self._step_t0
        emitted = self._emit(new)
        if self.done:
            self.close()
        return emitted

    def _prefill(self) -> list[int]:
        pre = self.model.prefill(self._target_state(), self.prompt, capture_layers=self.capture_layers)
        if self.proposer is not None:  # the drafter's prompt pass counts as prefill, and is reported
            self.draft_state = self.proposer.begin(self.prompt, pre.features, self.clock)
        self.stats.prefill_s = time.perf_counter() - self._step_t0
        return [int(next_token(_last_logits(pre), self.sampling, self.gen))]

    def _ar_step(self) -> list[int]:
        t0, state = time.perf_counter(), self._target_state()
        logits = _last_logits(self.model.forward(state, torch.tensor([self.root])))
        self.model.commit(state, torch.zeros(1, dtype=torch.long))
        self.stats.verify_s += time.perf_counter() - t0
        return [int(next_token(logits, self.sampling, self.gen))]

    def _begin_round(self, drafted: object = NOT_DRAFTED, tree: DraftTree | None = None
                     ) -> tuple[VerifyInput, DraftTree | None]:
        """Draft a tree (AR: the root alone) and lay it out for the verify forward; `drafted` / `tree`: the round's
        draft and tree when step_many made them together with other requests'."""
        state, root = self._target_state(), self.root
        start = state.length
        if self.proposer is None:
            return VerifyInput(torch.tensor([root]), torch.tensor([start]), torch.tensor([-1]),
                               torch.ones(1, 1, dtype=torch.bool)), None
        assert root is not None  # rounds come after the prefill, which emits the first root
        proposer, stats = self.proposer, self.stats
        if drafted is NOT_DRAFTED:
            with stats.timed("draft_s"):
                drafted = proposer.draft(self.draft_state, root, start)
        with stats.timed("tree_s"):
            if tree is None:
                tree = proposer.build_tree(self.draft_state, root, drafted, start)
            # nodes whose tokens could not be kept (past max_new_tokens) or stored (past the state) are not verified
            tree = tree.truncated(state.max_len - start, self.max_new - len(self.tokens) - 1)
        return verify_input(tree, start), tree

    def _end_round(self, batch: VerifyInput, tree: DraftTree | None, res: ForwardOutput) -> list[int]:
        """Walk the verified tree, commit the accepted path, tell the proposer."""
        state = self._target_state()
        stats, start = self.stats, state.length
        if tree is None:  # AR
            with stats.timed("verify_s"):
                self.model.commit(state, torch.zeros(1, dtype=torch.long))
            return [int(next_token(_last_logits(res), self.sampling, self.gen))]
        # a tree comes from the proposer; verify_input asked for the logits of all its nodes or its principal path
        assert self.proposer is not None and res.logits is not None and batch.logits_rows is not None
        with stats.timed("verify_s"):
            logits = TreeLogits(tree, res.logits, batch.logits_rows.tolist(), res.hidden, self.model.row_logits)
            acc = walk_tree(tree, logits, self.sampling, self.gen)
            self.model.commit(state, acc.nodes)
        with stats.timed("draft_s"):
            features = None if res.features is None else res.features[acc.nodes]
            self.proposer.advance(self.draft_state, tree.tokens[acc.nodes], features, start)
        stats.rounds += 1
        stats.accept_lengths.append(acc.nodes.numel())
        stats.tree_sizes.append(tree.num_draft_nodes)
        return acc.committed_tokens(tree).tolist()

    def _emit(self, new: list[int]) -> list[int]:
        """Keep tokens up to a stop token or max_new_tokens; the kept last one is the next round's root."""
        kept = new[: self.max_new - len(self.tokens)]
        for i, t in enumerate(kept):
            if t in self.stop_ids:
                kept, self.finish_reason = kept[: i + 1], "stop"
                break
        self.tokens.extend(kept)
        if self.finish_reason is None and len(self.tokens) >= self.max_new:
            self.finish_reason = "length"
        self.root = kept[-1] if kept else self.root
        if self.proposer is None:  # an AR token is a round that accepted nothing but its own
            self.stats.rounds += 1
            self.stats.accept_lengths.append(1)
        self.stats.new_tokens = len(self.tokens)
        self.stats.total_s = self._busy - self.stats.prefill_s
        return kept

    def close(self) -> None:
        """Free the request's state (KV rows, drafter context); idempotent."""
        self.state = self.draft_state = None
        if self.finish_reason is None:
            self.finish_reason = "cancelled"


@torch.no_grad()
def step_many(seqs: list[Sequence]) -> list[list[int] | Exception]:
    """One round of each sequence (of one model), their verify forwards run as one batched forward
    (TargetModel.verify_many: on the batch-invariant paths, each row's result is what it is alone).
    Per sequence: the tokens it emitted, or the exception its round raised (the others go on)."""
    out: list = [None] * len(seqs)
    rounds: list[tuple[int, Sequence]] = []
    for i, seq in enumerate(seqs):
        if not isinstance(seq, Sequence) or seq.done or seq.root is None:  # finished, its prefill, or not ours: alone
            out[i] = _attempt(seq.step)
        else:
            rounds.append((i, seq))
    prepared = _prepare_together([seq for _, seq in rounds])
    begun: list[tuple[int, Sequence, VerifyInput, DraftTree | None]] = []
    for (i, seq), (drafted, tree, shared_s) in zip(rounds, prepared):
        seq._step_t0 = time.perf_counter() - shared_s  # a draft made together counts for each of its sequences
        try:
            begun.append((i, seq, *seq._begin_round(drafted, tree)))
        except Exception as e:
            out[i] = e
        seq._busy += time.perf_counter() - seq._step_t0
    if not begun:
        return out
    model = begun[0][1].model
    t0 = time.perf_counter()
    results: list[ForwardOutput | None]
    try:
        results = list(model.verify_many([s._target_state() for _, s, _, _ in begun], [b for _, _, b, _ in begun],
                                         [s.capture_layers for _, s, _, _ in begun]))
    except Exception:  # find whose batch failed: verify each alone
        results = [None] * len(begun)
    shared = time.perf_counter() - t0 if results[0] is not None else 0.0
    for (i, seq, batch, tree), res in zip(begun, results):
        seq._step_t0 = time.perf_counter() - shared  # the batched forward counts for each of its sequences
        seq.stats.verify_s += shared
        try:
            if res is None:
                with seq.stats.timed("verify_s"):
                    res = model.verify(seq._target_state(), batch, capture_layers=seq.capture_layers)
            out[i] = seq._end_step(seq._end_round(batch, tree, res))
        except Exception as e:
            seq._busy += time.perf_counter() - seq._step_t0
            out[i] = e
    return out


def _prepare_together(seqs: list[Sequence]) -> list[tuple[object, DraftTree | None, float]]:
    """Per sequence (a round about to begin): its draft, its tree and the seconds they took, made with the other
    sequences of the same proposer — one Proposer.draft_many call where the proposer shares drafting work across
    requests (batch_drafts), then one build_trees call, which sizes their trees for the turn they share —;
    (NOT_DRAFTED, None, 0) where it drafts itself in _begin_round (AR, alone with its proposer, or a proposer that
    would draft one by one anyway). A draft_many or build_trees that fails leaves each sequence to its own round (and
    to fail alone): a failed draft_many drafts again alone, a failed build_trees builds again alone."""
    out: list[tuple[object, DraftTree | None, float]] = [(NOT_DRAFTED, None, 0.0)] * len(seqs)
    groups: dict[int, list[int]] = {}
    for k, seq in enumerate(seqs):
        if seq.proposer is not None and seq.proposer.batch_drafts:
            groups.setdefault(id(seq.proposer), []).append(k)
    for members in groups.values():
        if len(members) < 2:
            continue
        group = [seqs[k] for k in members]
        proposer = group[0].proposer
        assert proposer is not None
        for seq in group:  # the proposer's clocks (gate, recalibration) read each request's own time
            seq._step_t0 = time.perf_counter()
        t0 = time.perf_counter()
        states, roots = [seq.draft_state for seq in group], [cast(int, seq.root) for seq in group]
        starts = [seq._target_state().length for seq in group]
        try:
            drafted = proposer.draft_many(states, roots, starts)
        except Exception:
            continue
        draft_s = time.perf_counter() - t0
        trees: list[DraftTree | None]
        try:
            trees = list(proposer.build_trees(states, roots, drafted, starts, BatchTurn(len(seqs), draft_s * 1e3)))
        except Exception:  # each builds its own tree in _begin_round
            trees = [None] * len(group)
        tree_s = time.perf_counter() - t0 - draft_s
        for k, seq, d, tree in zip(members, group, drafted, trees):
            seq.stats.draft_s += draft_s
            seq.stats.tree_s += tree_s
            out[k] = (d, tree, draft_s + tree_s)
    return out


def _last_logits(out: ForwardOutput) -> torch.Tensor:
    """The last row's logits of a forward that computed them (prefill, an AR step or verify: always)."""
    assert out.logits is not None
    return out.logits[-1]


def _attempt(fn: Callable[[], list[int]]) -> list[int] | Exception:
    try:
        return fn()
    except Exception as e:
        return e


def run_to_end(seq: Sequence, on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
    while not seq.done:
        new = seq.step()
        if new and on_tokens is not None:
            on_tokens(new)
    return GenerationResult(seq.tokens, seq.stats)


def generate_ar(target: Target, prompt_ids, max_new_tokens: int = 256, sampling: SamplingParams = SamplingParams(),
                stop_token_ids=None, on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """Plain autoregressive decoding: one target forward per token."""
    return run_to_end(Sequence(target, prompt_ids, None, max_new_tokens, sampling, stop_token_ids), on_tokens)


def generate_speculative(target: Target, prompt_ids, proposer: Proposer, max_new_tokens: int = 256,
                         sampling: SamplingParams = SamplingParams(), stop_token_ids=None,
                         on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """Draft a tree, verify it in one target forward, commit the accepted path, repeat."""
    return run_to_end(Sequence(target, prompt_ids, proposer, max_new_tokens, sampling, stop_token_ids), on_tokens)
