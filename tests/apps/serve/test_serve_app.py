"""The server end to end on the tiny model, through the official `openai` client against a live uvicorn:
greedy replies (streamed or not, every method) equal offline decoding; 16 streaming clients at once all
equal offline; seeded sampling is reproducible while interleaved; stop strings; a client that goes away
frees its state; a failing decode harms no other request."""
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from drafttree.methods import METHODS, generate
from drafttree.sampling import SamplingParams
from drafttree.apps.serve.app import create_app
from conftest import live_server, request, wait_idle

MODEL = "tiny"


def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def offline(target, ids, n, method="ar", sampling=SamplingParams(), proposer=None):
    return target.tokenizer.decode(generate(method, target, ids, n, sampling, proposer=proposer).tokens)


def user(text):
    return [{"role": "user", "content": text}]


def chat_stream(c, messages, **kw):
    """(text, chunks) of one streamed chat completion."""
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, stream=True, **kw))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    return text, chunks


@pytest.fixture(scope="module")
def tiny_server(tiny_target, tiny_decoder):
    app = create_app(tiny_target, tiny_decoder, model_id=MODEL, default_method="caddtree-online", max_concurrency=4)
    with live_server(app) as base:
        yield base


@pytest.fixture(scope="module")
def copy_server(tiny_target, copy_decoder):
    app = create_app(tiny_target, copy_decoder, model_id=MODEL, methods=("ar", "chain", "ddtree", "caddtree"),
                     default_method="chain", max_concurrency=6)
    with live_server(app) as base:
        yield base


def test_every_method_streamed_and_not_equals_offline(tiny_target, tiny_server):
    c = client(tiny_server)
    messages = user("The quick brown fox")
    want = offline(tiny_target, tiny_target.encode_chat(messages), 24)
    prompt_tokens = len(tiny_target.encode_chat(messages))
    for method in METHODS:
        r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                      extra_body={"method": method})
        assert r.choices[0].message.content == want, method
        assert r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
            prompt_tokens, 24, prompt_tokens + 24)
        ext = r.model_extra["drafttree"]
        assert ext["method"] == method and ext["rounds"] >= 1 and ext["tau"] >= 1.0 and "mean_tree_size" in ext
        text, chunks = chat_stream(c, messages, max_tokens=24, temperature=0, extra_body={"method": method},
                                   stream_options={"include_usage": True})
        assert text == want, method
        assert chunks[0].choices[0].delta.role == "assistant"
        last, usage = chunks[-2], chunks[-1]
        assert last.choices[0].finish_reason == "length" and last.model_extra["drafttree"]["method"] == method
        assert usage.choices == [] and usage.usage.completion_tokens == 24
        assert all(ch.id == chunks[0].id for ch in chunks)
    # the default method (caddtree-online), and text completions from text and from token ids
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want and r.model_extra["drafttree"]["method"] == "caddtree-online"
    ids = tiny_target.encode("Once upon a time").tolist()
    want = offline(tiny_target, ids, 20)
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0)
    assert r.choices[0].text == want and r.usage.prompt_tokens == len(ids)
    chunks = list(c.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0, stream=True,
                                       extra_body={"method": "ddtree"}))
    assert "".join(ch.choices[0].text for ch in chunks) == want and chunks[-1].choices[0].finish_reason == "length"


def test_sixteen_concurrent_streaming_clients(tiny_target, copy_server):
    """16 clients at once (6 decoded, the rest waiting), drafts accepted deep: every reply equals offline."""
    methods = ("ar", "chain", "ddtree", "caddtree")
    jobs = [(user(f"client {i}: " + "abcdefgh"[: i % 8]), methods[i % 4], 30 + i) for i in range(16)]
    wants = [offline(tiny_target, tiny_target.encode_chat(m), n) for m, _, n in jobs]
    c = client(copy_server)
    start = threading.Barrier(16)

    def run(job):
        messages, method, n = job
        start.wait()
        text, chunks = chat_stream(c, messages, max_tokens=n, temperature=0, extra_body={"method": method})
        return text, chunks[-1].model_extra["drafttree"]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, jobs))
    for (text, ext), want, (_, method, _) in zip(results, wants, jobs):
        assert text == want and ext["method"] == method
    assert max(ext["tau"] for _, ext in results) > 2  # the copy drafts were accepted: deep rounds interleaved
    assert max(ext["queue_s"] for _, ext in results) > 0
    h = wait_idle(copy_server)
    assert (h["active"], h["waiting"], h["state_bytes"]) == (0, 0, 0)


def test_seeded_sampling_is_reproducible_while_interleaved(tiny_target, copy_server, copy_decoder):
    messages = user("sample me")
    ids = tiny_target.encode_chat(messages)
    sampling = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
    want = offline(tiny_target, ids, 40, "chain", sampling, copy_decoder.proposer("chain"))
    c = client(copy_server)
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda _: c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=40, temperature=0.9, top_p=0.9, seed=7,
            extra_body={"method": "chain"}).choices[0].message.content, range(4)))
    assert texts == [want] * 4
    other = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0.9, top_p=0.9,
                                      seed=8, extra_body={"method": "chain"}).choices[0].message.content
    assert other != want


def test_stop_strings(tiny_target, tiny_server):
    messages = user("stop somewhere")
    full = offline(tiny_target, tiny_target.encode_chat(messages), 60)
    stop = full[20:23]
    cut = full.find(stop)
    c = client(tiny_server)
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0, stop=[stop, "\x7f\x7f\x7f"],
                                  extra_body={"method": "chain"})
    assert r.choices[0].message.content == full[:cut] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == cut + len(stop)  # one character a token: up to the stop string's end
    text, chunks = chat_stream(c, messages, max_tokens=60, temperature=0, stop=stop)
    assert text == full[:cut] and chunks[-1].choices[0].finish_reason == "stop"
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0, stop="never \x7f")
    assert r.choices[0].message.content == full and r.choices[0].finish_reason == "length"


def open_stream(base, body):
    """A raw HTTP connection with a request sent; returns the socket after the first SSE event arrived."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    got = b""
    while got.count(b"data: ") < 3:
        got += sock.recv(65536)
    return sock, got


def test_client_gone_frees_its_state(tiny_target, tiny_server):
    base = tiny_server
    before = request(base, "GET", "/health")[1]
    messages = user("a long one")
    body = {"model": MODEL, "messages": messages, "max_tokens": 400, "temperature": 0, "method": "ddtree"}
    sock, got = open_stream(base, {**body, "stream": True})
    assert got.startswith(b"HTTP/1.1 200")
    h = request(base, "GET", "/health")[1]
    assert h["active"] == 1 and h["state_bytes"] > 0
    sock.close()  # mid-stream
    h = wait_idle(base)
    assert (h["active"], h["waiting"], h["state_bytes"]) == (0, 0, 0)
    assert h["cancelled"] == before["cancelled"] + 1 and h["finished"] == before["finished"]
    # a whole-reply request whose client leaves while it is decoded
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    deadline = time.monotonic() + 10
    while request(base, "GET", "/health")[1]["state_bytes"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sock.close()
    h = wait_idle(base)
    assert (h["active"], h["state_bytes"], h["cancelled"]) == (0, 0, before["cancelled"] + 2)
    # and the next request is served as before
    want = offline(tiny_target, tiny_target.encode_chat(messages), 16)
    r = client(base).chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == want


class FaultyDecoder:
    """The real decoder, except that "chain" sequences raise in their third step."""

    def __init__(self, inner):
        self.inner = inner
        self.proposer = inner.proposer

    def sequence(self, method, *args, **kwargs):
        seq = self.inner.sequence(method, *args, **kwargs)
        if method == "chain":  # the third step (prefill, then rounds) fails, batched or alone
            begin, calls = seq._begin_round, [0]

            def failing(*drafted):
                calls[0] += 1
                if calls[0] == 2:
                    raise RuntimeError("injected fault in round 3")
                return begin(*drafted)

            seq._begin_round = failing
        return seq


def test_a_failing_decode_harms_no_other_request(tiny_target, tiny_decoder):
    app = create_app(tiny_target, FaultyDecoder(tiny_decoder), model_id=MODEL, default_method="ar")
    messages = user("fault tolerance")
    want = offline(tiny_target, tiny_target.encode_chat(messages), 30)
    with live_server(app) as base:
        c = client(base)

        def ask(method, stream):
            if stream:
                return chat_stream(c, messages, max_tokens=30, temperature=0, extra_body={"method": method})[0]
            return c.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                             extra_body={"method": method}).choices[0].message.content

        with ThreadPoolExecutor(4) as pool:
            ok = [pool.submit(ask, m, s) for m, s in (("ar", True), ("ddtree", False))]
            with pytest.raises(openai.InternalServerError, match="injected fault"):
                ask("chain", False)
            assert [f.result() for f in ok] == [want, want]
        # streamed: the error is an event in the stream, then [DONE]
        raw = request(base, "POST", "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 30,
                                                             "temperature": 0, "method": "chain", "stream": True})[1]
        events = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
        assert json.loads(events[-2])["error"]["type"] == "server_error" and events[-1] == "[DONE]"
        h = wait_idle(base)
        assert (h["active"], h["state_bytes"], h["failed"]) == (0, 0, 2)
        assert ask("caddtree", True) == want and ask("ar", False) == want
