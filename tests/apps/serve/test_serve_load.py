"""bench/serve_load.py's client side (SSE parsing, timing, the equality check, percentiles, the report) against
a live server on a fake decoder: seconds, no model."""
import argparse
import importlib.util
from pathlib import Path

import pytest

from drafttree.apps.serve.app import create_app
from conftest import CharTokenizer, FakeDecoder, fake_target, live_server

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def serve_load():
    spec = importlib.util.spec_from_file_location("serve_load", ROOT / "bench" / "serve_load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_reply(prompt: str, n: int) -> str:
    tok = CharTokenizer()
    last = tok.apply_chat_template([{"role": "user", "content": prompt}])["input_ids"][-1]
    return tok.decode([(last + k) % 200 for k in range(1, n + 1)])


def test_load_against_a_fake_server(serve_load, tmp_path):
    app = create_app(fake_target(), FakeDecoder(), model_id="fake", methods=("ar",), default_method="ar",
                     max_concurrency=2)
    prompts = ["one", "two!", "three?"]
    wants = [fake_reply(p, 6) for p in prompts]
    a = argparse.Namespace(clients=3, requests=2, model="fake", method="ar", max_tokens=6, timeout=30,
                           no_progress=True)
    with live_server(app) as base:
        load = serve_load.run_load(base, a, prompts, wants, [6] * 3, None)
        assert load["requests"] == 6 and load["failures"] == 0 and load["all_equal_offline"]
        assert load["completion_tokens"] == 36 == load["expected_tokens"]
        assert load["ttft_ms"]["n"] == 6 and load["inter_chunk_ms"]["n"] == 30
        wrong = serve_load.run_load(base, a, prompts, ["x"] * 3, [6] * 3, None)
        assert wrong["mismatches"] == 6 and not wrong["all_equal_offline"]
        bad = argparse.Namespace(**{**vars(a), "model": "other"})
        failed = serve_load.run_load(base, bad, prompts, wants, [6] * 3, None)
        assert failed["failures"] == 6 and "HTTP 404" in failed["failure_examples"][0]
        assert serve_load.wait_idle(base)["active"] == 0
    report = {"date": "d", "commit": "c", "machine": {**serve_load.machine(), "load_average_1min_at_start": 0.1},
              "compute": "fp32", "offline_tokens_per_s": 1.0, "prompts": "p", "server": "s", "load": load,
              "settings": {"clients": 3, "requests": 2, "max_tokens": 6, "method": "ar", "max_concurrency": 2,
                           "model": "fake", "threads": None, "budget": 16},
              "rss": {"start": 1 << 20, "warm": 2 << 20, "after": 2 << 20, "within_10_percent": True}}
    md = serve_load.markdown(report)
    assert "| every reply equal to offline greedy | yes (0 mismatches) |" in md and "time to first token" in md


def test_percentiles(serve_load):
    p = serve_load.percentiles([i / 1000 for i in range(1, 101)])
    assert (p["n"], p["p50"], p["p90"], p["p99"], p["max"]) == (100, 50.0, 90.0, 99.0, 100.0)
    assert serve_load.percentiles([]) == {"n": 0}


def test_refuses_remote_urls_and_oversized_loads(serve_load):
    for argv in (["--url", "http://example.com:8000"], ["--clients", "0"], ["--max-tokens", "100000"]):
        with pytest.raises(SystemExit) as e:
            serve_load.main(argv)
        assert e.value.code == 2


def test_the_llama_cpp_peer_parts(serve_load, tmp_path, monkeypatch):
    """--peer: τ from llama-server's draft counters, its replies compared for information only, its command."""
    assert serve_load.peer_tau({"draft_n": 30, "draft_n_accepted": 21}, 64) == pytest.approx(63 / 42)
    assert serve_load.peer_tau({}, 64) == 1.0  # no speculation: one token a forward
    load = {"requests": 3, "ok": 3, "failures": 0, "failure_examples": [], "mismatches": 1, "all_equal_offline": False,
            "tokens_per_s": 9.0, "requests_per_s": 1.0, "completion_tokens": 18, "wall_s": 2.0, "tau_mean": 1.5,
            "peak_active": None, "peak_waiting": None, "peak_state_bytes": None,
            "ttft_ms": {"n": 0}, "inter_chunk_ms": {"n": 0}, "tpot_ms": {"n": 0}}
    report = {"date": "d", "commit": "c", "machine": {**serve_load.machine(), "load_average_1min_at_start": 0.1},
              "compute": "q4 (avx2)", "offline_tokens_per_s": 1.0, "prompts": "p", "server": "s", "load": load,
              "settings": {"clients": 3, "requests": 1, "max_tokens": 6, "method": "ar", "max_concurrency": 3,
                           "model": "fake", "threads": 2, "budget": 16, "peer": "llama.cpp-ngram-mod-m12-d16"},
              "rss": {"start": None, "warm": None, "after": None, "within_10_percent": None}}
    md = serve_load.markdown(report)
    assert md.startswith("# llama.cpp-ngram-mod-m12-d16: 3 clients") and "| 2 of 3 |" in md
    assert "method `llama.cpp-ngram-mod-m12-d16`" in md

    import drafttree.apps.bench.llama_tools as llama_tools
    monkeypatch.setattr(llama_tools, "build_tool", lambda name: tmp_path / name)
    monkeypatch.setattr(serve_load.subprocess, "Popen", lambda cmd, **kw: argparse.Namespace(args=cmd))
    a = argparse.Namespace(model="smollm2-135m-instruct", threads=2, max_concurrency=8,
                           peer="llama.cpp-ngram-mod-m12-d16")
    proc, base = serve_load.start_peer(a, tmp_path / "log")
    cmd = proc.args
    assert cmd[0] == str(tmp_path / "llama-server") and cmd[cmd.index("-np") + 1] == "8"
    assert cmd[cmd.index("-c") + 1] == str(8 * serve_load.PEER_CONTEXT) and "ngram-mod" in cmd
    assert base.startswith("http://127.0.0.1:")
