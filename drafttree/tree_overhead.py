"""Per-round CPU overhead of building a DDTree: `python -m drafttree.tree_overhead`.

Splits the cost into the best-first search (top-k + heap), DraftTree construction (tensors,
validation, child maps) and the ancestor mask, for synthetic drafter marginals.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from .tree import DraftTree, best_first_nodes


def synthetic_marginals(depth: int, vocab: int, kind: str, seed: int = 0) -> torch.Tensor:
    """Log-probs [depth, vocab]. "peaked": one favourite per depth whose lead shrinks with depth
    (roughly what a block drafter gives); "flat": noisy, uncertain rows (worst case for the heap)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=g) * (1.5 if kind == "peaked" else 3.0)
    if kind == "peaked":
        fav = torch.randint(0, vocab, (depth,), generator=g)
        logits[torch.arange(depth), fav] += 16.0 - 0.5 * torch.arange(depth)
    elif kind != "flat":
        raise ValueError(f"kind must be 'peaked' or 'flat', got {kind!r}")
    return logits.log_softmax(-1)


def measure_tree_build_overhead(budgets=(4, 8, 16, 32, 64, 128, 256), depth: int = 15, vocab: int = 49152,
                                kind: str = "peaked", repeats: int = 30) -> list[dict]:
    """Median µs per stage and in total for each budget (one dict per budget)."""
    marg = synthetic_marginals(depth, vocab, kind)
    rows = []
    for budget in budgets:
        search, build, mask, total = [], [], [], []
        for i in range(repeats + 3):
            t0 = time.perf_counter()
            nodes = list(best_first_nodes(marg, budget))
            t1 = time.perf_counter()
            tree = DraftTree.from_nodes(0, nodes)
            t2 = time.perf_counter()
            tree.ancestor_mask
            t3 = time.perf_counter()
            if i >= 3:  # warm-up rounds dropped
                search.append(t1 - t0), build.append(t2 - t1), mask.append(t3 - t2), total.append(t3 - t0)
        us = lambda xs: statistics.median(xs) * 1e6
        rows.append({"budget": budget, "search_us": us(search), "build_us": us(build), "mask_us": us(mask),
                     "total_us": us(total), "max_depth": int(tree.depths.max())})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--kind", choices=["peaked", "flat"], default="peaked")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"D={args.depth} V={args.vocab} marginals={args.kind} threads={torch.get_num_threads()}")
    print(f"{'budget':>6} {'search':>9} {'build':>9} {'mask':>9} {'total µs':>9} {'depth':>5}")
    for r in measure_tree_build_overhead(args.budgets, args.depth, args.vocab, args.kind, args.repeats):
        print(f"{r['budget']:>6} {r['search_us']:>9.0f} {r['build_us']:>9.0f} {r['mask_us']:>9.0f} "
              f"{r['total_us']:>9.0f} {r['max_depth']:>5}")


if __name__ == "__main__":
    main()
