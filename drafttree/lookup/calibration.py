"""How far to trust the lookup, learnt from its own acceptance within one request.

A continuation node's probability of being accepted given that its parent was is modelled as
a(b) · frac: frac = the share of the matched occurrences that continue with its token, a(b) = a per-token
rate for the node's effective match length b (the suffix matched before the root plus the continuation
tokens already accepted above the node; buckets 1..B, the last one for b >= B). Every verified lookup node
whose parent was accepted is a trial worth frac; it is a hit if the node was accepted too. a(b) =
(hits + w·prior) / (trials + w) with exponential forgetting: the prior (0.5 per token, weight w trials)
until the request's own rounds say otherwise, the way caddtree-online scales the drafter's Φ by its
accepted/predicted ratio.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MIN_RATE, MAX_RATE = 0.01, 0.99  # a rate of 1 would let a child be as likely as its parent: keep it below


@dataclass
class LookupCalibrator:
    buckets: int = 8
    prior: float = 0.5
    prior_weight: float = 2.0  # in trials
    forget: float = 0.98  # per observation in a bucket: about 50 trials of memory
    _hits: list[float] = field(default_factory=list)
    _trials: list[float] = field(default_factory=list)

    def __post_init__(self):
        if self.buckets < 1:
            raise ValueError(f"buckets must be >= 1, got {self.buckets}")
        if not MIN_RATE <= self.prior <= MAX_RATE:
            raise ValueError(f"prior must be in [{MIN_RATE}, {MAX_RATE}], got {self.prior}")
        if self.prior_weight <= 0 or not 0 < self.forget <= 1:
            raise ValueError(f"need prior_weight > 0 and 0 < forget <= 1, got {self.prior_weight}, {self.forget}")
        self._hits = [0.0] * self.buckets
        self._trials = [0.0] * self.buckets

    def rate(self, bucket: int) -> float:
        """a(b) for bucket b in 1..buckets."""
        i = min(max(bucket, 1), self.buckets) - 1
        w = self.prior_weight
        r = (self._hits[i] + w * self.prior) / (self._trials[i] + w)
        return min(max(r, MIN_RATE), MAX_RATE)

    def rates(self) -> tuple[float, ...]:
        return tuple(self.rate(b) for b in range(1, self.buckets + 1))

    def observe(self, bucket: int, frac: float, accepted: bool) -> None:
        """One verified lookup node whose parent was accepted: predicted a(b)·frac, outcome `accepted`."""
        i = min(max(bucket, 1), self.buckets) - 1
        f = self.forget
        self._hits[i] = f * self._hits[i] + (1.0 if accepted else 0.0)
        self._trials[i] = f * self._trials[i] + frac
