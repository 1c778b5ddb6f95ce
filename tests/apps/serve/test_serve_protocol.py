"""Bad input over real HTTP (uvicorn on loopback, a fake decoder): every case is OpenAI's error body with
400/401/404/413 (never a 500 or a traceback), and the server serves the next request unchanged."""
import http.client
import json

import pytest

from drafttree.apps.serve.app import create_app
from conftest import CharTokenizer, FakeDecoder, fake_target, live_server, request, wait_idle

MAX_CONTEXT = 64
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def server():
    dec = FakeDecoder()
    app = create_app(fake_target(MAX_CONTEXT), dec, model_id="fake", methods=("ar", "chain", "broken"),
                     default_method="ar", max_body_bytes=4096)
    with live_server(app) as base:
        yield base, dec


@pytest.fixture(scope="module")
def keyed():
    app = create_app(fake_target(MAX_CONTEXT), FakeDecoder(), model_id="fake", methods=("ar",), default_method="ar",
                     api_key="sesame")
    with live_server(app) as base:
        yield base


def chat(**over):
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    body.update(over)
    return {k: v for k, v in body.items() if v is not DROP}


DROP = object()


def good_reply(base):
    status, body, _ = request(base, "POST", CHAT, chat())
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def assert_error(status, body, want_status, param=None, code=None):
    assert status == want_status, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


BAD_CHAT = {  # name: (body overrides, status, param, code)
    "unknown model": (dict(model="gpt-9"), 404, "model", "model_not_found"),
    "missing model": (dict(model=DROP), 400, "model", "missing_field"),
    "model not a string": (dict(model=7), 400, "model", None),
    "messages missing": (dict(messages=DROP), 400, "messages", "missing_field"),
    "messages a string": (dict(messages="hi"), 400, "messages", None),
    "messages empty": (dict(messages=[]), 400, "messages", None),
    "content a number": (dict(messages=[{"role": "user", "content": 5}]), 400, None, None),
    "unknown role": (dict(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role", None),
    "image part": (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
                   400, "messages[0].content[0]", "unsupported_parameter"),
    "max_tokens a string": (dict(max_tokens="16"), 400, "max_tokens", None),
    "max_tokens a bool": (dict(max_tokens=True), 400, "max_tokens", None),
    "max_tokens a float": (dict(max_tokens=3.5), 400, "max_tokens", None),
    "max_tokens negative": (dict(max_tokens=-5), 400, "max_tokens", None),
    "max_tokens zero": (dict(max_tokens=0), 400, "max_tokens", None),
    "max_tokens huge": (dict(max_tokens=10 ** 12), 400, "max_tokens", None),
    "max_tokens enormous": (dict(max_tokens=10 ** 40), 400, "max_tokens", None),
    "max_completion_tokens negative": (dict(max_completion_tokens=-1), 400, "max_completion_tokens", None),
    "prompt + max_tokens over the context": (dict(max_tokens=MAX_CONTEXT - 5), 400, "messages", "context_length_exceeded"),
    "prompt over the context": (dict(messages=[{"role": "user", "content": "x" * 200}], max_tokens=DROP), 400,
                                "messages", "context_length_exceeded"),
    "temperature negative": (dict(temperature=-0.5), 400, "temperature", None),
    "temperature a string": (dict(temperature="hot"), 400, "temperature", None),
    "temperature inf": (dict(temperature=1e999), 400, "temperature", None),  # json.dumps writes Infinity
    "temperature nan": (dict(temperature=float("nan")), 400, "temperature", None),  # NaN
    "top_p zero": (dict(top_p=0), 400, "top_p", None),
    "top_p over one": (dict(top_p=1.5), 400, "top_p", None),
    "top_p nan": (dict(top_p=float("nan")), 400, "top_p", None),
    "top_k negative": (dict(top_k=-1), 400, "top_k", None),
    "seed a string": (dict(seed="x"), 400, "seed", None),
    "seed too big": (dict(seed=2 ** 70), 400, "seed", None),
    "n = 2": (dict(n=2), 400, "n", "unsupported_parameter"),
    "n = 0": (dict(n=0), 400, "n", None),
    "n a string": (dict(n="1"), 400, "n", None),
    "stream a string": (dict(stream="yes"), 400, "stream", None),
    "stream_options without stream": (dict(stream_options={"include_usage": True}), 400, "stream_options", None),
    "stop a number": (dict(stop=5), 400, "stop", None),
    "stop empty": (dict(stop=[""]), 400, "stop", None),
    "five stops": (dict(stop=list("abcde")), 400, "stop", None),
    "logprobs": (dict(logprobs=True), 400, "logprobs", "unsupported_parameter"),
    "tools": (dict(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", "unsupported_parameter"),
    "presence_penalty": (dict(presence_penalty=0.5), 400, "presence_penalty", "unsupported_parameter"),
    "json response_format": (dict(response_format={"type": "json_object"}), 400, "response_format", None),
    "unknown method": (dict(method="beam"), 400, "method", None),
    "method a number": (dict(method=3), 400, "method", None),
}


@pytest.mark.parametrize("case", sorted(BAD_CHAT))
def test_bad_chat_requests(server, case):
    base, _ = server
    over, status, param, code = BAD_CHAT[case]
    s, body, _ = request(base, "POST", CHAT, chat(**over))
    assert_error(s, body, status, param, code)


BAD_COMPLETIONS = {
    "prompt missing": (dict(prompt=DROP), 400, "prompt"),
    "prompt a number": (dict(prompt=5), 400, "prompt"),
    "token id out of range": (dict(prompt=[1, 2, 211]), 400, "prompt"),
    "negative token id": (dict(prompt=[-1]), 400, "prompt"),
    "batch of prompts": (dict(prompt=["a", "b"]), 400, "prompt"),
    "empty prompt": (dict(prompt=""), 400, "prompt"),
    "empty token prompt": (dict(prompt=[]), 400, "prompt"),
    "echo": (dict(echo=True), 400, "echo"),
    "best_of": (dict(best_of=3), 400, "best_of"),
    "suffix": (dict(suffix="x"), 400, "suffix"),
}


@pytest.mark.parametrize("case", sorted(BAD_COMPLETIONS))
def test_bad_completion_requests(server, case):
    base, _ = server
    over, status, param = BAD_COMPLETIONS[case]
    body = {"model": "fake", "prompt": "hello", "max_tokens": 4, **over}
    s, out, _ = request(base, "POST", COMPLETIONS, {k: v for k, v in body.items() if v is not DROP})
    assert_error(s, out, status, param)


RAW = {
    "malformed JSON": (b'{"model": "fake", "messages": [', 400),
    "not an object": (b'[1, 2, 3]', 400),
    "empty body": (b"", 400),
    "not UTF-8": (b'{"model": "\xff\xfe"}', 400),
    "nested too deep": (b"[" * 100_000, 413),  # over this server's 4096-byte limit
    "nested deep": (b"[" * 4000, 400),  # RecursionError inside the JSON parser
    "huge integer literal": (b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": '
                             + b"9" * 3950 + b"}", 400),
}


@pytest.mark.parametrize("case", sorted(RAW))
def test_raw_bodies(server, case):
    base, _ = server
    raw, status = RAW[case]
    s, body, _ = request(base, "POST", CHAT, raw=raw)
    assert_error(s, body, status)


def test_oversized_bodies_413(server):
    base, _ = server
    big = chat(messages=[{"role": "user", "content": "x" * 5000}])
    s, body, _ = request(base, "POST", CHAT, big)  # Content-Length says it
    assert_error(s, body, 413, code="request_too_large")
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)  # chunked: no Content-Length, counted as read
    conn.request("POST", CHAT, body=iter([json.dumps(big).encode()[i:i + 1000] for i in range(0, 6000, 1000)]),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    assert_error(resp.status, json.loads(resp.read()), 413, code="request_too_large")
    conn.close()


def test_routes_and_methods(server):
    base, _ = server
    s, body, _ = request(base, "GET", "/v1/nothing")
    assert_error(s, body, 404)
    s, body, _ = request(base, "GET", CHAT)
    assert_error(s, body, 405)
    s, body, _ = request(base, "GET", "/v1/models")
    assert s == 200 and [m["id"] for m in body["data"]] == ["fake"] and body["object"] == "list"
    s, body, _ = request(base, "GET", "/v1/models/fake")
    assert s == 200 and body["id"] == "fake"
    s, body, _ = request(base, "GET", "/v1/models/other")
    assert_error(s, body, 404, code="model_not_found")


def test_api_key(keyed):
    base = keyed
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}, {"Authorization": "Bearer "}):
        for method, path, body in (("POST", CHAT, chat()), ("GET", "/v1/models", None)):
            s, out, hdrs = request(base, method, path, body, headers=headers)
            assert_error(s, out, 401, code="invalid_api_key")
            assert hdrs.get("www-authenticate") == "Bearer"
    s, out, _ = request(base, "POST", CHAT, chat(model="gpt-9"))  # the key is checked before anything else
    assert s == 401
    s, out, _ = request(base, "POST", CHAT, chat(), headers={"Authorization": "Bearer sesame"})
    assert s == 200 and out["choices"][0]["finish_reason"] == "length"
    assert request(base, "GET", "/health")[0] == 200  # health needs no key


def test_good_requests_and_the_shape_of_replies(server):
    base, dec = server
    s, body, _ = request(base, "POST", CHAT, chat(stop=None, seed=3, top_p=0.5, temperature=0.7, user="me",
                                                  metadata={"a": "b"}, frequency_penalty=0, unknown_field=1))
    assert s == 200, body
    assert body["object"] == "chat.completion" and body["model"] == "fake" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    prompt_tokens = len(CharTokenizer().apply_chat_template([{"role": "user", "content": "hi"}])["input_ids"])
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 4, "total_tokens": prompt_tokens + 4}
    ext = body["drafttree"]
    assert ext["method"] == "ar" and ext["rounds"] == 4 and ext["queue_s"] >= 0
    s, body, _ = request(base, "POST", COMPLETIONS, {"model": "fake", "prompt": [3, 4, 9], "max_tokens": 3,
                                                     "method": "chain"})
    assert s == 200 and body["choices"][0]["text"] == CharTokenizer().decode([10, 11, 12])
    assert body["usage"]["prompt_tokens"] == 3 and body["drafttree"]["method"] == "chain"
    s, body, _ = request(base, "POST", COMPLETIONS, {"model": "fake", "prompt": ["ab"], "max_tokens": 2})
    assert s == 200 and body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_a_failing_decode_is_a_server_error_for_that_request_only(server):
    base, _ = server
    before = good_reply(base)
    s, body, _ = request(base, "POST", CHAT, chat(method="broken"))
    assert_error(s, body, 500)
    assert body["error"]["type"] == "server_error" and "cannot make this sequence" in body["error"]["message"]
    assert good_reply(base) == before


def test_server_is_unharmed_after_all_bad_input(server):
    base, dec = server
    health = wait_idle(base)
    assert (health["active"], health["waiting"], health["state_bytes"]) == (0, 0, 0) and health["worker_alive"]
    assert all(s.closed for s in dec.made)
    assert good_reply(base) == CharTokenizer().decode(
        [(CharTokenizer().apply_chat_template([{"role": "user", "content": "hi"}])["input_ids"][-1] + k) % 200
         for k in range(1, 5)])


def test_health_and_a_stopped_worker():
    app = create_app(fake_target(MAX_CONTEXT), FakeDecoder(), model_id="fake", methods=("ar",), default_method="ar")
    with live_server(app) as base:
        s, h, _ = request(base, "GET", "/health")
        assert s == 200 and h["status"] == "ok" and h["rss_bytes"] > 0 and h["worker_alive"]
        app.state.scheduler.stop()
        s, h, _ = request(base, "GET", "/health")
        assert s == 503 and not h["worker_alive"]
        s, body, _ = request(base, "POST", CHAT, chat())
        assert_error(s, body, 503, code="unavailable")


def test_queue_full_is_429():
    dec = FakeDecoder(delay=0.02)
    app = create_app(fake_target(MAX_CONTEXT), dec, model_id="fake", methods=("ar",), default_method="ar",
                     max_concurrency=1, max_waiting=1)
    with live_server(app) as base:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda _: request(base, "POST", CHAT, chat(max_tokens=20)), range(6)))
        statuses = sorted(s for s, _, _ in replies)
        assert statuses[0] == 200 and statuses[-1] == 429, statuses
        for s, body, _ in replies:
            if s == 429:
                assert_error(s, body, 429, code="rate_limit_exceeded")
