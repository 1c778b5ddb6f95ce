"""Retrieval branches: candidate continuations looked up in the request's own text (prompt + generated tokens),
merged with the drafter's marginals into one best-first draft tree.

- `index`: `SuffixIndex`, n-gram -> positions over the request's tokens, extended in O(new tokens) per round;
  `Continuations`, the occurrences of the longest matching suffix as a lazily expanded trie with counts.
- `calibration`: `LookupCalibrator`, the lookup's per-token acceptance rate learnt online per request.
- `merge`: `merged_best_first`, one best-first node stream over the drafter's marginals and the continuations
  (duplicates are one node, comparable path probabilities).
- `proposers`: `LookupProposer` (lookup alone, no drafter forward) and `LookupDFlashProposer` (a DFlash
  proposer's marginals + lookup, under its DDTree budget or CaDDTree's greedy stop).
"""
from .calibration import LookupCalibrator
from .index import Continuations, SuffixIndex
from .merge import MergedNode, merged_best_first
from .proposers import LookupConfig, LookupDFlashProposer, LookupDFlashState, LookupProposer, LookupState

__all__ = ["Continuations", "LookupCalibrator", "LookupConfig", "LookupDFlashProposer", "LookupDFlashState",
           "LookupProposer", "LookupState", "MergedNode", "SuffixIndex", "merged_best_first"]
