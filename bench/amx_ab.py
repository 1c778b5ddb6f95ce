"""The int8 kernel with and without AMX tiles, side by side on one machine: SmolLM2-135M's int8 LM head (49,152 x
576), a drafter head over the default 8,192-id draft vocabulary, and one layer's four linears as `--compute int8`
runs them (random weights at those shapes), for 1..32 rows; medians of interleaved repeats, and whether both
paths gave the same bits (they must: exact integer sums, one epilogue).

  .venv/bin/python bench/amx_ab.py [--threads 2] [--rows 1,2,3,4,8,16,32]
"""
import argparse
import statistics
import time

import torch

from drafttree.compute import cpu_info
from drafttree.ops.cpu_extension import extension
from drafttree.ops.int8 import int8_linear, prepare_weight

SHAPES = {"LM head": [(49152, 576)], "draft head": [(8192, 576)],
          "layer (qkv, o, gate_up, down)": [(960, 576), (576, 576), (3072, 576), (576, 1536)]}  # (out, in)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,3,4,8,16,32")
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    ext = extension()
    if ext.amx_mode(1) != 1:
        raise SystemExit(f"no AMX here ({cpu_info().model}; {cpu_info().isa_summary}): nothing to compare")
    gen = torch.Generator().manual_seed(0)
    weights = {name: [prepare_weight(torch.randn(n, k, generator=gen) * 0.05) for n, k in shapes]
               for name, shapes in SHAPES.items()}
    inputs = {name: [k for _, k in shapes] for name, shapes in SHAPES.items()}
    counts = [int(t) for t in a.rows.split(",")]
    times = {(name, t, mode): [] for name in SHAPES for t in counts for mode in (0, 1)}
    same = True
    for rep in range(a.repeats + 1):  # the first pass warms up
        for name, ws in weights.items():
            for t in counts:
                xs = [torch.randn(t, k, generator=gen) for k in inputs[name]]
                outs = {}
                for mode in ((0, 1) if rep % 2 else (1, 0)):  # interleaved, alternating which runs first
                    ext.amx_mode(mode)
                    t0 = time.perf_counter()
                    outs[mode] = [int8_linear(x, *w, None, "avx512_vnni") for x, w in zip(xs, ws)]
                    if rep:
                        times[(name, t, mode)].append((time.perf_counter() - t0) * 1e3)
                same &= all(torch.equal(x, y) for x, y in zip(outs[0], outs[1]))
    ext.amx_mode(-1)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{cpu_info().model}; {cpu_info().isa_summary}; {a.threads} threads; int8 weights x int8 rows")
    for name in SHAPES:
        one = med[(name, counts[0], 0)]
        print(f"\n{name}\n| rows | VNNI ms | AMX ms | AMX ÷ VNNI | VNNI ÷ 1 row | AMX ÷ 1 row |")
        print("|---:|---:|---:|---:|---:|---:|")
        for t in counts:
            v, x = med[(name, t, 0)], med[(name, t, 1)]
            print(f"| {t} | {v:.3f} | {x:.3f} | {x / v:.2f}× | {v / one:.2f}× | {x / one:.2f}× |")
    print(f"\nsame bits on every call: {same}")


if __name__ == "__main__":
    main()
