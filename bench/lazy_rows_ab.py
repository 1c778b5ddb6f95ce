"""Dense vs lazy draft rows (drafttree.marginals), and lazy rows with the drafter's block trimmed to the depths
the policy can place (DFlashProposer.trim_block), side by side in one run: the same methods decoding the same
prompts, interleaved per prompt. Prints the CPU's ISA, tok/s, τ, draft + tree ms per drafted round (the head
runs inside the tree build when lazy) and checks that every variant produces the same tokens.

  .venv/bin/python bench/lazy_rows_ab.py --methods caddtree,ddtree --limit 2 --threads 2
"""
import argparse
import json

import torch
from tqdm import tqdm

from drafttree.compute import cpu_info
from drafttree.datasets import load_prompts
from drafttree.load import load_target
from drafttree.methods import generate, load_drafter_for, make_proposer


def apply_variant(proposer, variant: str) -> None:
    """Set a DFlashProposer's draft rows from a variant name: `dense` (every head row at once, the whole block) or
    `lazy` with optional `+trim` (the block stops at the policy's depth cap), `+follow` (trimmed, and one depth past
    the last tree's: DFlashProposer.follow), `+chunkN` (N head rows first) and `+depthN` (the depth cap lowered to N)."""
    kind, *options = variant.split("+")
    if kind not in ("dense", "lazy") or (kind == "dense" and options):
        raise SystemExit(f"unknown variant {variant!r}: dense, or lazy[+trim][+follow][+chunkN][+depthN]")
    proposer.lazy_rows, proposer.trim_block = kind == "lazy", "trim" in options or "follow" in options
    proposer.follow_depth = "follow" in options
    for option in options:
        if option.startswith("chunk"):
            proposer.first_chunk = int(option.removeprefix("chunk"))
        elif option.startswith("depth"):
            proposer.draft_depth = min(proposer.draft_depth, int(option.removeprefix("depth")))
        elif option not in ("trim", "follow"):
            raise SystemExit(f"unknown option {option!r} in variant {variant!r}: trim, follow, chunkN or depthN")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--methods", default="caddtree,ddtree")
    ap.add_argument("--datasets", default="gsm8k,humaneval,mtbench")
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--variants", default="dense,lazy", help="of dense, lazy, lazy+trim, lazy+follow, lazy+chunkN, lazy+trim+chunkN+depthN (the first is the baseline)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cpu = cpu_info()
    target = load_target(a.model, compute="auto", threads=a.threads)
    print(f"CPU: {cpu.model} ({cpu.arch}); ISA: {cpu.isa_summary}; torch threads {torch.get_num_threads()}; "
          f"target on {target.compute_label}")
    drafter = load_drafter_for(target)
    cases, variants = {}, a.variants.split(",")
    for m in a.methods.split(","):
        for rows in variants:
            p = make_proposer(m, target, drafter)
            apply_variant(getattr(p, "dflash", p), rows)
            generate(m, target, target.encode_chat("Hello!"), 8, proposer=p)  # warm-up: one-off costs
            cases[(m, rows)] = p
    totals = {k: {"tokens": 0, "s": 0.0, "draft_tree_s": 0.0, "drafted": 0, "rounds": 0} for k in cases}
    prompts = [p for ds in a.datasets.split(",") for p in load_prompts(ds, a.limit)]
    for prompt in tqdm(prompts, desc="prompts"):
        ids, first = target.encode_chat(prompt), None
        for (m, rows), p in cases.items():
            st = generate(m, target, ids, a.max_new_tokens, proposer=p)
            if first is None:
                first = st.tokens
            if st.tokens != first:
                raise SystemExit(f"{m} ({rows}) produced different tokens: a bug")
            t = totals[(m, rows)]
            t["tokens"] += st.stats.new_tokens
            t["s"] += st.stats.total_s
            t["draft_tree_s"] += st.stats.draft_s + st.stats.tree_s
            t["drafted"] += st.stats.drafted_rounds
            t["rounds"] += len(st.stats.accept_lengths)
    print(f"| method | head rows | tok/s | τ | draft + tree ms per drafted round | vs {variants[0]} |")
    print("|---|---|---:|---:|---:|---:|")
    for (m, rows), t in totals.items():
        per_round = t["draft_tree_s"] * 1e3 / max(t["drafted"], 1)
        dense = totals[(m, variants[0])]
        base = dense["draft_tree_s"] * 1e3 / max(dense["drafted"], 1)
        t.update(tokens_per_s=t["tokens"] / t["s"], draft_tree_ms_per_drafted_round=per_round,
                 tau=t["tokens"] / max(t["rounds"], 1))
        print(f"| {m} | {rows} | {t['tokens_per_s']:.1f} | {t['tau']:.2f} | {per_round:.2f} | {per_round / base:.2f}x |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"cpu": cpu.model, "isa": cpu.isa_summary, "threads": torch.get_num_threads(),
                       "totals": {f"{m}|{r}": t for (m, r), t in totals.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
