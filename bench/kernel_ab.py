"""This checkout's C++ kernels against another revision's, in one process: the base revision's
drafttree/ops is compiled as a second module, and every timed call alternates between the two builds, so
load changes on the machine hit both alike. Times the target's verify forward over T tokens (a random tree
after a prefill) and the drafter's draft + tree round per method; checks the two builds' logits are
bit-identical (a kernel change that alters results needs a reason, and tests/ops). Prints the CPU's ISA.

  .venv/bin/python bench/kernel_ab.py --base HEAD --threads 2 [--out results.json]
"""
import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import drafttree.ops.attention
import drafttree.ops.int8
import drafttree.ops.pointwise
import drafttree.ops.q4
from drafttree.compute import cpu_info
from drafttree.engine import Sequence
from drafttree.gguf_convert import cache_root
from drafttree.load import load_target
from drafttree.methods import load_drafter_for, make_proposer
from drafttree.model.verify_input import VerifyInput
from drafttree.ops.cpu_extension import SOURCES, compile_kernels, extension
from drafttree.tree import random_tree

REPO = Path(__file__).resolve().parent.parent
OPS_MODULES = (drafttree.ops.attention, drafttree.ops.int8, drafttree.ops.pointwise, drafttree.ops.q4)
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and two tests."


def base_kernels(rev: str):
    """The kernels of git revision `rev`, compiled (once per commit) as the module drafttree_cpu_base."""
    commit = subprocess.run(["git", "rev-parse", rev], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    out = cache_root() / "ext-base" / commit[:12]
    src = out / "src"
    if not src.exists():  # extracted beside its final place, then renamed: never half-written
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out) as tmp:
            archive = subprocess.run(["git", "archive", commit, "drafttree/ops"], cwd=REPO, capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
            Path(tmp, "drafttree", "ops").rename(src)
    here = SOURCES[0].parent
    return commit, compile_kernels("drafttree_cpu_base", [src / s.relative_to(here) for s in SOURCES], out / "build")


class Builds:
    """Routes every kernel call to the build named by `use`."""

    def __init__(self, builds: dict):
        self.builds, self.current = builds, next(iter(builds.values()))
        for mod in OPS_MODULES:
            mod.extension = lambda: self.current

    def use(self, name: str) -> None:
        self.current = self.builds[name]


def alternate(builds: Builds, fn, repeats: int) -> tuple[dict, dict]:
    """Median ms of fn() per build, the builds alternating call by call; and each build's last result."""
    times, results = {k: [] for k in builds.builds}, {}
    for _ in range(repeats):
        for name in builds.builds:
            builds.use(name)
            t0 = time.perf_counter()
            results[name] = fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}, results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="git revision whose kernels are the baseline")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--compute", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokens", default="1,2,4,8,16,32", help="verify forwards of these token counts")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--methods", default="chain,ddtree,caddtree")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    commit, base = base_kernels(a.base)
    builds = Builds({"base": base, "this": extension()})
    cpu = cpu_info()
    target = load_target(a.model, compute=a.compute, threads=a.threads)
    print(f"CPU: {cpu.model} ({cpu.arch}); ISA: {cpu.isa_summary}; torch threads {torch.get_num_threads()}; "
          f"target {a.model} on {target.compute_label}; base kernels {commit[:10]}")
    model, gen = target.model, torch.Generator().manual_seed(0)
    tokens = [int(t) for t in a.tokens.split(",")]
    state = model.new_state(a.context + max(tokens) + 1)
    model.prefill(state, torch.randint(0, model.config.vocab_size, (a.context,), generator=gen))
    rows = {}
    print("| part | base ms | this ms | base / this | same logits |\n|---|---:|---:|---:|---|")
    for n in tokens:
        tree = random_tree(n - 1, model.config.vocab_size, "random" if n > 1 else "chain", gen)
        batch = VerifyInput.of_tree(tree, a.context)
        ms, out = alternate(builds, lambda: model.verify(state, batch).logits, a.repeats)
        rows[f"verify T={n}"] = {**ms, "same": bool(torch.equal(out["base"], out["this"]))}
    drafter = load_drafter_for(target)
    for method in a.methods.split(","):
        proposer = make_proposer(method, target, drafter, budget=16)
        seq = Sequence(target, target.encode_chat(PROMPT), proposer, 64)
        for _ in range(4):
            seq.step()
        st, root, start = seq.draft_state, seq.root, len(seq.prompt) + len(seq.tokens) - 1
        ms, _ = alternate(builds, lambda: proposer.build_tree(st, root, proposer.draft(st, root, start), start),
                          2 * a.repeats)
        rows[f"draft + tree, {method}"] = {**ms, "same": None}
    for part, r in rows.items():
        same = "–" if r["same"] is None else "yes" if r["same"] else "**no**"
        print(f"| {part} | {r['base']:.2f} | {r['this']:.2f} | {r['base'] / r['this']:.2f}x | {same} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"cpu": cpu.model, "isa": cpu.isa_summary, "compute": target.compute_label,
                                           "threads": torch.get_num_threads(), "base": commit, "median_ms": rows},
                                          indent=1) + "\n")


if __name__ == "__main__":
    main()
