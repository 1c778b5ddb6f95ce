"""`drafttree serve`: bad options fail in a second with one line and exit 2; the real command serves the
README's requests and stops cleanly on Ctrl-C."""
import os
import signal
import subprocess
import sys

import pytest

from drafttree.apps.cli import main
from conftest import free_port, request, wait_until_healthy

BAD = [
    (["--port", "70000"], "--port must be <= 65535"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--max-body-bytes", "-1"], "--max-body-bytes must be >= 1"),
    (["--api-key", " "], "--api-key must not be empty"),
    (["--threads", "0"], "threads must be >= 1"),
    (["--budget", "0"], "--budget must be >= 1"),
    (["--model", "/no/such/dir"], "neither an embedded model"),
]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_options_exit_2_before_loading(args, message, capsys, monkeypatch):
    import drafttree.load

    monkeypatch.setattr(drafttree.load, "load_target", lambda *a, **k: pytest.fail("loaded a model"))
    if args[0] == "--model":
        monkeypatch.undo()  # load_target itself refuses the path, in a second
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_unknown_method_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--method", "beam"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err




@pytest.mark.slow
def test_the_command_serves_and_stops():
    port = free_port()
    env = {**os.environ, "DRAFTTREE_API_KEY": "sesame"}
    proc = subprocess.Popen([sys.executable, "-m", "drafttree.apps.cli", "serve", "--port", str(port), "--method", "chain",
                             "--max-concurrency", "2"], env=env, stderr=subprocess.PIPE, text=True,
                            # a test run started in the background (`make test &`) ignores SIGINT, and the server
                            # would inherit that: give it Ctrl-C back, which is what this test sends
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, base)
        body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": 8, "temperature": 0}
        assert request(base, "POST", "/v1/chat/completions", body)[0] == 401
        s, out, _ = request(base, "POST", "/v1/chat/completions", body, headers={"Authorization": "Bearer sesame"})
        assert s == 200 and out["choices"][0]["message"]["content"] and out["drafttree"]["method"] == "chain"
        assert out["usage"]["completion_tokens"] <= 8
        s, out, _ = request(base, "GET", "/v1/models", headers={"Authorization": "Bearer sesame"})
        assert [m["id"] for m in out["data"]] == ["smollm2-135m-instruct"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = None
        err = proc.stderr.read()
    assert rc == 0, err
    assert f"http://127.0.0.1:{port}/v1" in err and "Traceback" not in err
