"""A per-request suffix index: where the context's last tokens occurred before, and what followed them.

`SuffixIndex` maps every n-gram (n = 1..max_ngram) of the request's tokens (prompt + committed output) to
the positions right after its occurrences; appending a token adds max_ngram entries, so a round costs
O(new tokens). A query takes the round's root (the last emitted token, not committed yet) and finds the
longest n-gram ending at it that occurred before; those occurrences, longest actual match first (an
n = max_ngram match is extended backwards up to `match_cap` tokens), become `Continuations`: a trie of
what followed them, expanded only where the tree builder asks, each node with its occurrence count.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch


class SuffixIndex:
    """n-gram -> positions after it, over a token sequence that only grows."""

    def __init__(self, max_ngram: int = 4, tokens: Sequence[int] | torch.Tensor = ()):
        if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) or max_ngram < 1:
            raise ValueError(f"max_ngram must be an int >= 1, got {max_ngram!r}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        # _maps[n - 1]: key -> positions p with tokens[p - n:p] == the n-gram (key: the token for n = 1, else a tuple)
        self._maps: list[dict] = [{} for _ in range(max_ngram)]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """A rough estimate (a position entry, its share of a key and its dict slot per n-gram per token)."""
        return len(self.tokens) * (8 + self.max_ngram * 48)

    def extend(self, tokens: Sequence[int] | torch.Tensor) -> None:
        """Append tokens; each adds one entry per n-gram length ending at it."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.reshape(-1).tolist()
        seq, maps, top = self.tokens, self._maps, self.max_ngram
        for t in tokens:
            seq.append(int(t))
            i = len(seq)
            for n in range(1, min(top, i) + 1):
                key = seq[i - 1] if n == 1 else tuple(seq[i - n:i])
                hits = maps[n - 1].get(key)
                if hits is None:
                    maps[n - 1][key] = [i]
                else:
                    hits.append(i)

    def positions(self, ngram: Sequence[int]) -> list[int]:
        """Positions right after each occurrence of `ngram` (oldest first); [] if it never occurred."""
        n = len(ngram)
        if not 1 <= n <= self.max_ngram:
            raise ValueError(f"n-gram length must be 1..{self.max_ngram}, got {n}")
        key = int(ngram[0]) if n == 1 else tuple(int(t) for t in ngram)
        return list(self._maps[n - 1].get(key, ()))

    def continuations(self, root: int, max_depth: int, max_matches: int = 16, match_cap: int = 16,
                      rates: Sequence[float] = (0.5,)) -> "Continuations | None":
        """What followed earlier occurrences of the longest suffix of tokens + [root] seen before (None: no
        n-gram ending at `root` occurred). At most `max_matches` occurrences, longest actual match first,
        then the most recent; continuations at most `max_depth` deep. `rates[b - 1]`: the per-token
        acceptance rate of a node whose effective match length is b (capped at len(rates))."""
        seq, L, root = self.tokens, len(self.tokens), int(root)
        if max_depth < 1:
            return None
        for n in range(min(self.max_ngram, L + 1), 0, -1):
            key = root if n == 1 else tuple(seq[L - n + 1:]) + (root,)
            hits = self._maps[n - 1].get(key)
            if hits:
                break
        else:
            return None
        recent = hits[-4 * max_matches:]
        if n == self.max_ngram:  # the index only sees max_ngram tokens back: measure the real match
            lengths = []
            for p in recent:
                m = n
                while m < match_cap and p - m - 1 >= 0 and seq[p - m - 1] == seq[L - m]:
                    m += 1
                lengths.append(m)
        else:  # no (n+1)-gram matched anywhere, so every occurrence matches exactly n tokens
            lengths = [n] * len(recent)
        order = sorted(range(len(recent)), key=lambda i: (lengths[i], recent[i]), reverse=True)[:max_matches]
        return Continuations(seq, root, [recent[i] for i in order], [lengths[i] for i in order], max_depth, rates)


class ContinuationNode:
    """A node of the continuation trie: `token` at `depth` (1-based) below the root, reached by `count` of the
    occurrences. `frac` = count / parent's count; `log_q` = log(rate(bucket) · frac), the lookup's
    probability of this token given its parent was accepted; `match_len`: the longest match among its
    occurrences (the effective match length at this node is match_len + depth - 1)."""

    __slots__ = ("token", "depth", "occ", "match_len", "frac", "bucket", "log_q", "_children")

    def __init__(self, token: int, depth: int, occ: list[int], match_len: int, frac: float, bucket: int, log_q: float):
        self.token, self.depth, self.occ, self.match_len = token, depth, occ, match_len
        self.frac, self.bucket, self.log_q = frac, bucket, log_q
        self._children: list[ContinuationNode] | None = None

    @property
    def count(self) -> int:
        return len(self.occ)

    def __repr__(self) -> str:
        return (f"ContinuationNode(token={self.token}, depth={self.depth}, count={self.count}, "
                f"match_len={self.match_len}, q={math.exp(self.log_q):.3g})")


class Continuations:
    """The continuation trie of one query, expanded lazily: `children(node)` groups the node's occurrences by
    the token that followed them next. Reads the index's token list, which must not change meanwhile (it
    grows only in the proposer's advance, after the round's tree is built)."""

    def __init__(self, seq: list[int], root: int, positions: list[int], match_lens: list[int], max_depth: int,
                 rates: Sequence[float]):
        self._seq, self._len, self.max_depth = seq, len(seq), max_depth
        self.positions, self.match_lens = positions, match_lens  # occurrence i continues at positions[i]
        self.rates = tuple(float(r) for r in rates)
        self.match_len = max(match_lens)
        self.root = ContinuationNode(root, 0, list(range(len(positions))), self.match_len, 1.0, 0, 0.0)

    def _token_at(self, i: int) -> int:
        """The token at position i of tokens + [root] (i <= len(tokens))."""
        return self._seq[i] if i < self._len else self.root.token

    def children(self, node: ContinuationNode) -> list[ContinuationNode]:
        """Next tokens after `node`, most frequent first (ties: the most recent occurrence first)."""
        if node._children is not None:
            return node._children
        kids: list[ContinuationNode] = []
        if node.depth < self.max_depth:
            groups: dict[int, list[int]] = {}
            for o in node.occ:  # occurrences are in preference order, so the first of a group is its best
                i = self.positions[o] + node.depth
                if i <= self._len:  # position len(tokens) is the root itself
                    groups.setdefault(self._token_at(i), []).append(o)
            total, rates, depth = len(node.occ), self.rates, node.depth + 1
            for tok, occ in sorted(groups.items(), key=lambda kv: (-len(kv[1]), -self.positions[kv[1][0]])):
                m = max(self.match_lens[o] for o in occ)
                bucket = min(m + depth - 1, len(rates))
                frac = len(occ) / total
                kids.append(ContinuationNode(tok, depth, occ, m, frac, bucket, math.log(rates[bucket - 1] * frac)))
        node._children = kids
        return kids

    def best_path(self, depth: int | None = None) -> list[int]:
        """Tokens of the most frequent continuation (the prompt-lookup chain), at most `depth` long."""
        out: list[int] = []
        node = self.root
        while depth is None or len(out) < depth:
            kids = self.children(node)
            if not kids:
                break
            node = kids[0]
            out.append(node.token)
        return out

    def walk(self, visit: Callable[[ContinuationNode], None], node: ContinuationNode | None = None) -> None:
        """Every node below `node` (default: the root), depth first (tests and debugging)."""
        for c in self.children(node or self.root):
            visit(c)
            self.walk(visit, c)
