"""One batched decode step of N requests (`verify_many`, one row each, as the server's batched AR and
`train data --engine drafttree` run it): attention through one `rope_tree_attention_batched` call a layer
against one `rope_tree_attention` call per request and layer (the path before it), interleaved in one run, same
states; checks that both give the same logits. Prints the CPU's ISA.

  .venv/bin/python bench/batched_attention_ab.py --requests 16,32,64 --context 300
"""
import argparse
import statistics
import time

import torch

from drafttree.compute import cpu_info
from drafttree.load import load_target
from drafttree.model.transformer import Attention
from drafttree.model.verify_input import VerifyInput
from drafttree.ops.attention import rope_tree_attention


def per_request(self, x, cos, sin, segments, layer):
    """Attention.forward_segments as it was: one C++ call per request and layer."""
    qkv = self.qkv(x)
    return self.o(torch.cat([rope_tree_attention(qkv[a:b], cos[a:b], sin[a:b], cache.k[layer], cache.v[layer],
                                                 mask.past, mask.tree, self.n_heads, self.n_kv, mask.kernel_isa,
                                                 self.q_norm, self.k_norm) for a, b, mask, cache in segments]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--compute", default="auto")
    ap.add_argument("--requests", default="16,32,64")
    ap.add_argument("--context", type=int, default=300, help="tokens already in each request's cache")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    cpu = cpu_info()
    target = load_target(a.model, compute=a.compute)
    model = target.model
    batched = Attention.forward_segments
    print(f"CPU: {cpu.model}; ISA: {cpu.isa_summary}; torch threads {torch.get_num_threads()}; {target.compute_label}; "
          f"context {a.context}; medians of {a.repeats} steps")
    print("| requests | one call per request (ms) | one batched call (ms) | ratio | tokens/s batched |\n"
          "|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in a.requests.split(",")):
        gen = torch.Generator().manual_seed(n)
        states = []
        for _ in range(n):
            st = model.new_state(a.context + 2 * a.repeats + 4)
            model.prefill(st, torch.randint(100, 40000, (a.context,), generator=gen))
            states.append(st)
        times = {"per_request": [], "batched": []}
        for _ in range(a.repeats):
            logits = {}
            for name, fn in (("per_request", per_request), ("batched", batched)):
                Attention.forward_segments = fn
                batches = [VerifyInput(torch.tensor([7]), torch.tensor([st.length]), torch.tensor([-1]),
                                       torch.ones(1, 1, dtype=torch.bool)) for st in states]
                t0 = time.perf_counter()
                outs = model.verify_many(states, batches, [()] * n)
                times[name].append(time.perf_counter() - t0)
                logits[name] = torch.stack([o.logits[-1] for o in outs])
                for st in states:  # nothing committed: the next call writes the same cache rows
                    st.kv.pending = 0
            assert torch.equal(logits["per_request"], logits["batched"]), "the two paths differ"
        Attention.forward_segments = batched
        old, new = (statistics.median(times[k]) * 1e3 for k in ("per_request", "batched"))
        print(f"| {n} | {old:.1f} | {new:.1f} | {old / new:.2f}x | {n / new * 1e3:.0f} |")


if __name__ == "__main__":
    main()
