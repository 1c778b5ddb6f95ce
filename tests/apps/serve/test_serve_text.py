"""OutputText: the reply text of a token stream, cut before the first stop string, sent without taking back."""
import random

import pytest

from drafttree.apps.serve.text import OutputText
from conftest import CharTokenizer

TOK = CharTokenizer()


def ids(text):
    return TOK.encode(text)


def run(text, stops, chunks):
    """Feed `text` in the given chunk sizes; (sent pieces, final tail, tokens taken, stopped)."""
    out, toks, pieces, i = OutputText(TOK, stops), ids(text), [], 0
    for n in chunks:
        pieces.append(out.push(toks[i:i + n]))
        i += n
        if out.stopped:
            break
    if not out.stopped:
        pieces.append(out.push(toks[i:]))
    tail = out.finish()
    return pieces, tail, out.tokens, out.stopped


def expected(text, stops):
    """Read left to right, the reply ends at the first stop occurrence to be complete (the one that ends
    first; of those, the one that starts first) and excludes it."""
    found = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    if not found:
        return text, len(text), False
    end, start = min(found)
    return text[:start], end, True


def test_no_stops_passes_everything():
    pieces, tail, n, stopped = run("hello world", (), [3, 3, 5])
    assert "".join(pieces) + tail == "hello world" and n == 11 and not stopped


def test_stop_string_is_cut_and_never_sent():
    pieces, tail, n, stopped = run("The answer is 42.\nQ: next", ["\nQ:"], [1] * 30)
    assert "".join(pieces) + tail == "The answer is 42." and stopped and tail == ""
    assert n == len("The answer is 42.\nQ:")  # up to the token that completed the stop string


def test_partial_match_is_held_back_then_released():
    out = OutputText(TOK, ["STOP"])
    assert out.push(ids("abc ST")) == "abc "  # "ST" may become "STOP"
    assert out.push(ids("O")) == ""
    assert out.push(ids("x")) == "STOx"  # it did not
    assert out.push(ids("ST")) == ""
    assert out.finish() == "ST"  # the decode ended: the held-back tail is the reply's end
    assert not out.stopped


def test_stop_in_the_first_chunk_and_nothing_after():
    out = OutputText(TOK, ["b"])
    assert out.push(ids("abc")) == "a" and out.stopped and out.tokens == 2
    assert out.push(ids("more")) == "" and out.finish() == ""


@pytest.mark.parametrize("seed", range(40))
def test_random_texts_stops_and_chunkings(seed):
    rng = random.Random(seed)
    alphabet = "ab c\n"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    chunks = [rng.randint(1, 5) for _ in range(60)]
    pieces, tail, n, stopped = run(text, stops, chunks)
    want, want_n, want_stopped = expected(text, stops)
    assert "".join(pieces) + tail == want
    assert stopped == want_stopped and n == want_n
    sent = ""
    for p in pieces:  # nothing sent is ever part of a stop string that is later cut
        sent += p
        assert want.startswith(sent)


def test_real_tokenizer_emoji_before_a_stop_string():
    """Complete characters only (TextStream) and the stop string cut, on SmolLM2's byte-level tokenizer."""
    from transformers import AutoTokenizer

    from drafttree.gguf_convert import convert_embedded

    tok = AutoTokenizer.from_pretrained(str(convert_embedded("smollm2-135m-instruct")))
    text = "Sea 🌊 and sky 😀 END more"
    toks = tok.encode(text, add_special_tokens=False)
    out = OutputText(tok, ["END"])
    pieces = [out.push([t]) for t in toks]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + out.finish() == "Sea 🌊 and sky 😀 " and out.stopped
