"""One request through `drafttree serve` against the same decode offline, side by side in one run.

    .venv/bin/python bench/serve_one.py                                  # ar and caddtree-online, 5 rounds
    .venv/bin/python bench/serve_one.py --methods ar --repeats 9 --threads 1

The server is a `drafttree serve` subprocess on 127.0.0.1 (as in bench/serve_load.py); the offline decode runs in
this process with drafttree.methods.Decoder, one Sequence stepped to the end, as `drafttree generate` does. Each
round decodes the same prompt (greedy, --max-tokens) once offline and once through the server, per method,
alternating, so machine noise falls on both; only one of the two processes works at a time. Reported per method,
medians over the rounds:

- decode tok/s by the Sequence's own clock (GenerationStats.tokens_per_s: time inside its rounds, prefill
  excluded): offline, and the server's (the response's `drafttree.tokens_per_s`);
- the client's decode rate: (tokens − 1) / (last − first text chunk), everything the server does between rounds
  included, against offline (tokens − 1) / (wall of the rounds after the first token);
- the request's wall (sent → [DONE]) against the offline wall (prefill + rounds + detokenization).

Every server reply must equal the offline text (exit 1 otherwise).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import machine, start_server, stream_request, wait_healthy  # noqa: E402

DEFAULT_PROMPT = "A train travels 60 km per hour for 2.5 hours. How far does it go? Explain step by step."


def offline_once(decoder, target, method: str, prompt: str, max_tokens: int) -> dict:
    """One decode to the end, timed as the server's client sees it: first token, then the rest."""
    t0 = time.perf_counter()
    seq = decoder.sequence(method, target.encode_chat([{"role": "user", "content": prompt}]),
                           max_new_tokens=max_tokens)
    first = None
    while not seq.done:
        new = seq.step()
        if new and first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    text = target.decode(seq.tokens)
    out = {"text": text, "tokens": len(seq.tokens), "stats_tok_s": seq.stats.tokens_per_s,
           "rate_tok_s": (len(seq.tokens) - 1) / (end - first) if first and end > first else None,
           "wall_s": time.perf_counter() - t0}
    seq.close()
    return out


def served_once(base: str, model: str, method: str, prompt: str, max_tokens: int) -> dict:
    r = stream_request(base, model, method, prompt, max_tokens, None, 600.0)
    if not r["ok"]:
        raise SystemExit(f"serve_one: the request failed: {r['error']}")
    times, n = r["chunk_times"], r["tokens"] or 0
    return {"text": r["text"], "tokens": n, "stats_tok_s": (r["stats"] or {}).get("tokens_per_s"),
            "rate_tok_s": (n - 1) / (times[-1] - times[0]) if n > 1 and len(times) > 1 and times[-1] > times[0]
            else None, "wall_s": r["wall_s"]}


def median(values) -> float | None:
    v = [x for x in values if x is not None]
    return round(statistics.median(v), 2) if v else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="ar,caddtree-online", help="comma-separated; the server's default first "
                   "is not required")
    p.add_argument("--repeats", type=int, default=5, help="rounds: each decodes once offline and once served")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--compute", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--drafter", default=None)
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    a = p.parse_args(argv)
    methods = [m for m in a.methods.split(",") if m]

    from drafttree.load import load_target
    from drafttree.methods import Decoder

    target = load_target(a.model, compute=a.compute, threads=a.threads)
    decoder = Decoder(target, drafter=a.drafter, budget=a.budget)
    for m in methods:  # one-off first-call costs, as the server's warm-up
        offline_once(decoder, target, m, "Hi", 4)
    log = Path(tempfile.mkdtemp(prefix="serve_one_")) / "server.log"
    server_args = argparse.Namespace(model=a.model, compute=a.compute, method=methods[0], budget=a.budget,
                                     max_concurrency=8, clients=1, threads=a.threads, drafter=a.drafter)
    proc, base = start_server(server_args, log)
    rows: dict[str, dict[str, list]] = {m: {"offline": [], "served": []} for m in methods}
    mismatches = 0
    load_at_start = round(os.getloadavg()[0], 2)
    try:
        wait_healthy(base, proc, log)
        for m in methods:  # the server's first request of each method (not timed)
            served_once(base, a.model, m, a.prompt, a.max_tokens)
        for i in range(a.repeats):
            for m in methods:
                off = offline_once(decoder, target, m, a.prompt, a.max_tokens)
                srv = served_once(base, a.model, m, a.prompt, a.max_tokens)
                mismatches += srv["text"] != off["text"]
                rows[m]["offline"].append(off)
                rows[m]["served"].append(srv)
                print(f"round {i} {m}: offline {off['stats_tok_s']:.1f} tok/s (rate {off['rate_tok_s'] or 0:.1f}, "
                      f"wall {off['wall_s']:.3f} s) | served {srv['stats_tok_s']} tok/s (rate "
                      f"{srv['rate_tok_s'] or 0:.1f}, wall {srv['wall_s']:.3f} s)"
                      f"{'' if srv['text'] == off['text'] else ' MISMATCH'}", file=sys.stderr)
    finally:
        proc.send_signal(2)
        try:
            proc.wait(60)
        except Exception:
            proc.kill()
    summary = {}
    for m in methods:
        o, s = rows[m]["offline"], rows[m]["served"]
        med = {f"{side}_{k}": median(r[k] for r in runs) for side, runs in (("offline", o), ("served", s))
               for k in ("stats_tok_s", "rate_tok_s", "wall_s")}
        med["tokens"] = o[0]["tokens"]
        for k in ("stats_tok_s", "rate_tok_s"):
            if med[f"offline_{k}"] and med[f"served_{k}"]:
                med[f"ratio_{k}"] = round(med[f"served_{k}"] / med[f"offline_{k}"], 3)
        summary[m] = med
    mach = machine()
    mach["load_average_1min_at_start"] = load_at_start
    report = {"machine": mach, "compute": target.compute_label, "threads": a.threads or os.cpu_count(),
              "max_tokens": a.max_tokens, "repeats": a.repeats, "prompt": a.prompt, "mismatches": mismatches,
              "summary": summary}
    print(f"{mach['cpu']}, ISA {mach['isa']}, {report['threads']} threads, {report['compute']}, "
          f"max_tokens {a.max_tokens}, {a.repeats} rounds, load {load_at_start}; mismatches {mismatches}")
    print("| method | tokens | offline tok/s | served tok/s | ratio | offline rate | served rate | ratio | "
          "offline wall s | served wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m, s in summary.items():
        print(f"| {m} | {s['tokens']} | {s['offline_stats_tok_s']} | {s['served_stats_tok_s']} | "
              f"{s.get('ratio_stats_tok_s')} | {s['offline_rate_tok_s']} | {s['served_rate_tok_s']} | "
              f"{s.get('ratio_rate_tok_s')} | {s['offline_wall_s']} | {s['served_wall_s']} |")
    if a.out:
        a.out.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
