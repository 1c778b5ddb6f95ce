"""Two decoding set-ups of one revision at the finest grain: each prompt's two Sequences are stepped alternately in
one process, so the machine's drift hits both alike (on the 2026-12-07 Emerald Rapids VM, AR ran at 187-265 tok/s
within an hour, and revision_ab's per-prompt alternation left 5-8 % between two revisions' identical AR code). Prints
the ISA, tok/s, τ and per-round draft / tree / verify ms of each side and B's ratio to A; greedy outputs must match.

  .venv/bin/python bench/lockstep_ab.py --a ar --b caddtree-online --limit 3
  .venv/bin/python bench/lockstep_ab.py --a caddtree --b caddtree --a-prefetch 0  # A: the weight prefetch off
  .venv/bin/python bench/lockstep_ab.py --a ar --b ar --a-huge-pages 0  # A: weights on torch's own 4 KB pages
"""
import argparse
import json
import os
import time

from tqdm import tqdm

from drafttree.compute import cpu_info
from drafttree.datasets import load_prompts
from drafttree.engine import Sequence
from drafttree.load import load_target
from drafttree.methods import load_drafter_for, make_proposer
from drafttree.ops.cpu_extension import extension


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default="ar", help="method of side A (ar, or a speculative method)")
    ap.add_argument("--b", default="caddtree-online", help="method of side B")
    ap.add_argument("--a-prefetch", type=int, default=None, help="the weight kernels' prefetch bytes in A (default: "
                                                                 "the kernels' own)")
    ap.add_argument("--b-prefetch", type=int, default=None, help="likewise in B")
    ap.add_argument("--a-huge-pages", type=int, choices=(0, 1), default=1, help="0: A's weights where torch allocated "
                    "them (4 KB pages), not in the 2 MB-page arena (model/arena.py); a second copy of the models")
    ap.add_argument("--b-huge-pages", type=int, choices=(0, 1), default=1, help="likewise in B")
    ap.add_argument("--budget", type=int, default=4, help="ddtree / lookup budget")
    ap.add_argument("--datasets", default="gsm8k,humaneval,mtbench")
    ap.add_argument("--limit", type=int, default=3, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    models = {}  # huge pages (0/1) -> (target, drafter)
    for huge in dict.fromkeys((a.a_huge_pages, a.b_huge_pages)):
        os.environ["DRAFTTREE_HUGE_PAGES"] = str(huge)
        target = load_target("smollm2-135m-instruct", compute="auto", threads=a.threads)
        models[huge] = target, None if {a.a, a.b} == {"ar"} else load_drafter_for(target)
    kernels = extension()
    default_prefetch = kernels.weight_prefetch(-1)
    sides = {}
    for side, method, prefetch, huge in (("A", a.a, a.a_prefetch, a.a_huge_pages),
                                         ("B", a.b, a.b_prefetch, a.b_huge_pages)):
        target, drafter = models[huge]
        proposer = None if method == "ar" else make_proposer(method, target, drafter, budget=a.budget)
        sides[side] = {"method": method, "proposer": proposer, "target": target, "huge_pages": huge,
                       "prefetch": default_prefetch if prefetch is None else prefetch,
                       "s": 0.0, "tokens": 0, "rounds": 0, "draft_s": 0.0, "tree_s": 0.0, "verify_s": 0.0}
    prompts = [p for name in a.datasets.split(",") for p in load_prompts(name, a.limit)]
    try:
        for prompt in tqdm(prompts, desc="prompts"):
            ids = target.encode_chat(prompt)
            seqs = {k: Sequence(v["target"], ids, v["proposer"], a.max_new_tokens) for k, v in sides.items()}
            while not all(seq.done for seq in seqs.values()):
                for k, seq in seqs.items():  # one step of each in turn
                    if seq.done:
                        continue
                    kernels.weight_prefetch(sides[k]["prefetch"])
                    is_round = seq.root is not None  # the first step is the prefill: not timed, not a round
                    t0 = time.perf_counter()
                    seq.step()
                    if is_round:
                        sides[k]["s"] += time.perf_counter() - t0
                        sides[k]["rounds"] += 1
            if seqs["A"].tokens != seqs["B"].tokens:
                raise SystemExit(f"outputs differ on {prompt[:60]!r}: A and B must decode the same greedy tokens")
            for k, seq in seqs.items():
                st = sides[k]
                st["tokens"] += len(seq.tokens) - 1  # the prefill's token is not a round's
                for part in ("draft_s", "tree_s", "verify_s"):
                    st[part] += getattr(seq.stats, part)
    finally:
        kernels.weight_prefetch(default_prefetch)
    cpu = cpu_info()
    print(f"CPU: {cpu.model}; ISA: {cpu.isa_summary}; {target.compute_label}; {len(prompts)} prompts x "
          f"{a.max_new_tokens} tokens, sides stepped alternately")
    rows = {}
    for k, st in sides.items():
        rounds = max(1, st["rounds"])
        rows[k] = {"method": st["method"], "prefetch": st["prefetch"], "huge_pages": st["huge_pages"],
                   "tok_s": st["tokens"] / st["s"],
                   "tau": st["tokens"] / rounds, **{p: st[p] / rounds * 1e3 for p in ("draft_s", "tree_s", "verify_s")}}
        r = rows[k]
        print(f"{k}: {r['method']:24s} prefetch {r['prefetch']:5d}  huge pages {r['huge_pages']}  "
              f"{r['tok_s']:7.1f} tok/s  τ {r['tau']:.2f}  "
              f"draft {r['draft_s']:.2f} / tree {r['tree_s']:.2f} / verify {r['verify_s']:.2f} ms a round")
    print(f"B / A: {rows['B']['tok_s'] / rows['A']['tok_s']:.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"cpu": cpu.model, "isa": cpu.isa_summary, "compute": target.compute_label, "sides": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
