"""Load test of `drafttree serve` on loopback: N streaming clients at once, each sending M chat requests one
after another (N × M requests in all), every reply checked against offline greedy decoding.

    .venv/bin/python bench/serve_load.py --clients 4 --requests 8              # a quick check
    .venv/bin/python bench/serve_load.py --clients 32 --requests 200 --max-tokens 64   # the target load

By default the server is started here as a subprocess (`drafttree serve` on 127.0.0.1, a free port), so
its resident memory is its own and the clients' Python threads do not share its interpreter; `--url`
connects to a running server instead (loopback only; its RSS is read when `--server-pid` is given).
Prompts: GSM8K *train* questions (`--gsm8k`, default ../shared/data/gsm8k/train.jsonl), or a small
built-in list when that file is absent; never an evaluation set. Requests are greedy (temperature 0), so
each reply must equal the offline decode of its prompt with the same method, computed in this process
with drafttree.methods.Decoder before the load starts.

Reported: throughput (completion tokens/s and requests/s over the load's wall time), time to first token
(request sent → first text chunk), inter-chunk latency (gaps between text chunks: a speculative round
sends several tokens at once), time per output token per request ((last − first chunk)/(tokens − 1)),
all as p50/p90/p99/max; failures (HTTP errors, error events, broken streams); replies that differ from
offline; the server's RSS after start-up, after a warm-up burst (one request per client) and after the
load (idle again): the check is `after` within 10% of `warm`. JSON and markdown go to --out (docs/serve).

`--peer llama.cpp` runs the same load against llama.cpp's `llama-server` instead (built once from the vendored
source of the pinned llama-cpp-python sdist, drafttree.apps.bench.llama_tools; the embedded model's own GGUF file;
`--parallel` slots = --max-concurrency, continuous batching, the same threads); `--peer llama.cpp-ngram-mod-m12-d16`
with its n-gram speculative decoding. Its replies come from other arithmetic, so they are compared with drafttree's
offline replies for information only (reported as agreement, not failed on); τ comes from its draft counters.
"""
from __future__ import annotations

import argparse
import datetime
import http.client
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tqdm import tqdm  # noqa: E402

from drafttree.atomic import atomic_write_text  # noqa: E402

BUILTIN_PROMPTS = [  # used only when the GSM8K train file is not there
    "A baker makes 24 muffins and sells 3/4 of them. How many muffins are left?",
    "Tom has 5 boxes with 12 pencils each. He gives away 17 pencils. How many does he keep?",
    "A train travels 60 km per hour for 2.5 hours. How far does it go?",
    "Sara reads 15 pages a day. How many days does she need for a 240-page book?",
    "Write a haiku about a lighthouse.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "What is the capital of Australia, and why is it not Sydney?",
]
DEFAULT_GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
LIMITS = {"clients": 256, "requests": 10_000, "max_tokens": 1024}


# ---- prompts and offline references ----------------------------------------------------------------


def load_questions(path: Path, n: int) -> tuple[list[str], str]:
    if path.is_file():
        out = []
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    out.append(json.loads(line)["question"])
                if len(out) >= n:
                    break
        return out, f"GSM8K train questions ({path.name}, first {len(out)})"
    return BUILTIN_PROMPTS[:n], f"built-in list ({min(n, len(BUILTIN_PROMPTS))} prompts; {path} not found)"


def offline_replies(a, prompts: list[str]) -> tuple[list[str], list[int], dict]:
    """Greedy replies of each prompt, decoded one after another in this process with the server's method."""
    from drafttree.load import load_target
    from drafttree.methods import Decoder

    target = load_target(a.model, compute=a.compute, threads=a.threads)
    decoder = Decoder(target, drafter=a.drafter, budget=a.budget)
    texts, lengths = [], []
    warm = decoder.sequence(a.method, target.encode_chat("Hi"), max_new_tokens=4)  # one-off first-call costs
    while not warm.done:
        warm.step()
    warm.close()
    t0 = time.perf_counter()
    for text in tqdm(prompts, desc="offline replies", unit="prompt", disable=a.no_progress):
        seq = decoder.sequence(a.method, target.encode_chat([{"role": "user", "content": text}]),
                               max_new_tokens=a.max_tokens)
        while not seq.done:
            seq.step()
        texts.append(target.decode(seq.tokens))
        lengths.append(len(seq.tokens))
        seq.close()
    wall = time.perf_counter() - t0
    info = {"compute": target.compute_label, "offline_tokens_per_s": round(sum(lengths) / wall, 2)}
    return texts, lengths, info


# ---- the server --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def get(base: str, path: str, timeout: float = 10.0) -> tuple[int, dict]:
    u = urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def start_server(a, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "drafttree.apps.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", a.model, "--compute", a.compute, "--method", a.method, "--budget", str(a.budget),
           "--max-concurrency", str(a.max_concurrency), "--max-waiting", str(max(1024, a.clients))]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    if a.drafter:
        cmd += ["--drafter", a.drafter]
    log = log_path.open("w")
    env = {k: v for k, v in os.environ.items() if k != "DRAFTTREE_API_KEY"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    return proc, f"http://127.0.0.1:{port}"


PEERS = ("llama.cpp", "llama.cpp-ngram-mod", "llama.cpp-ngram-mod-m12-d16")
PEER_CONTEXT = 1024  # tokens per slot: a GSM8K prompt in the chat template (< 300) and its reply


def start_peer(a, log_path: Path) -> tuple[subprocess.Popen, str]:
    """llama.cpp's server on the embedded model's GGUF file, one slot per concurrent request."""
    from drafttree.apps.bench.llama_tools import build_tool
    from drafttree.apps.bench.peers import NGRAM_MOD
    from drafttree.gguf_convert import find_embedded_gguf

    gguf = Path(a.model) if Path(a.model).is_file() else find_embedded_gguf(a.model)
    port, threads = free_port(), str(a.threads or os.cpu_count())
    cmd = [str(build_tool("llama-server")), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-t", threads, "-tb", threads, "-np", str(a.max_concurrency), "-c", str(a.max_concurrency * PEER_CONTEXT),
           "--no-webui", *NGRAM_MOD.get(a.peer, [])]
    log = log_path.open("w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def wait_healthy(base: str, proc: subprocess.Popen | None, log_path: Path | None, timeout: float = 900) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text()[-3000:] if log_path else ""
            raise SystemExit(f"serve_load: the server exited ({proc.returncode}):\n{tail}")
        try:
            status, body = get(base, "/health", timeout=5)
            if status == 200:
                return body
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("serve_load: the server did not become healthy")
        time.sleep(0.5)


# ---- clients -------------------------------------------------------------------------------------


def stream_request(base: str, model: str, method: str, prompt: str, max_tokens: int, api_key: str | None,
                   timeout: float) -> dict:
    """One streamed chat completion, timed chunk by chunk."""
    u = urlparse(base)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                       "method": method}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    out = {"ok": False, "text": "", "chunk_times": [], "error": None, "tokens": None, "stats": None}
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        r = conn.getresponse()
        if r.status != 200:
            out["error"] = f"HTTP {r.status}: {r.read()[:300]!r}"
            return out
        parts, done = [], False
        for raw in r:
            line = raw.decode("utf-8").rstrip("\n")
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                out["error"] = f"error event: {event['error'].get('message')}"
                return out
            if event.get("timings"):  # llama-server: its draft counters, for τ
                out["timings"] = event["timings"]
            if event.get("usage") and not event.get("choices"):
                out["tokens"] = event["usage"]["completion_tokens"]
                continue
            choice = event["choices"][0]
            content = choice["delta"].get("content")
            if content:
                parts.append(content)
                out["chunk_times"].append(time.perf_counter() - t0)
            if choice.get("finish_reason") is not None:
                out["stats"] = event.get("drafttree")
        out["text"] = "".join(parts)
        out["ok"] = done
        if not done:
            out["error"] = "the stream ended before [DONE]"
    except (OSError, ValueError, http.client.HTTPException) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        out["wall_s"] = time.perf_counter() - t0
        conn.close()
    return out


def peer_tau(timings: dict, tokens: int) -> float:
    """Tokens per target forward of a llama-server reply: each forward after the prompt's verifies a draft (or
    none) and keeps its accepted tokens and one more; the prompt's forward gives the first token."""
    accepted = timings.get("draft_n_accepted", 0)
    return (tokens - 1) / max(1, tokens - 1 - accepted)


def percentiles(values: list[float], scale: float = 1000.0) -> dict:
    """p50/p90/p99/max in ms (nearest rank)."""
    if not values:
        return {"n": 0}
    v = sorted(values)

    def rank(q):
        return v[min(len(v) - 1, max(0, math.ceil(q * len(v) - 1e-9) - 1))]  # the ceil(q·n)-th smallest

    return {"n": len(v), "p50": round(rank(0.5) * scale, 2), "p90": round(rank(0.9) * scale, 2),
            "p99": round(rank(0.99) * scale, 2), "max": round(v[-1] * scale, 2),
            "mean": round(statistics.fmean(v) * scale, 2)}


def run_load(base: str, a, prompts: list[str], wants: list[str], lengths: list[int], api_key: str | None) -> dict:
    results: list[dict] = [None] * (a.clients * a.requests)  # type: ignore[list-item]
    # on stderr, a few updates a second: no measurable load beside the server's
    bar = tqdm(total=len(results), desc="requests", unit="req", disable=a.no_progress)
    health_samples, stop = [], threading.Event()

    def sample_health():
        while not stop.wait(0.5):
            try:
                health_samples.append(get(base, "/health", timeout=5)[1])
            except OSError:
                pass

    def client(c: int):
        for j in range(a.requests):
            i = c * a.requests + j
            k = i % len(prompts)
            res = stream_request(base, a.model, a.method, prompts[k], a.max_tokens, api_key, a.timeout)
            res["prompt"] = k
            res["equal"] = res["ok"] and res["text"] == wants[k]
            results[i] = res
            bar.update(1)

    sampler = threading.Thread(target=sample_health, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(a.clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    bar.close()
    stop.set()
    sampler.join()
    ok = [r for r in results if r["ok"]]
    ttft = [r["chunk_times"][0] for r in ok if r["chunk_times"]]
    gaps = [b - a_ for r in ok for a_, b in zip(r["chunk_times"], r["chunk_times"][1:])]
    tpot = [(r["chunk_times"][-1] - r["chunk_times"][0]) / (r["tokens"] - 1) for r in ok
            if r["chunk_times"] and r["tokens"] and r["tokens"] > 1]
    tokens = sum(r["tokens"] or 0 for r in ok)
    taus = [r["stats"]["tau"] for r in ok if r.get("stats") and "tau" in r["stats"]]
    taus += [peer_tau(r["timings"], r["tokens"]) for r in ok if r.get("timings") and r["tokens"]]
    failures = [r["error"] for r in results if not r["ok"]]
    mismatches = [r["prompt"] for r in results if r["ok"] and not r["equal"]]
    return {
        "requests": len(results), "ok": len(ok), "failures": len(failures), "failure_examples": failures[:5],
        "mismatches": len(mismatches), "mismatched_prompts": sorted(set(mismatches))[:20],
        # what a mismatch looked like (a greedy reply must equal offline: keep the evidence)
        "mismatch_examples": [{"prompt": r["prompt"], "served": r["text"], "offline": wants[r["prompt"]],
                               "stats": r.get("stats")} for r in results if r["ok"] and not r["equal"]][:3],
        "all_equal_offline": not failures and not mismatches,
        "wall_s": round(wall, 2), "completion_tokens": tokens,
        "expected_tokens": sum(lengths[r["prompt"]] for r in results),
        "tokens_per_s": round(tokens / wall, 2), "requests_per_s": round(len(ok) / wall, 3),
        "ttft_ms": percentiles(ttft), "inter_chunk_ms": percentiles(gaps), "tpot_ms": percentiles(tpot),
        "tau_mean": round(statistics.fmean(taus), 3) if taus else None,
        # (llama-server's /health has no such counters: None)
        **{f"peak_{key}": max((h[key] for h in health_samples if key in h), default=None)
           for key in ("active", "waiting", "state_bytes")},
    }


# ---- report ----------------------------------------------------------------------------------------


def machine() -> dict:
    from drafttree.compute import cpu_info

    cpu = cpu_info()
    return {"cpu": cpu.model, "arch": cpu.arch, "isa": cpu.isa_summary, "cores": os.cpu_count(),
            "python": platform.python_version(), "load_average_1min_at_start": round(os.getloadavg()[0], 2)}


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except OSError:
        return None


def mib(n) -> str:
    return "n/a" if n is None else f"{n / 2 ** 20:.1f} MiB"


def markdown(r: dict) -> str:
    s, L, m = r["settings"], r["load"], r["machine"]

    def row(name, p):
        return f"| {name} | {p.get('p50', '-')} | {p.get('p90', '-')} | {p.get('p99', '-')} | {p.get('max', '-')} |"

    rss = r["rss"]
    compute = (f"llama.cpp's kernels on the GGUF file (drafttree's offline replies: {r['compute']})" if s.get("peer")
               else f"compute {r['compute']}")
    lines = [
        f"# {s.get('peer') or 'drafttree serve'}: {s['clients']} clients × {s['requests']} requests", "",
        f"{r['date']}, commit {r['commit']}. Machine: {m['cpu']} ({m['arch']}), {m['cores']} cores, ISA {m['isa']}, "
        f"1-minute load average {m['load_average_1min_at_start']} when the bench started. "
        f"Model {s['model']}, {compute}, method `{s.get('peer') or s['method']}`, max_tokens {s['max_tokens']}, "
        f"temperature 0, `--max-concurrency {s['max_concurrency']}`, threads {s['threads'] or 'all'}. "
        f"Prompts: {r['prompts']}. Server: {r['server']}.", "",
        "| result | value |", "|---|---|",
        f"| requests (ok / failed) | {L['requests']} ({L['ok']} / {L['failures']}) |",
        (f"| replies equal to drafttree's offline greedy (information: llama.cpp's own arithmetic) | "
         f"{L['ok'] - L['mismatches']} of {L['ok']} |" if s.get("peer") else
         f"| every reply equal to offline greedy | {'yes' if L['all_equal_offline'] else 'NO'}"
         f" ({L['mismatches']} mismatches) |"),
        f"| throughput | {L['tokens_per_s']} tokens/s, {L['requests_per_s']} requests/s "
        f"({L['completion_tokens']} tokens in {L['wall_s']} s) |",
        f"| drafttree offline, one request at a time | {r['offline_tokens_per_s']} tokens/s |",
        f"| mean τ (server's round statistics{'; llama.cpp: from its draft counters' if s.get('peer') else ''}) | "
        f"{L['tau_mean']} |",
        f"| peak active / waiting / state | {L['peak_active']} / {L['peak_waiting']} / {mib(L['peak_state_bytes'])} |",
        f"| server RSS: start-up / after warm-up / after the load | {mib(rss['start'])} / {mib(rss['warm'])} / "
        f"{mib(rss['after'])} |",
        f"| RSS after within 10% of after warm-up | {rss['within_10_percent']} |", "",
        "| latency (ms) | p50 | p90 | p99 | max |", "|---|---|---|---|---|",
        row("time to first token", L["ttft_ms"]), row("inter-chunk", L["inter_chunk_ms"]),
        row("time per output token", L["tpot_ms"]), "",
        "Time to first token: request sent → first text chunk (includes waiting for a decode slot). Inter-chunk: "
        "gaps between text chunks of a stream (a speculative round sends several tokens in one chunk). Time per "
        "output token: (last − first chunk) / (tokens − 1) per request. Generated by `bench/serve_load.py`.", "",
    ]
    if L["failure_examples"]:
        lines += ["Failures (first 5):", ""] + [f"- {e}" for e in L["failure_examples"]] + [""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    p.add_argument("--requests", type=int, default=8, help="requests per client, one after another")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--method", default="caddtree-online")
    p.add_argument("--max-concurrency", type=int, default=8, help="the server's --max-concurrency")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--compute", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--drafter", default=None)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--prompts", type=int, default=200, help="distinct prompts (requests cycle through them)")
    p.add_argument("--gsm8k", type=Path, default=DEFAULT_GSM8K, help="GSM8K train jsonl (questions used as prompts)")
    p.add_argument("--url", default=None, help="a running server (loopback) instead of starting one")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: the server's pid, for its RSS")
    p.add_argument("--api-key", default=None, help="with --url: the server's API key")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--peer", choices=PEERS, default=None,
                   help="run the load against llama.cpp's llama-server (optionally with its ngram-mod speculation)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "serve")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (offline replies, the load)")
    a = p.parse_args(argv)
    for name, top in LIMITS.items():
        v = getattr(a, name)
        if not 1 <= v <= top:
            p.error(f"--{name.replace('_', '-')} must be in 1..{top}, got {v}")
    if a.url is not None and urlparse(a.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        p.error("--url must be a loopback address: this load test does not leave the machine")

    load_at_start = round(os.getloadavg()[0], 2)  # other work on the machine shows here: compare runs with care
    questions, prompt_source = load_questions(a.gsm8k, min(a.prompts, a.clients * a.requests))
    tmp = Path(tempfile.mkdtemp(prefix="serve_load_"))
    proc, log_path = None, tmp / "server.log"
    print(f"serve_load: offline greedy replies of {len(questions)} prompts ({a.method}) ...", file=sys.stderr)
    wants, lengths, info = offline_replies(a, questions)  # first, alone: its tokens/s is a clean reference
    if a.peer is not None:
        proc, base = start_peer(a, log_path)
        server = f"{a.peer}: llama.cpp's llama-server started by the bench ({' '.join(proc.args[3:])})"
    elif a.url is None:
        proc, base = start_server(a, log_path)
        server = "started by the bench (a `drafttree serve` subprocess)"
    else:
        base, server = a.url.rstrip("/"), f"{a.url} (running)"
    try:
        wait_healthy(base, proc, log_path if proc else None)
        pid = proc.pid if proc is not None else a.server_pid
        rss_start = rss_bytes(pid)
        print(f"serve_load: warm-up burst ({a.clients} requests at once) ...", file=sys.stderr)
        warm = argparse.Namespace(**{**vars(a), "requests": 1})
        warm_load = run_load(base, warm, questions, wants, lengths, a.api_key)
        wait_idle(base)
        rss_warm = rss_bytes(pid)
        print(f"serve_load: {a.clients} clients × {a.requests} requests, max_tokens {a.max_tokens} ...", file=sys.stderr)
        load = run_load(base, a, questions, wants, lengths, a.api_key)
        health = wait_idle(base)
        rss_after = rss_bytes(pid)
    finally:
        if proc is not None:
            proc.send_signal(2)  # SIGINT: uvicorn shuts down gracefully
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    within = None if rss_warm is None or rss_after is None else abs(rss_after - rss_warm) <= 0.10 * rss_warm
    report_machine = machine()
    report_machine["load_average_1min_at_start"] = load_at_start
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": git_commit(),
        "machine": report_machine, "compute": info["compute"], "offline_tokens_per_s": info["offline_tokens_per_s"],
        "settings": {k: getattr(a, k) for k in ("clients", "requests", "max_tokens", "method", "max_concurrency",
                                                 "model", "threads", "budget", "peer")},
        "prompts": prompt_source, "server": server,
        "warm_up": {k: warm_load[k] for k in ("requests", "failures", "mismatches", "wall_s")},
        "load": load, "health_after": health,
        "rss": {"start": rss_start, "warm": rss_warm, "after": rss_after, "within_10_percent": within},
    }
    a.out.mkdir(parents=True, exist_ok=True)
    stem = f"load-{a.clients}x{a.requests}-{a.peer or a.method}"
    atomic_write_text(a.out / f"{stem}.json", json.dumps(report, indent=2) + "\n")
    atomic_write_text(a.out / f"{stem}.md", markdown(report))
    print(markdown(report))
    print(f"serve_load: wrote {a.out / stem}.json and .md", file=sys.stderr)
    # the peer's replies come from other arithmetic, and its prompt cache grows with the load: both for information
    exact = a.peer is not None or (load["all_equal_offline"] and warm_load["all_equal_offline"])
    ok = exact and load["failures"] == 0 and warm_load["failures"] == 0 and (a.peer is not None or within is not False)
    return 0 if ok else 1


def wait_idle(base: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = get(base, "/health")[1]
        if "active" not in h:  # llama-server: no counters to wait on
            return h
        if (h.get("active"), h.get("waiting"), h.get("state_bytes")) == (0, 0, 0) or time.monotonic() > deadline:
            return h
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
