"""Token ids in, reply text out: complete characters only, cut before the first stop string.

Text comes from drafttree.streaming.TextStream, so a character split over several tokens is never sent
half (no U+FFFD). With stop strings, the tail of the text that could still grow into a stop string is held
back until the next tokens decide it: what was sent never has to be taken back, and the stop string itself
is never sent.
"""
from __future__ import annotations

from typing import Iterable

from ...streaming import TextStream


class OutputText:
    def __init__(self, tokenizer, stops: Iterable[str] = ()):
        self.stream = TextStream(tokenizer)
        self.stops = tuple(stops)
        self.pending = ""  # decoded but held back: it may be the start of a stop string
        self.tokens = 0  # tokens taken: up to and including the one that completed a stop string
        self.stopped = False  # a stop string was found: nothing more is taken

    def push(self, token_ids: Iterable[int]) -> str:
        """The text that these tokens make sendable."""
        token_ids = list(token_ids)
        if self.stopped:
            return ""
        if not self.stops:
            self.tokens += len(token_ids)
            return self.stream.push(token_ids)
        out = []
        for t in token_ids:  # one at a time: the token that completes a stop string is where the reply ends
            self.tokens += 1
            out.append(self._take(self.stream.push([t])))
            if self.stopped:
                break
        return "".join(out)

    def finish(self) -> str:
        """At the end of the decode: the held-back rest (a stop string can still end in it)."""
        if self.stopped:
            return ""
        text = self._take(self.stream.finish())
        rest, self.pending = self.pending, ""
        return text + rest

    def _take(self, piece: str) -> str:
        self.pending += piece
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending, self.stopped = self.pending[:cut], "", True
            return out
        hold = 0  # the longest tail of pending that begins some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:k]):
                    hold = k
                    break
        out, self.pending = self.pending[:len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        return out
