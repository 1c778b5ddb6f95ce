"""One round's drafter scores per depth, computed a few depths at a time when a tree first reaches them.

Row d of a DFlash round's logits is depth d+1's marginal. A tree rarely reaches the deepest rows the
drafter could score: CaDDTree on a small CPU stops at 2-4 nodes most rounds, yet the LM-head rows of
all depths (compute-bound from two rows on) and the last draft layer's row-wise tail were paid every
round. `LazyDraftScores` computes rows in doubling chunks (4, 4, 8, ...) as the tree builders
(tree.best_first_nodes, lookup.merge) first ask for them; on the batch-invariant kernel paths a row's
values do not depend on the chunk it was computed in, so the trees are those of the dense scores.
A plain [D, V] tensor of logits is the dense form; `log_marginals` and `dense_logits` accept both.
"""
from __future__ import annotations

import bisect
from typing import Callable

import torch

# Up to a few rows a head call costs about one pass over its weights (21 MB of int8 for 36,864 ids), mostly from
# memory: on a Zen 3 (AVX2) 2 / 4 rows cost 1.07 / 1.45 ms warm, and in decoding a first chunk of 4 made CaDDTree's
# draft + tree 0.94x that of 2 (44 % of its rounds read depth 3 or 4; bench/lazy_rows_ab.py).
FIRST_CHUNK = 4
# Where the drafter's block follows the request's trees (CaDDTree: most CPU trees are 1-2 deep), a first chunk of 2
# (Zen 3, AVX2, 9 prompts: draft + tree 4.40 -> 3.63 ms a round beside chunks of 4 without following, τ 1.61 -> 1.58).
FOLLOW_FIRST_CHUNK = 2


class LazyDraftScores:
    """Logits [D, V] of one round; `compute(a, b)` returns rows a..b-1 (any float dtype)."""

    def __init__(self, compute: Callable[[int, int], torch.Tensor], depth_count: int, vocab_size: int,
                 first_chunk: int = FIRST_CHUNK):
        if depth_count < 0 or first_chunk < 1:
            raise ValueError(f"depth_count must be >= 0 and first_chunk >= 1, got {depth_count}, {first_chunk}")
        self._compute, self.depth_count, self.vocab_size, self.first_chunk = compute, depth_count, vocab_size, first_chunk
        self._logits: list[torch.Tensor] = []  # computed chunks, in depth order
        self._logprobs: list[torch.Tensor] = []
        self._starts: list[int] = []
        self.computed = 0  # rows computed so far

    @property
    def shape(self) -> tuple[int, int]:
        return self.depth_count, self.vocab_size

    def _grow(self, b: int | None = None) -> None:
        """Compute the next chunk: rows computed..b-1, by default doubling (first_chunk, first_chunk, 2 first_chunk, ...)."""
        a = self.computed
        if b is None:
            b = min(self.depth_count, a + max(self.first_chunk, a))
        logits = self._compute(a, b).float()
        if logits.shape != (b - a, self.vocab_size):
            raise ValueError(f"draft scores for depths {a + 1}..{b}: expected shape {(b - a, self.vocab_size)}, "
                             f"got {tuple(logits.shape)}")
        self._starts.append(a)
        self._logits.append(logits)
        self._logprobs.append(logits.log_softmax(-1))
        self.computed = b

    def logprobs_from(self, d: int) -> torch.Tensor:
        """Log-probs [n, V] of rows d..d+n-1 for some n >= 1: the rest of the chunk holding row d (computed now
        if it is not yet)."""
        if not 0 <= d < self.depth_count:
            raise IndexError(f"depth index {d} outside 0..{self.depth_count - 1}")
        while self.computed <= d:
            self._grow()
        i = bisect.bisect_right(self._starts, d) - 1
        return self._logprobs[i][d - self._starts[i]:]

    def dense(self) -> torch.Tensor:
        """All logits [D, V] fp32: the rows not computed yet in one call (a chain reads every depth)."""
        if self.computed < self.depth_count:
            self._grow(self.depth_count)
        if not self._logits:
            return torch.empty(0, self.vocab_size)
        return self._logits[0] if len(self._logits) == 1 else torch.cat(self._logits)


Scores = torch.Tensor | LazyDraftScores


def dense_logits(scores: Scores) -> torch.Tensor:
    """[D, V] logits from either form."""
    return scores.dense() if isinstance(scores, LazyDraftScores) else scores


def log_marginals(scores: Scores) -> torch.Tensor | LazyDraftScores:
    """What the tree builders take: log-probs [D, V] of dense logits, or the lazy scores themselves (their rows
    come out log-softmaxed)."""
    return scores if isinstance(scores, LazyDraftScores) else scores.log_softmax(-1)
