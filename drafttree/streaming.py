"""Streaming text out of a token stream, one complete character at a time.

A byte-level BPE token can end in the middle of a UTF-8 character (an emoji is often split over two or
three tokens), and decoding such a prefix yields U+FFFD for the missing bytes. TextStream keeps that
tail back until the next tokens complete it, so what it emits, concatenated, is exactly the decode of
all tokens.
"""
from __future__ import annotations

from typing import Iterable

REPLACEMENT = "\ufffd"


class TextStream:
    """Incremental detokenizer: `push(ids)` returns the text those ids completed, `finish()` the rest.

    Only a window of recent tokens is decoded each time (as vLLM and transformers' streamers do):
    `prefix` tokens already emitted, decoded again only as context, because tokenizers such as
    SentencePiece decode a token's leading space differently at the start of a text.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # window start: always a character boundary
        self.read = 0  # tokens up to here have been emitted

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _window(self) -> tuple[str, str]:
        """(text of the window's already emitted tokens, text of the whole window)."""
        return self._decode(self.ids[self.prefix:self.read]), self._decode(self.ids[self.prefix:])

    def push(self, token_ids: Iterable[int]) -> str:
        self.ids.extend(int(t) for t in token_ids)
        seen, text = self._window()
        if len(text) <= len(seen) or text.endswith(REPLACEMENT):
            return ""  # nothing new, or the last character is still incomplete: wait for more tokens
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(seen):]

    def finish(self) -> str:
        """Whatever is held back (an incomplete character stays U+FFFD, as a full decode shows it)."""
        seen, text = self._window()
        self.prefix = self.read = len(self.ids)
        return text[len(seen):]
