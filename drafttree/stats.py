"""Per-generation statistics: acceptance length τ, rounds, time split, throughput."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    method: str
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # accepted draft tokens + 1 (the bonus), per round
    tree_sizes: list[int] = field(default_factory=list)  # draft nodes verified per round (root excluded)
    prefill_s: float = 0.0
    draft_s: float = 0.0  # drafter forwards and context updates
    tree_s: float = 0.0  # building the draft tree from the drafter's output
    verify_s: float = 0.0
    total_s: float = 0.0  # decode time after prefill

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def drafted_rounds(self) -> int:
        """Rounds that verified a drafted tree (the others were plain one-token steps: caddtree-online's gate)."""
        return sum(1 for n in self.tree_sizes if n > 0)

    @property
    def drafted_tau(self) -> float:
        """τ over the drafted rounds only: what the drafter achieves when it is used."""
        pairs = [a for a, n in zip(self.accept_lengths, self.tree_sizes) if n > 0]
        return sum(pairs) / max(1, len(pairs))

    @property
    def other_s(self) -> float:
        return max(0.0, self.total_s - self.draft_s - self.tree_s - self.verify_s)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @contextmanager
    def timed(self, bucket: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, bucket, getattr(self, bucket) + time.perf_counter() - t0)

    def summary(self) -> dict:
        return dict(
            method=self.method, prompt_tokens=self.prompt_tokens, new_tokens=self.new_tokens, rounds=self.rounds,
            tau=round(self.tau, 3), tokens_per_s=round(self.tokens_per_s, 2), prefill_s=round(self.prefill_s, 4),
            draft_s=round(self.draft_s, 4), tree_s=round(self.tree_s, 4), verify_s=round(self.verify_s, 4), other_s=round(self.other_s, 4),
            total_s=round(self.total_s, 4),
            mean_tree_size=round(sum(self.tree_sizes) / max(1, len(self.tree_sizes)), 2),
            drafted_rounds=self.drafted_rounds, drafted_tau=round(self.drafted_tau, 3),
        )

    def line(self) -> str:
        gated = (f" ({self.drafted_rounds} drafted, τ {self.drafted_tau:.2f})"
                 if self.tree_sizes and self.drafted_rounds < len(self.tree_sizes) else "")
        return (f"[{self.method}] {self.new_tokens} tokens in {self.total_s:.2f}s = {self.tokens_per_s:.1f} tok/s"
                f" | τ {self.tau:.2f} over {self.rounds} rounds{gated}"
                f" | draft {self.draft_s:.2f}s tree {self.tree_s:.3f}s verify {self.verify_s:.2f}s other {self.other_s:.2f}s"
                f" | prefill {self.prefill_s:.2f}s")
