"""Online recalibration of CaDDTree's two models from what the rounds actually did.

Time: the profiled curve is right in shape but the machine drifts (other processes, frequency) and
a round has costs the profile does not see (tree walk, cache compaction, the drafter's context
update, Python). Observed round times are regressed as o = a·m + δ on the modelled times m, with
exponential forgetting and a prior at δ = 0. Scaling every cost by `a` does not move the
throughput optimum; the unmodelled part does, so the selection gets overhead δ/a.

Acceptance: Φ (summed path probabilities) assumes the drafter's marginals are calibrated; on text
unlike its training data they are over-confident. The ratio of accepted draft tokens to predicted Φ
(same forgetting and a prior at 1) scales the path probabilities.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RoundCalibrator:
    forget: float = 0.97  # per round: about 30 rounds of memory
    prior_rounds: float = 4.0  # weight of the acceptance prior, in rounds
    time_prior_rounds: float = 0.2  # prior δ = 0: without spread in tree size, drift counts as scale
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # Σw, Σw·m, Σw·m², Σw·o, Σw·m·o
    _accepted: float = 0.0
    _expected: float = 0.0

    def observe_time(self, modelled_ms: float, observed_ms: float) -> None:
        if modelled_ms <= 0 or observed_ms <= 0 or observed_ms > 20 * modelled_ms:
            return  # a pause (GC, another process) is not the model's fault
        f, m, o = self.forget, modelled_ms, observed_ms
        self._sums = [f * s + x for s, x in zip(self._sums, (1.0, m, m * m, o, m * o))]

    def observe_acceptance(self, expected: float, accepted: int) -> None:
        self._expected = self.forget * self._expected + expected
        self._accepted = self.forget * self._accepted + accepted

    @property
    def time_fit(self) -> tuple[float, float]:
        """(a, δ ms) of o = a·m + δ: least squares with a ridge on δ (toward 0), which also keeps the
        system solvable when every round had the same modelled cost."""
        s0, s1, s2, t0, t1 = self._sums
        if s0 == 0:
            return 1.0, 0.0
        a11, a12, a22 = s2, s1, s0 + self.time_prior_rounds
        b1, b2 = t1, t0
        det = a11 * a22 - a12 * a12
        a = (b1 * a22 - a12 * b2) / det
        d = (a11 * b2 - a12 * b1) / det
        return min(max(a, 0.3), 5.0), max(d, 0.0)

    @property
    def overhead_ms(self) -> float:
        """Per-round cost to add to the (unscaled) model before choosing the tree size."""
        a, d = self.time_fit
        return d / a

    @property
    def accept_scale(self) -> float:
        k = self.prior_rounds
        return min(max((self._accepted + k) / (self._expected + k), 0.2), 2.0)
