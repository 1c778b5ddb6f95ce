"""Weaver tree build time, width w = 8 against the sequential w = 1, on real rounds, and τ of both.

Decodes a few GSM8K / HumanEval / MT-Bench prompts greedily with weaver-ddtree (the trees verified are the
width-`--width` look-ahead ones); at every round the same drafter output is also built at width 1, with the
paper's pop-w steps at width w ("pop"), and by the DDTree heap over the marginals, each timed (median of 3).
Reports median build ms per round for full-size trees, the number of Weaver calls, and τ of each from
separate greedy decodes (exact: greedy τ depends on the trees only).

  .venv/bin/python bench/weaver_build_time.py --threads 1 --limit 2 --out docs/weaver/build_time.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from drafttree.atomic import atomic_write_text
from drafttree.compute import cpu_info
from drafttree.datasets import load_prompts
from drafttree.engine import generate_speculative
from drafttree.load import load_target
from drafttree.methods import load_drafter_for, load_weaver_for
from drafttree.proposers import BestFirstPolicy
from drafttree.tree import best_first_nodes
from drafttree.weaver import WeaverProposer
from drafttree.weaver.tree import WeaverStream


class TimedBuilds(WeaverProposer):
    """weaver-ddtree whose every round also times the other widths' builds on the same drafter output."""

    def __init__(self, *args, widths=(1, 8), repeats=3, **kw):
        super().__init__(*args, **kw)
        self.widths, self.repeats = widths, repeats
        self.ms = {w: [] for w in widths}
        self.calls = {w: [] for w in widths}
        self.ddtree_ms = []

    def build_tree(self, state, root, drafted, start):
        for w in self.widths:
            times = []
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                stream = self.stream(root, drafted)
                if w == "pop":  # the paper's steps: pop `width` entries, then one call for them
                    stream = WeaverStream(stream.weaver, stream.inputs, stream.root, stream.max_nodes, self.width)
                else:
                    stream.width = w
                n = sum(1 for _ in stream)
                times.append((time.perf_counter() - t0) * 1e3)
            if n == self.max_nodes:  # full-size trees only (the end of a reply cuts them)
                self.ms[w].append(statistics.median(times))
                self.calls[w].append(stream.calls)
        times = []
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            list(best_first_nodes(drafted.logits.float().log_softmax(-1), self.max_nodes, drafted.token_ids))
            times.append((time.perf_counter() - t0) * 1e3)
        self.ddtree_ms.append(statistics.median(times))
        return super().build_tree(state, root, drafted, start)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--limit", type=int, default=2, help="prompts per set")
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--weaver", default=None)
    ap.add_argument("--out", default="docs/weaver/build_time.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    target = load_target("smollm2-135m-instruct", compute="auto", threads=a.threads)
    drafter = load_drafter_for(target)
    weaver = load_weaver_for(target, drafter, a.weaver)
    timed = TimedBuilds(drafter, target.model, weaver, BestFirstPolicy(a.nodes), a.width, widths=(1, a.width, "pop"))
    taus = {1: [], a.width: [], "pop": []}
    for ds in ("gsm8k", "humaneval", "mtbench"):
        for text in load_prompts(ds, a.limit):
            ids = target.encode_chat(text)
            generate_speculative(target, ids, timed, a.max_new_tokens)
            for w in taus:
                proposer = (WeaverProposer(drafter, target.model, weaver, BestFirstPolicy(a.nodes), a.width, lookahead=False)
                            if w == "pop" else WeaverProposer(drafter, target.model, weaver, BestFirstPolicy(a.nodes), w))
                res = generate_speculative(target, ids, proposer, a.max_new_tokens)
                taus[w].append(res.stats.tau)
    w = a.width
    out = dict(nodes=a.nodes, width=w, rounds=len(timed.ms[1]), threads=a.threads, compute=target.compute_label,
               cpu=cpu_info().model, isa=cpu_info().isa_summary, machine=platform.machine(),
               build_ms_median={str(k): statistics.median(v) for k, v in timed.ms.items()},
               weaver_calls_median={str(k): statistics.median(v) for k, v in timed.calls.items()},
               ddtree_heap_ms_median=statistics.median(timed.ddtree_ms),
               ratio=statistics.median(timed.ms[w]) / statistics.median(timed.ms[1]),
               tau_mean={str(k): statistics.mean(v) for k, v in taus.items()},
               tau_ratio=statistics.mean(taus[w]) / statistics.mean(taus[1]), prompts=len(taus[1]))
    atomic_write_text(a.out, json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
