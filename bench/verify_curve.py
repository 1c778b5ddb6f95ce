"""What a verify of n tokens costs against one token, on a real target's compute path: the whole verify (a
chain of n tokens on top of a prefilled context, logits for every row) and the LM head alone for n rows,
medians of interleaved repeats; prints the CPU's ISA beside the figures. With --batch, also n requests' one-token
rows in one batched forward (TargetModel.verify_many, a serving turn of batched AR), each on its own context of the
same length: whether a turn's rows cost what a tree's rows do (the batch policy prices them by the tree curve).

With --prefetch 0,4096 the weight kernels' software prefetch distances (bytes; kernels.h) are interleaved too: the
curve without and with it in one run.

  .venv/bin/python bench/verify_curve.py --threads 2 [--context 200] [--tokens 1,2,3,4,8,16] [--batch] \
      [--prefetch 0,4096] [--out curve.json]
"""
import argparse
import itertools
import json
import statistics
import time

import torch

from drafttree.compute import cpu_info
from drafttree.load import load_target
from drafttree.model.verify_input import VerifyInput
from drafttree.tree import random_tree


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--compute", default="q4")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--tokens", default="1,2,3,4,8,16")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--batch", action="store_true", help="also n requests' one-token rows in one batched forward")
    p.add_argument("--prefetch", default=None, help="comma list of weight prefetch distances in bytes to interleave "
                                                     "(default: the kernels' own)")
    p.add_argument("--out")
    a = p.parse_args()
    from drafttree.ops.cpu_extension import extension

    kernels = extension()
    default_prefetch = kernels.weight_prefetch(-1)
    prefetches = [default_prefetch] if a.prefetch is None else [int(x) for x in a.prefetch.split(",")]
    torch.set_num_threads(a.threads)
    target = load_target(a.model, threads=a.threads, compute=a.compute)
    model, counts = target.model, [int(n) for n in a.tokens.split(",")]
    vocab, gen = model.config.vocab_size, torch.Generator().manual_seed(0)
    state = model.new_state(a.context + max(counts) + 1)
    kinds = ("verify_ms", "head_ms", "batch_ms") if a.batch else ("verify_ms", "head_ms")
    times: dict[tuple[int, int], dict[str, list[float]]] = {(pf, n): {k: [] for k in kinds}
                                                            for pf in prefetches for n in counts}
    with torch.no_grad():
        model.prefill(state, torch.randint(0, vocab, (a.context,), generator=gen))
        others = [model.new_state(a.context + 2) for _ in range(max(counts) if a.batch else 0)]
        for s in others:  # each request of a batched turn on its own context
            model.prefill(s, torch.randint(0, vocab, (a.context,), generator=gen))
        for rep, pf, n in itertools.product(range(a.repeats + 1), prefetches, counts):  # the first pass warms up
            # interleaved: a load change hits every size and distance alike
            kernels.weight_prefetch(pf)
            batch = VerifyInput.of_tree(random_tree(n - 1, vocab, "chain", gen), a.context)
            t0 = time.perf_counter()
            model.verify(state, batch)  # never committed: every repeat verifies on the same context
            t1 = time.perf_counter()
            model.row_logits(torch.randn(n, model.config.hidden_size, generator=gen))
            t2 = time.perf_counter()
            if a.batch:
                one = [VerifyInput.of_tree(random_tree(0, vocab, "chain", gen), a.context) for _ in range(n)]
                t3 = time.perf_counter()
                model.verify_many(others[:n], one, [()] * n)
                if rep:
                    times[pf, n]["batch_ms"].append((time.perf_counter() - t3) * 1e3)
            if rep:
                times[pf, n]["verify_ms"].append((t1 - t0) * 1e3)
                times[pf, n]["head_ms"].append((t2 - t1) * 1e3)
    kernels.weight_prefetch(default_prefetch)
    med = {key: {k: statistics.median(v) for k, v in t.items()} for key, t in times.items()}
    print(f"{cpu_info().model}; {cpu_info().isa_summary}; {target.compute_label}; {a.threads} threads; "
          f"context {a.context}")
    extra = " batched turn of n requests ms | turn ÷ tree |" if a.batch else ""
    rule = "|---:|---:|---:|---:|" + ("---:|---:|" if a.batch else "")
    print(f"| prefetch bytes | tokens | verify ms | × first | LM head ms |{extra}\n|---{rule}")
    for pf in prefetches:
        one = med[pf, counts[0]]["verify_ms"]
        for n in counts:
            m = med[pf, n]
            row = f"| {pf} | {n} | {m['verify_ms']:.2f} | {m['verify_ms'] / one:.2f}× | {m['head_ms']:.2f} |"
            if a.batch:
                row += f" {m['batch_ms']:.2f} | {m['batch_ms'] / m['verify_ms']:.2f} |"
            print(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"cpu": cpu_info().model, "isa": cpu_info().isa_summary, "compute": target.compute_label,
                       "threads": a.threads, "context": a.context,
                       "medians": {f"prefetch {pf}": {n: med[pf, n] for n in counts} for pf in prefetches}}, f,
                      indent=1)


if __name__ == "__main__":
    main()
