"""Draft cost per round, split into drafter layers / head / tree build, for several drafters on the same
target and compute path, each with the head rows computed for every depth at once (dense) and as the tree
reaches them (lazy, the default: drafttree.marginals), and lazily with the block trimmed to the depths the policy
can place ("lazy+trim": DFlashProposer(trim_block=True)), measured interleaved in one run (so load changes hit
all of them alike); prints the CPU's ISA and each round's ratio to the first drafter's dense round.

  .venv/bin/python bench/draft_cost.py --drafters DIR_A,DIR_B --threads 1 [--out results.json]
"""
import argparse
import json
import statistics
import time

import torch

from drafttree.compute import cpu_info
from drafttree.engine import Sequence
from drafttree.load import load_target
from drafttree.methods import load_drafter_for, make_proposer
from lazy_rows_ab import apply_variant

VARIANTS = ("dense", "lazy", "lazy+trim")
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and two tests."


def round_parts(target, proposer, steps: int = 4) -> dict:
    """One request a few rounds in; returns callables for each part of its next draft round (the round
    itself with the proposer's own `lazy_rows`)."""
    seq = Sequence(target, target.encode_chat(PROMPT), proposer, 64)
    for _ in range(steps):
        seq.step()
    state, root, start = seq.draft_state, seq.root, len(seq.prompt) + len(seq.tokens) - 1
    d = proposer.drafter
    block = proposer.block_embeds(root)
    hidden = d.draft(state.context, block, start)[1:1 + proposer.draft_depth]
    scores = d.draft_scores(hidden, proposer.lm_head)
    return {
        "drafter layers": lambda: d.draft(state.context, block, start),
        "to the last attention": lambda: d.draft_rows(state.context, block, start),
        "head": lambda: d.draft_scores(hidden, proposer.lm_head),
        "tree": lambda: proposer.build_tree(state, root, scores, start),
        "round (draft + tree)": lambda: proposer.build_tree(state, root, proposer.draft(state, root, start), start),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--compute", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--drafters", required=True, help="comma list of drafter directories (the first is the baseline)")
    ap.add_argument("--methods", default="chain,ddtree,caddtree")
    ap.add_argument("--repeats", type=int, default=200, help="calls per part (interleaved across drafters)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cpu = cpu_info()
    target = load_target(a.model, compute=a.compute, threads=a.threads)
    print(f"CPU: {cpu.model} ({cpu.arch}); ISA: {cpu.isa_summary}; torch threads {torch.get_num_threads()}; "
          f"target {a.model} on {target.compute_label}")
    dirs, methods = a.drafters.split(","), a.methods.split(",")
    cases = {}
    for path in dirs:
        drafter = load_drafter_for(target, path)
        for m in methods:
            for rows in VARIANTS:
                proposer = make_proposer(m, target, drafter, budget=16)
                apply_variant(proposer, rows)
                cases[(path, m, rows)] = round_parts(target, proposer)
    times = {key: {part: [] for part in parts} for key, parts in cases.items()}
    for _ in range(a.repeats):  # interleaved: every case sees the same machine state
        for key, parts in cases.items():
            for part, call in parts.items():
                t0 = time.perf_counter()
                call()
                times[key][part].append((time.perf_counter() - t0) * 1e3)
    rows = {"|".join(key): {part: statistics.median(v) for part, v in t.items()} for key, t in times.items()}
    parts = list(next(iter(rows.values())))
    print("| drafter | method | head rows | " + " | ".join(f"{p} ms" for p in parts) + " | round vs first dense |")
    print("|---|---|---|" + "---:|" * (len(parts) + 1))
    for m in methods:
        base = rows[f"{dirs[0]}|{m}|dense"]["round (draft + tree)"]
        for p in dirs:
            for kind in VARIANTS:
                r = rows[f"{p}|{m}|{kind}"]
                print(f"| {p} | {m} | {kind} | " + " | ".join(f"{r[x]:.2f}" for x in parts)
                      + f" | {r['round (draft + tree)'] / base:.2f}x |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"cpu": cpu.model, "isa": cpu.isa_summary, "compute": target.compute_label,
                       "threads": torch.get_num_threads(), "median_ms": rows}, f, indent=1)


if __name__ == "__main__":
    main()
