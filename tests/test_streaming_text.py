"""TextStream: streamed text is only ever complete characters, and all of it is exactly the full decode."""
import random

import pytest

from drafttree.streaming import REPLACEMENT, TextStream

TEXTS = [
    "Repeat exactly: 🙂🚀 שלום",
    "家族👨‍👩‍👧‍👦 and 日本語のテキスト, 中文字符 한국어",
    "مرحبا بالعالم — עברית ו-English mixed 🇮🇱🇯🇵 ✔︎",
    "plain ascii, then 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math and é (e + combining acute)",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from drafttree.gguf_convert import convert_embedded

    return AutoTokenizer.from_pretrained(str(convert_embedded("smollm2-135m-instruct")))


def _stream(tok, ids, chunks):
    s, pieces, at = TextStream(tok), [], 0
    for n in chunks:
        pieces.append(s.push(ids[at:at + n]))
        at += n
    pieces.append(s.finish())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = _stream(tokenizer, ids, [1] * len(ids))
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any(REPLACEMENT in p for p in pieces)
    # the test means something only if some token really ends inside a character
    assert any(REPLACEMENT in tokenizer.decode(ids[:i]) for i in range(1, len(ids)))


@pytest.mark.parametrize("seed", range(5))
def test_random_chunks_with_special_tokens(tokenizer, seed):
    rng = random.Random(seed)
    ids = []
    for text in rng.sample(TEXTS, len(TEXTS)):
        ids += tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]  # skipped in the output
    chunks = []
    while sum(chunks) < len(ids):
        chunks.append(rng.randint(0, 4))  # empty pushes too
    pieces = _stream(tokenizer, ids, chunks)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any(REPLACEMENT in p for p in pieces)


def test_incomplete_character_at_the_end_is_flushed(tokenizer):
    ids = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith(REPLACEMENT))
    s = TextStream(tokenizer)
    assert REPLACEMENT not in s.push(ids[:cut])
    assert s.finish().endswith(REPLACEMENT)  # what a full decode of these tokens shows, not silently dropped
