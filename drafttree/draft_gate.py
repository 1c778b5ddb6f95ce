"""Draft or not: a per-request choice by measured throughput.

Where the drafter is weak (text unlike its training data), a speculative round costs more than the
tokens it gains, and plain one-token rounds are faster. The gate measures both choices on the request
itself — tokens per ms of busy time, with exponential forgetting — plays the faster one and probes the
other now and then (less often while probes change nothing), so a request never runs much slower than its
faster choice. Both choices emit the target's own tokens, so the gate cannot change a greedy output.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class Gate(Protocol):
    """What the DFlash proposer's gating calls: DraftGate, or ContextGate (a DraftGate per kind of round)."""

    def observe(self, draft: bool, tokens: int, ms: float) -> None: ...

    def choose(self, batch: int = 1) -> bool: ...  # batch: requests whose rounds share this one's forward


@dataclass
class GateMemory:
    """What each choice earned over a proposer's earlier requests (slow forgetting), so that a new request's
    gate starts from it instead of paying its warm-up again: on a machine where drafting does not pay, the
    warm-up's drafted rounds were most of what a gated request lost to plain decoding. The request's own
    rounds soon outweigh it, and the probes still try the other choice."""

    forget: float = 0.98  # per round of the same choice: about fifty rounds, a few requests
    min_rounds: int = 6  # rounds of a choice before a new gate trusts the memory of it (a gate's own warm-up)
    seed_rounds: float = 3.0  # what the memory weighs in a new gate, in rounds of the request's own
    tokens: dict = field(default_factory=lambda: {True: 0.0, False: 0.0})
    ms: dict = field(default_factory=lambda: {True: 0.0, False: 0.0})
    weight: dict = field(default_factory=lambda: {True: 0.0, False: 0.0})
    rounds: dict = field(default_factory=lambda: {True: 0, False: 0})

    def observe(self, draft: bool, tokens: int, ms: float) -> None:
        f = self.forget
        self.tokens[draft] = f * self.tokens[draft] + tokens
        self.ms[draft] = f * self.ms[draft] + ms
        self.weight[draft] = f * self.weight[draft] + 1.0
        self.rounds[draft] += 1

    def seed(self, gate: "DraftGate") -> None:
        """Start `gate` from the remembered mean round of each choice the memory knows well enough."""
        for draft in (True, False):
            if self.rounds[draft] >= self.min_rounds and self.ms[draft] > 0:
                k = self.seed_rounds / self.weight[draft]
                gate._tokens[draft], gate._ms[draft] = k * self.tokens[draft], k * self.ms[draft]
                gate._weight[draft] = self.seed_rounds
                gate._seen[draft] = gate.warmup_rounds


@dataclass
class DraftGate:
    forget: float = 0.9  # per round of the same choice: about ten rounds of memory
    warmup_rounds: int = 6  # rounds of each choice before the gate trusts its rates
    probe_every: int = 24  # rounds of the faster choice between probes of the other
    probe_rounds: int = 3
    max_probe_every: int = 96  # probes that do not change the faster choice double the gap up to this
    _tokens: dict = field(default_factory=lambda: {True: 0.0, False: 0.0})
    _ms: dict = field(default_factory=lambda: {True: 0.0, False: 0.0})
    _seen: dict = field(default_factory=lambda: {True: 0, False: 0})
    _weight: dict = field(default_factory=lambda: {True: 0.0, False: 0.0})  # rounds, forgotten as tokens and ms are
    _since_probe: int = 0
    _probing: int = 0
    _gap: int = 0  # rounds between probes now: probe_every, doubled by each probe that changed nothing
    _probed_best: bool | None = None  # the faster choice when the last probe began, until it is judged
    memory: GateMemory | None = None  # shared by the proposer's requests: seeds this gate, learns from its rounds

    def __post_init__(self):
        self._gap = self.probe_every
        if self.memory is not None:
            self.memory.seed(self)

    def rate(self, draft: bool) -> float:
        """Tokens per ms of this choice so far (forgetting older rounds)."""
        return self._tokens[draft] / self._ms[draft] if self._ms[draft] > 0 else 0.0

    def observe(self, draft: bool, tokens: int, ms: float) -> None:
        if ms <= 0:
            return
        if self.memory is not None:
            self.memory.observe(draft, tokens, ms)
        f = self.forget
        self._tokens[draft] = f * self._tokens[draft] + tokens
        self._ms[draft] = f * self._ms[draft] + ms
        self._weight[draft] = f * self._weight[draft] + 1.0
        self._seen[draft] += 1

    def drafting_pays(self, batch: int = 1) -> bool:
        """Alone: drafted rounds give more tokens per ms than plain ones. In a batched turn of `batch` requests the
        time a drafted round adds is everyone's: drafting pays when its extra tokens per extra ms beat the batch's
        rate, about `batch` times this request's plain rate (alone the two tests agree)."""
        if batch <= 1 or self._weight[True] <= 0 or self._weight[False] <= 0:
            return self.rate(True) >= self.rate(False)
        tokens_d, ms_d = self._tokens[True] / self._weight[True], self._ms[True] / self._weight[True]
        tokens_p, ms_p = self._tokens[False] / self._weight[False], self._ms[False] / self._weight[False]
        if ms_d <= ms_p:
            return tokens_d >= tokens_p
        return (tokens_d - tokens_p) / (ms_d - ms_p) >= batch * self.rate(False)

    def choose(self, batch: int = 1) -> bool:
        """True: draft this round (`batch`: requests whose rounds share this one's forward)."""
        for draft in (True, False):  # first measure both
            if self._seen[draft] < self.warmup_rounds:
                return draft
        best = self.drafting_pays(batch)
        if self._probing:
            self._probing -= 1
            return not best
        if self._probed_best is not None:  # a probe just ended: a probe that changed nothing makes the next one later
            self._gap = min(2 * self._gap, self.max_probe_every) if best == self._probed_best else self.probe_every
            self._probed_best = None
        self._since_probe += 1
        if self._since_probe >= self._gap:  # the other choice's rate may have changed with the text
            self._since_probe, self._probing, self._probed_best = 0, self.probe_rounds - 1, best
            return not best
        return best


@dataclass
class ContextGate:
    """One DraftGate per kind of round, for rounds whose worth depends on something known before drafting
    (drafttree.lookup: whether the lookup found a match — a matched round's lookup-only tree competes with
    the merged one, an unmatched round's plain step with the drafter's tree). Set `context` before each
    `choose`; `observe` goes to the gate of the round it measures. The DraftGate interface, so the DFlash
    proposer's gating (its timing and the drafter's catch-up) runs unchanged."""

    gates: dict = field(default_factory=lambda: {False: DraftGate(), True: DraftGate()})
    context: bool = False  # the kind of the round about to be chosen
    _chosen: bool = False  # the kind of the last chosen round: the one `observe` measures

    @classmethod
    def remembering(cls, memories: dict) -> "ContextGate":
        """A gate per kind of round, each seeded from (and teaching) memories[kind] (a GateMemory)."""
        return cls({kind: DraftGate(memory=memories[kind]) for kind in (False, True)})

    def observe(self, draft: bool, tokens: int, ms: float) -> None:
        self.gates[self._chosen].observe(draft, tokens, ms)

    def choose(self, batch: int = 1) -> bool:
        self._chosen = self.context
        return self.gates[self.context].choose(batch)
