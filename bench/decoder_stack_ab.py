"""The decoder stack as one C++ call (ops/decoder) against the Python layer loop, interleaved call by call in
one process (medians of 20 verify forwards after a 128-token prefill). Prints the CPU's ISA.

  .venv/bin/python bench/decoder_stack_ab.py THREADS
"""
import statistics
import sys
import time

import torch

from drafttree.compute import cpu_info
from drafttree.load import load_target
from drafttree.model.verify_input import VerifyInput
from drafttree.tree import random_tree
th = int(sys.argv[1])
target = load_target("smollm2-135m-instruct", compute="auto", threads=th)
model = target.model
stack = model.decoder_stack
print(f"CPU: {cpu_info().model}; ISA: {cpu_info().isa_summary}; {target.compute_label}")
ctx = 128
state = model.new_state(ctx + 64)
model.prefill(state, torch.randint(0, 49152, (ctx,)))
for T in (1, 4, 16):
    batch = VerifyInput.of_tree(random_tree(T - 1, 49152, "random" if T > 1 else "chain", torch.Generator().manual_seed(0)), ctx)
    res = {"loop": [], "stack": []}
    for r in range(20):
        for name in ("loop", "stack"):
            model.decoder_stack = stack if name == "stack" else None
            t0 = time.perf_counter(); model.verify(state, batch); res[name].append(time.perf_counter() - t0)
    m = {k: statistics.median(v) * 1e3 for k, v in res.items()}
    print(f"T={T} threads={th}: loop {m['loop']:.2f} ms, stack {m['stack']:.2f} ms, loop/stack {m['loop']/m['stack']:.2f}x")
