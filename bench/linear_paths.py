"""The whole model's linear layers for one forward of T rows, on every compute path and code path this
CPU runs (SmolLM2-135M shapes: 30 layers x qkv/o/gate_up/down, + the LM head), with the streaming floor.

    .venv/bin/python bench/linear_paths.py --threads 2 --out docs/compute-paths

Weights are random with the real shapes (the cost does not depend on the values); each figure is the
median of repeated runs, all paths measured in the same run, interleaved per repeat.
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from drafttree.apps.bench.peers import read_bandwidth_gbs
from drafttree.compute import cpu_info
from drafttree.ops.int8 import int8_linear, prepare_weight
from drafttree.ops.q4 import pack_q4, q4_linear, quantize_q4_1

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)
SIZES = (1, 2, 4, 8, 16, 32, 64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cpu = cpu_info()
    shapes = LAYER * 30 + [HEAD]
    ws = [torch.randn(n, k) * 0.05 for n, k in shapes]
    n_weights = sum(w.numel() for w in ws)
    isas = [i for i, f in (("avx512_vnni", "avx512_vnni"), ("avx2", "avx2")) if cpu.has(f)]
    paths = {"fp32 (torch)": [(lambda x, w=w: F.linear(x, w)) for w in ws]}
    b16 = [w.bfloat16() for w in ws]
    paths["bf16 (torch)"] = [(lambda x, w=w: F.linear(x.bfloat16(), w)) for w in b16]
    i8 = [prepare_weight(w) for w in ws]
    q4 = [pack_q4(*quantize_q4_1(w)) for w in ws[:-1]]
    for isa in isas:
        paths[f"int8 ({isa})"] = [(lambda x, p=p, isa=isa: int8_linear(x, *p, None, isa)) for p in i8]
        # q4: Q4_1 layers, the LM head int8 (as the q4 compute path runs it)
        paths[f"q4 ({isa})"] = ([(lambda x, p=p, n=w.shape[0], isa=isa: q4_linear(x, *p, None, n, isa)) for p, w in zip(q4, ws)]
                                + [(lambda x, p=i8[-1], isa=isa: int8_linear(x, *p, None, isa))])
    times = {name: {t: [] for t in SIZES} for name in paths}
    for _ in range(a.repeats):
        for t in SIZES:
            xs = {k: torch.randn(t, k) for k in (576, 1536)}
            for name, fns in paths.items():
                t0 = time.perf_counter()
                for fn, (n, k) in zip(fns, shapes):
                    fn(xs[k])
                times[name][t].append((time.perf_counter() - t0) * 1e3)
    med = {name: {t: statistics.median(v) for t, v in d.items()} for name, d in times.items()}
    bw = read_bandwidth_gbs()
    bytes_per_weight = {"fp32": 4, "bf16": 2, "int8": 1, "q4": (134.5e6 - 28.3e6) / 134.5e6 * 0.625 + 28.3e6 / 134.5e6}
    lines = [f"# Linear layers of one forward (SmolLM2-135M shapes), {a.threads} threads", "",
             f"CPU: {cpu.model}; ISA: {cpu.isa_summary}; read bandwidth {bw:.1f} GB/s.", "",
             "| path | " + " | ".join(f"T={t}" for t in SIZES) + " | T8/T1 | T1 ÷ floor |",
             "|---|" + "---:|" * (len(SIZES) + 2)]
    for name, d in med.items():
        floor = n_weights * bytes_per_weight[name.split()[0]] / (bw * 1e9) * 1e3
        lines.append(f"| {name} | " + " | ".join(f"{d[t]:.1f}" for t in SIZES)
                     + f" | {d[8] / d[1]:.2f} | {d[1] / floor:.2f} (floor {floor:.1f} ms) |")
    text = "\n".join(lines) + "\n\n(ms; medians of interleaved repeats; the floor is the weight bytes ÷ bandwidth)\n"
    print(text)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "linear_paths.md").write_text(text)
        (out / "linear_paths.json").write_text(json.dumps(dict(cpu=cpu.model, isa=cpu.isa_summary, threads=a.threads,
                                                               bandwidth_gbs=bw, ms=med), indent=1))


if __name__ == "__main__":
    main()
