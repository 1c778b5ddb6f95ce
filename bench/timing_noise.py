"""How repeatable is one speculative generation's wall time, per thread count?

    .venv/bin/python bench/timing_noise.py [--threads 1,2] [--repeats 8] [--method ddtree --budget 8]

The same prompt and method (same tokens every time: greedy) decode `--repeats` times per thread
count, the thread counts interleaved so drift hits all alike. Prints tokens/s and the coefficient of
variation of the decode time (first repeat of each dropped as warm-up). A policy comparison in
`drafttree bench` can only resolve differences well above this noise.
"""
from __future__ import annotations

import argparse
import statistics

import torch
from tqdm import tqdm

from drafttree.datasets import load_prompts
from drafttree.engine import generate_speculative
from drafttree.load import load_target
from drafttree.methods import load_drafter_for, make_proposer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--method", default="ddtree")
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--prompt-index", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    counts = [int(t) for t in a.threads.split(",")]
    target = load_target("smollm2-135m-instruct", dtype=a.dtype)
    drafter = load_drafter_for(target)
    ids = target.encode_chat(load_prompts(a.dataset, a.prompt_index + 1)[a.prompt_index])
    times: dict[int, list[float]] = {t: [] for t in counts}
    tokens = None
    for _ in tqdm(range(a.repeats), desc="repeats"):
        for t in counts:
            torch.set_num_threads(t)
            res = generate_speculative(target, ids, make_proposer(a.method, target, drafter, budget=a.budget), 256)
            assert tokens is None or res.tokens == tokens, "greedy output changed between repeats"
            tokens = res.tokens
            times[t].append(res.stats.total_s)
    print(f"{a.method} (budget {a.budget}), {a.dtype}, {a.dataset}[{a.prompt_index}], {len(tokens)} tokens, "
          f"{a.repeats} repeats (first dropped)\n")
    print("| threads | tok/s (mean) | decode s min / max | CV of decode time |\n|---:|---:|---:|---:|")
    for t, ts in times.items():
        ts = ts[1:]
        mean = statistics.mean(ts)
        print(f"| {t} | {len(tokens) / mean:.1f} | {min(ts):.2f} / {max(ts):.2f} | {statistics.pstdev(ts) / mean:.1%} |")


if __name__ == "__main__":
    main()
