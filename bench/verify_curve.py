"""What a verify of n tokens costs against one token, on a real target's compute path: the whole verify (a
chain of n tokens on top of a prefilled context, logits for every row) and the LM head alone for n rows,
medians of interleaved repeats; prints the CPU's ISA beside the figures.

  .venv/bin/python bench/verify_curve.py --threads 2 [--context 200] [--tokens 1,2,3,4,8,16] [--out curve.json]
"""
import argparse
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
    p.add_argument("--out")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    target = load_target(a.model, threads=a.threads, compute=a.compute)
    model, counts = target.model, [int(n) for n in a.tokens.split(",")]
    vocab, gen = model.config.vocab_size, torch.Generator().manual_seed(0)
    state = model.new_state(a.context + max(counts) + 1)
    times: dict[int, dict[str, list[float]]] = {n: {"verify_ms": [], "head_ms": []} for n in counts}
    with torch.no_grad():
        model.prefill(state, torch.randint(0, vocab, (a.context,), generator=gen))
        for rep in range(a.repeats + 1):  # the first pass warms up
            for n in counts:  # interleaved: a load change hits every size alike
                batch = VerifyInput.of_tree(random_tree(n - 1, vocab, "chain", gen), a.context)
                t0 = time.perf_counter()
                model.verify(state, batch)  # never committed: every repeat verifies on the same context
                t1 = time.perf_counter()
                model.row_logits(torch.randn(n, model.config.hidden_size, generator=gen))
                t2 = time.perf_counter()
                if rep:
                    times[n]["verify_ms"].append((t1 - t0) * 1e3)
                    times[n]["head_ms"].append((t2 - t1) * 1e3)
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    one = med[counts[0]]["verify_ms"]
    print(f"{cpu_info().model}; {target.compute_label}; {a.threads} threads; context {a.context}")
    print("| tokens | verify ms | × first | LM head ms |\n|---:|---:|---:|---:|")
    for n in counts:
        print(f"| {n} | {med[n]['verify_ms']:.2f} | {med[n]['verify_ms'] / one:.2f}× | {med[n]['head_ms']:.2f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"cpu": cpu_info().model, "isa": cpu_info().isa_summary, "compute": target.compute_label,
                       "threads": a.threads, "context": a.context, "medians": med}, f, indent=1)


if __name__ == "__main__":
    main()
