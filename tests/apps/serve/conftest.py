"""Fixtures of the server tests: a live uvicorn on a free loopback port, a tiny random model with a
character tokenizer, and a fake decoder for the scheduler's own logic."""
from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time

import pytest
import torch

from drafttree.target import Target
from spec_helpers import synthetic_cost_model


class CharTokenizer:
    """A tokenizer for the tiny random models (vocabulary 211): token 0 is "\n", token t > 0 the character
    chr(31 + t) (space, ASCII, then Latin-1 letters).

    Enough of the transformers tokenizer interface for Target and TextStream: encode, decode,
    apply_chat_template, eos_token_id. Characters outside the vocabulary encode as "?"."""

    eos_token_id = None

    def __init__(self, vocab_size: int = 211):
        self.vocab_size = vocab_size

    def _id(self, c: str) -> int:
        if c == "\n":
            return 0
        return ord(c) - 31 if 32 <= ord(c) < 31 + self.vocab_size else ord("?") - 31

    def encode(self, text, add_special_tokens=False):
        return [self._id(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join("\n" if int(t) == 0 else chr(31 + int(t)) for t in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, return_dict=True):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return {"input_ids": self.encode(text)}


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    from tiny_models import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("serve_tiny")
    make_tiny_checkpoint("llama", path)
    return path


@pytest.fixture(scope="session")
def tiny_target(tiny_path):
    """The tiny llama (fp32, random weights) with the character tokenizer and no stop token."""
    from drafttree.load import load_target

    model = load_target(str(tiny_path)).model
    return Target(model=model, tokenizer=CharTokenizer(model.config.vocab_size), name="tiny-llama")



@pytest.fixture(scope="session")
def tiny_decoder(tiny_target):
    """The real Decoder on the tiny model, with a random DFlash drafter (its drafts are rarely accepted) and an
    untrained Weaver (the weaver-* methods)."""
    from drafttree.methods import Decoder
    from drafttree.weaver import Weaver, WeaverConfig
    from spec_helpers import random_drafter_for

    drafter = random_drafter_for(tiny_target.model)
    cfg = tiny_target.model.config
    weaver = Weaver(WeaverConfig(vocab_size=cfg.vocab_size, embed_size=cfg.hidden_size,
                                 drafter_hidden_size=drafter.config.hidden_size, max_depth=drafter.config.block_size - 1,
                                 hidden_size=32, num_heads=4, intermediate_size=32, num_candidates=16)).eval()
    return Decoder(tiny_target, drafter=drafter, budget=8, max_tree_nodes=32, cost_model=synthetic_cost_model(),
                   weaver=weaver)


class CopyDecoder:
    """Sequences whose drafts come from a second copy of the tiny target (spec_helpers.TargetCopyProposer):
    deep accepted paths, partial acceptance and rejection in every round; "ddtree" drafts with noise."""

    def __init__(self, target, path):
        from drafttree.proposers import BestFirstPolicy, ChainPolicy, CostAwarePolicy
        from spec_helpers import TargetCopyProposer

        self.target = target
        self.proposers = {"chain": TargetCopyProposer(path, ChainPolicy()),
                          "ddtree": TargetCopyProposer(path, BestFirstPolicy(8), noise=3.0),
                          "caddtree": TargetCopyProposer(path, CostAwarePolicy(synthetic_cost_model(), 32), noise=1.0)}

    def proposer(self, method):
        return None if method == "ar" else self.proposers[method]

    def sequence(self, method, prompt_ids, max_new_tokens=256, sampling=None, stop_token_ids=None):
        from drafttree.engine import Sequence
        from drafttree.sampling import SamplingParams

        return Sequence(self.target, prompt_ids, self.proposer(method), max_new_tokens, sampling or SamplingParams(),
                        stop_token_ids)


@pytest.fixture(scope="session")
def copy_decoder(tiny_target, tiny_path):
    return CopyDecoder(tiny_target, tiny_path)


# ---- a live server ---------------------------------------------------------------------------------


@contextlib.contextmanager
def live_server(app):
    """uvicorn serving `app` on 127.0.0.1 at a free port, in a background thread; yields the base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def request(base: str, method: str, path: str, body=None, headers=None, raw: bytes | None = None, timeout=60):
    """(status, parsed JSON or text, headers) of one plain HTTP request."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    try:
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        text = resp.read().decode()
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = text
        return resp.status, parsed, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def wait_idle(base: str, timeout: float = 30.0) -> dict:
    """/health once no request is active or waiting (what a cancelled stream must come back to)."""
    deadline = time.monotonic() + timeout
    while True:
        _, h, _ = request(base, "GET", "/health")
        if (h["active"], h["waiting"], h["state_bytes"]) == (0, 0, 0) or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


# ---- a fake decoder: the scheduler's logic without a model -----------------------------------------


class FakeSequence:
    """Emits `prompt[-1] + 1, + 2, ...` (mod 200), `per_step` tokens a step; records its steps in `log`."""

    def __init__(self, name, prompt_ids, max_new_tokens, log, per_step=1, fail_at=None, delay=0.0):
        self.name, self.start, self.max_new = name, int(prompt_ids[-1]), max_new_tokens
        self.log, self.per_step, self.fail_at, self.delay = log, per_step, fail_at, delay
        self.tokens, self.finish_reason, self.closed, self.steps = [], None, False, 0
        self.stats = type("Stats", (), {"summary": lambda s: {"tau": 1.0, "rounds": self.steps}})()

    @property
    def done(self):
        return self.finish_reason is not None

    @property
    def state_bytes(self):
        return 0 if self.closed else 1000 + len(self.tokens)

    def step(self):
        assert not self.closed, "step() after close()"
        self.steps += 1
        self.log.append(self.name)
        if self.delay:
            time.sleep(self.delay)
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise RuntimeError("injected fault")
        n = min(self.per_step, self.max_new - len(self.tokens))
        new = [(self.start + len(self.tokens) + i + 1) % 200 for i in range(n)]
        self.tokens += new
        if len(self.tokens) >= self.max_new:
            self.finish_reason = "length"
        return new

    def close(self):
        self.closed = True
        if self.finish_reason is None:
            self.finish_reason = "cancelled"


class FakeDecoder:
    def __init__(self, **kwargs):
        self.log, self.kwargs, self.made = [], kwargs, []
        self.fail_methods: dict[str, int] = {}  # method -> the step that raises

    def sequence(self, method, prompt_ids, max_new_tokens=256, sampling=None, stop_token_ids=None):
        if method == "broken":
            raise ValueError("cannot make this sequence")
        seq = FakeSequence(f"{method}:{int(prompt_ids[-1])}", prompt_ids, max_new_tokens, self.log,
                           fail_at=self.fail_methods.get(method), **self.kwargs)
        self.made.append(seq)
        return seq


def fake_target(max_context: int = 512) -> Target:
    config = type("Config", (), {"max_position_embeddings": max_context, "vocab_size": 211})()
    model = type("Model", (), {"config": config, "dtype": torch.float32})()
    return Target(model=model, tokenizer=CharTokenizer(), name="fake")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc, base: str, timeout_s: float = 600) -> None:
    """Until a `drafttree serve` subprocess answers /health (a model load and, on a new machine, the kernel build)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if request(base, "GET", "/health", timeout=5)[0] == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.5)
