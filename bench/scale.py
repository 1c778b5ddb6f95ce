"""drafttree beside llama.cpp at the published Qwen3 shapes (issue 37 item 3): random weights in Q4_K_M's types
written once per shape (drafttree.apps.bench.random_gguf: 0.6B, 1.7B, 4B, 8B; no weights install offline), then, per
shape and alternating the two systems in fresh processes: load time and RSS after loading, AR tokens/s on the same
token ids (greedy, no tokenizer involved), and the cost of one forward of n = 1..64 tokens on a 128-token context
(drafttree: a chain verify; llama.cpp: one `eval` of n tokens, its KV rows removed after) — the curve a tree's
size is chosen on. Prints the CPU's ISA and the machine's read bandwidth beside the tables.

    .venv/bin/python bench/scale.py --shapes qwen3-0.6b,qwen3-1.7b --out docs/scale/emr-2026-12-07
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TOKENS = (1, 2, 4, 8, 16, 32, 64)
CONTEXT = 128


def rss_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prompt_ids(vocab: int, n: int) -> list[int]:
    import random

    rng = random.Random(0)
    return [rng.randrange(3, min(vocab, 49152)) for _ in range(n)]  # ids with real tokens: llama.cpp decodes them


def drafttree_worker(path: str, threads: int, new_tokens: int, repeats: int) -> dict:
    import torch

    from drafttree.engine import generate_ar
    from drafttree.load import load_target
    from drafttree.model.verify_input import VerifyInput
    from drafttree.tree import random_tree

    t0 = time.perf_counter()
    target = load_target(path, compute="auto", threads=threads)
    load_s, rss, peak = time.perf_counter() - t0, rss_mib(), peak_mib()
    model = target.model
    ids = torch.tensor(prompt_ids(model.config.vocab_size, CONTEXT))
    generate_ar(target, ids[:8], 4, stop_token_ids=())  # warm-up
    res = generate_ar(target, ids, new_tokens, stop_token_ids=())
    gen = torch.Generator().manual_seed(0)
    curve = {n: [] for n in TOKENS}
    with torch.no_grad():
        state = model.new_state(CONTEXT + max(TOKENS) + 1)
        model.prefill(state, ids)
        for _ in range(repeats):
            for n in TOKENS:
                batch = VerifyInput.of_tree(random_tree(n - 1, model.config.vocab_size, "chain", gen), CONTEXT)
                t1 = time.perf_counter()
                model.verify(state, batch)  # never committed: every repeat on the same context
                curve[n].append((time.perf_counter() - t1) * 1e3)
    return {"load_s": load_s, "rss_mib": rss, "peak_mib": peak, "compute": target.compute_label,
            "ar_tok_s": res.stats.tokens_per_s, "tokens": res.tokens,
            "forward_ms": {n: statistics.median(v) for n, v in curve.items()}}


def llama_worker(path: str, threads: int, new_tokens: int, repeats: int) -> dict:
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads,
                n_ctx=CONTEXT + new_tokens + 2 * max(TOKENS), n_batch=max(TOKENS), verbose=False)
    load_s, rss, peak = time.perf_counter() - t0, rss_mib(), peak_mib()
    ids = prompt_ids(llm.n_vocab(), CONTEXT)
    out, t_first = [], None
    for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        if t_first is None:  # the prompt's forward gave the first token: the clock starts here
            t_first = time.perf_counter()
        out.append(int(tok))
        if len(out) >= new_tokens:
            break
    ar_tok_s = (len(out) - 1) / (time.perf_counter() - t_first)
    llm.reset()
    llm.eval(ids)
    curve = {n: [] for n in TOKENS}
    for _ in range(repeats):
        for n in TOKENS:
            t1 = time.perf_counter()
            llm.eval(prompt_ids(llm.n_vocab(), n))
            curve[n].append((time.perf_counter() - t1) * 1e3)
            llm._ctx.kv_cache_seq_rm(-1, CONTEXT, -1)  # the n rows leave the cache: the next size sees the same context
            llm.n_tokens = CONTEXT
    return {"load_s": load_s, "rss_mib": rss, "peak_mib": peak, "ar_tok_s": ar_tok_s, "tokens": out,
            "forward_ms": {n: statistics.median(v) for n, v in curve.items()}}


def drafter_worker(path: str, threads: int, new_tokens: int, repeats: int) -> dict:
    """The published Qwen3-4B DFlash layout (random weights) beside the 4B-shaped target: its draft cost per round
    (a 16-row block after a 128-token prompt) and every tree method's greedy output against AR on the random target."""
    import torch

    from drafttree.apps.bench.random_gguf import QWEN3_4B_DFLASH, random_drafter
    from drafttree.costmodel import VerifyCostModel, fit_convex_cost
    from drafttree.engine import Sequence, generate_ar
    from drafttree.load import load_target
    from drafttree.methods import generate, make_proposer
    from drafttree.model.linear import quantize_linears, use_cpu_kernels

    target = load_target(path, compute="auto", threads=threads)
    drafter = random_drafter(QWEN3_4B_DFLASH)
    params = sum(p.numel() for p in drafter.parameters())  # before quantization packs them
    use_cpu_kernels(quantize_linears(drafter.fuse_projections(), target.compute.isa), target.compute.isa)
    ids = torch.tensor(prompt_ids(target.model.config.vocab_size, CONTEXT))
    ddtree = make_proposer("ddtree", target, drafter, budget=16)
    seq = Sequence(target, ids, ddtree, 64)
    seq.step()  # the prefill and the drafter's prompt pass
    times = []
    for _ in range(repeats):  # a round's drafting: the 16-row block, then the head rows a 16-node DDTree reaches
        t0 = time.perf_counter()
        scores = ddtree.draft(seq.draft_state, int(seq.root), seq.state.length)
        ddtree.build_tree(seq.draft_state, int(seq.root), scores, seq.state.length)
        times.append((time.perf_counter() - t0) * 1e3)
    draft_ms = statistics.median(times)
    measured = json.loads(os.environ["SCALE_CURVE"])  # the target's forward_ms from the run before
    curve = fit_convex_cost(TOKENS, [measured[str(n)] for n in TOKENS])
    costs = VerifyCostModel(context_lens=(CONTEXT,), curves=(curve,), draft_ms=draft_ms)
    ar = generate_ar(target, ids, new_tokens, stop_token_ids=()).tokens
    equal = {}
    for method in ("chain", "ddtree", "caddtree", "caddtree-online", "lookup-ddtree", "lookup-caddtree-online"):
        proposer = make_proposer(method, target, drafter, budget=8, cost_model=costs)
        equal[method] = generate(method, target, ids, new_tokens, proposer=proposer, stop_token_ids=()).tokens == ar
    return {"drafter_params": params, "draft_ms": draft_ms, "greedy_equals_ar": equal, "tokens": new_tokens}


def run_worker(kind: str, path: Path, a, env: dict | None = None) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--file", str(path), "--threads", str(a.threads),
           "--new-tokens", str(a.new_tokens), "--repeats", str(a.repeats)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, **(env or {})}).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3-0.6b,qwen3-1.7b")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="alternations of the two systems per shape")
    p.add_argument("--dir", type=Path, default=None, help="where the random files are kept (default: the cache)")
    p.add_argument("--out", type=Path)
    p.add_argument("--drafter", action="store_true", help="also the published Qwen3-4B DFlash layout (random weights) "
                   "on the last shape: its draft cost, and every tree method's greedy output against AR")
    p.add_argument("--worker", choices=("drafttree", "llama.cpp", "drafter"), help=argparse.SUPPRESS)
    p.add_argument("--file", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        fn = {"drafttree": drafttree_worker, "llama.cpp": llama_worker, "drafter": drafter_worker}[a.worker]
        print(json.dumps(fn(a.file, a.threads, a.new_tokens, a.repeats)))
        return
    from tqdm import tqdm

    from drafttree.apps.bench.peers import read_bandwidth_gbs
    from drafttree.apps.bench.random_gguf import QWEN3_SHAPES, write_random_qwen3
    from drafttree.compute import cpu_info
    from drafttree.gguf_convert import cache_root

    files = a.dir or cache_root() / "scale"
    files.mkdir(parents=True, exist_ok=True)
    shapes = a.shapes.split(",")
    unknown = [s for s in shapes if s not in QWEN3_SHAPES]
    if unknown:
        raise SystemExit(f"unknown shape(s) {unknown}: choose from {list(QWEN3_SHAPES)}")
    info = cpu_info()
    result = {"cpu": info.model, "isa": info.isa_summary, "threads": a.threads,
              "read_bandwidth_gbs": round(read_bandwidth_gbs(), 1), "context": CONTEXT, "new_tokens": a.new_tokens,
              "shapes": {}}
    runs = [(s, k, r) for s in shapes for r in range(a.rounds) for k in ("drafttree", "llama.cpp")]
    by_shape: dict[str, dict[str, list[dict]]] = {s: {"drafttree": [], "llama.cpp": []} for s in shapes}
    for shape, kind, _ in tqdm(runs, desc="scale", unit="run"):
        path = files / f"{shape}-random-q4_k_m.gguf"
        if not path.exists():
            tmp = path.with_suffix(".partial")
            write_random_qwen3(tmp, shape)
            tmp.rename(path)  # a reader never sees half a file
        by_shape[shape][kind].append(run_worker(kind, path, a))
    for shape, systems in by_shape.items():
        entry = {"file_mib": round((files / f"{shape}-random-q4_k_m.gguf").stat().st_size / 2**20)}
        for kind, rs in systems.items():
            entry[kind] = {"runs": rs, "ar_tok_s": statistics.fmean(r["ar_tok_s"] for r in rs),
                           "load_s": statistics.fmean(r["load_s"] for r in rs),
                           "rss_mib": statistics.fmean(r["rss_mib"] for r in rs),
                           "peak_mib": statistics.fmean(r["peak_mib"] for r in rs),
                           "forward_ms": {n: statistics.fmean(r["forward_ms"][str(n)] for r in rs) for n in TOKENS}}
        ours, theirs = entry["drafttree"], entry["llama.cpp"]
        entry["ar_ratio"] = ours["ar_tok_s"] / theirs["ar_tok_s"]
        ours["greedy_equal_prefix"] = [  # random weights: near-ties, so only the first tokens are expected to agree
            next((i for i, (x, y) in enumerate(zip(d["tokens"], l_["tokens"])) if x != y), len(d["tokens"]))
            for d, l_ in zip(ours["runs"], theirs["runs"])]
        result["shapes"][shape] = entry
    if a.drafter:  # its verify curve: the one just measured on the last shape
        shape = shapes[-1]
        curve = json.dumps({str(n): v for n, v in result["shapes"][shape]["drafttree"]["forward_ms"].items()})
        result["drafter"] = {"shape": shape, **run_worker("drafter", files / f"{shape}-random-q4_k_m.gguf", a,
                                                          {"SCALE_CURVE": curve})}
    print(markdown(result))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        for entry in result["shapes"].values():
            for kind in ("drafttree", "llama.cpp"):
                for r in entry[kind]["runs"]:
                    r.pop("tokens", None)
        (a.out / "scale.json").write_text(json.dumps(result, indent=1) + "\n")
        (a.out / "README.md").write_text(markdown(result) + "\n")
        plot(result, a.out / "verify-curves.png")


def markdown(r: dict) -> str:
    lines = [f"CPU: {r['cpu']}; ISA: {r['isa']}; {r['threads']} threads; "
             f"read bandwidth {r['read_bandwidth_gbs']} GB/s; random weights in Q4_K_M's types; "
             f"AR {r['new_tokens']} tokens after {r['context']}; means of the runs.",
             "", "| shape | file MiB | drafttree AR tok/s | llama.cpp AR tok/s | ratio | "
             "drafttree load s / RSS MiB | llama.cpp load s / RSS MiB |", "|---|---:|---:|---:|---:|---:|---:|"]
    for shape, e in r["shapes"].items():
        d, l_ = e["drafttree"], e["llama.cpp"]
        lines.append(f"| {shape} | {e['file_mib']} | {d['ar_tok_s']:.1f} | {l_['ar_tok_s']:.1f} | "
                     f"{e['ar_ratio']:.2f}× | "
                     f"{d['load_s']:.1f} / {d['rss_mib']:.0f} (peak {d['peak_mib']:.0f}) | "
                     f"{l_['load_s']:.1f} / {l_['rss_mib']:.0f} |")
    lines += ["", "One forward of n tokens on the context, ms (× one token):", "",
              "| shape | system | " + " | ".join(str(n) for n in TOKENS) + " |", "|---|---|" + "---:|" * len(TOKENS)]
    for shape, e in r["shapes"].items():
        for kind in ("drafttree", "llama.cpp"):
            f = e[kind]["forward_ms"]
            cells = " | ".join(f"{f[n]:.1f} ({f[n] / f[1]:.2f}×)" for n in TOKENS)
            lines.append(f"| {shape} | {kind} | {cells} |")
    if "drafter" in r:
        d = r["drafter"]
        one = r["shapes"][d["shape"]]["drafttree"]["forward_ms"][1]
        lines += ["", f"Qwen3-4B-DFlash-b16's layout (random weights, {d['drafter_params'] / 1e6:.0f} M parameters) "
                  f"beside the {d['shape']} target: a 16-row draft {d['draft_ms']:.1f} ms "
                  f"({d['draft_ms'] / one:.2f}× one target token); greedy = AR over {d['tokens']} tokens: "
                  + ", ".join(f"{m} {'yes' if ok else 'NO'}" for m, ok in d["greedy_equals_ar"].items())]
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for shape, e in r["shapes"].items():
        for kind, style in (("drafttree", "-o"), ("llama.cpp", "--s")):
            f = e[kind]["forward_ms"]
            ax.plot(TOKENS, [f[n] for n in TOKENS], style, label=f"{shape} {kind}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in the forward")
    ax.set_ylabel("ms")
    ax.set_title(f"forward cost on a {r['context']}-token context ({r['isa'].split()[-1]}, {r['threads']} threads)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
