"""Two revisions of drafttree side by side in one run: the working tree and a base commit (checked out once as
a git worktree under /tmp, kept for the next run so its kernels compile once), each in its own worker process,
decoding the same prompts with the same methods, alternating revision order per prompt so that the machine's
drift hits both alike. Prints the CPU's ISA, tok/s, τ and the
draft / tree / verify ms per drafted round of each, the ratios to the base, and checks that both revisions
emit the same tokens (greedy; where the two revisions run different compute paths, each method is checked against its
own revision's AR instead).

  .venv/bin/python bench/revision_ab.py --base 8e1f94a --methods caddtree,lookup-caddtree,ddtree-b4 --limit 2 \
      --threads 2

(`ddtree-b4`: ddtree with a 4-node budget; a plain method name takes make_proposer's default.)
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent


def worker(tree: str, threads: int | None) -> None:
    """Serve one JSON request per stdin line ({"prompt", "method", "max_new_tokens"}) with this tree's drafttree."""
    sys.path.insert(0, tree)
    import drafttree
    from drafttree.load import load_target
    from drafttree.methods import generate, load_drafter_for, make_proposer

    if not Path(drafttree.__file__).resolve().is_relative_to(Path(tree).resolve()):
        raise SystemExit(f"worker for {tree} imported drafttree from {drafttree.__file__}")
    target = load_target("smollm2-135m-instruct", compute="auto", threads=threads)
    drafter, proposers = load_drafter_for(target), {}
    print(json.dumps({"ready": target.compute_label}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        m = req["method"]
        if m not in proposers:
            method, _, budget = m.partition("-b")  # "ddtree-b4": ddtree with a 4-node budget
            options = {"budget": int(budget)} if budget else {}
            proposers[m] = None if m == "ar" else make_proposer(method, target, drafter, **options)
            generate(m, target, target.encode_chat("Hello!"), 8, proposer=proposers[m])  # warm-up: one-off costs
        st = generate(m, target, target.encode_chat(req["prompt"]), req["max_new_tokens"], proposer=proposers[m])
        s = st.stats
        print(json.dumps({"tokens": st.tokens, "new_tokens": s.new_tokens, "total_s": s.total_s, "draft_s": s.draft_s,
                          "tree_s": s.tree_s, "verify_s": s.verify_s, "drafted": s.drafted_rounds,
                          "rounds": len(s.accept_lengths)}), flush=True)


def start_worker(tree: Path, threads: int | None) -> tuple[subprocess.Popen, str]:
    """The worker and its target's compute label (what it printed when ready)."""
    cmd = [sys.executable, str(HERE), "--worker", str(tree)] + ([] if threads is None else ["--threads", str(threads)])
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tree,
                            env={**os.environ, "PYTHONPATH": str(tree)})
    ready = proc.stdout.readline()
    if not ready:
        raise SystemExit(f"the worker for {tree} did not start")
    return proc, json.loads(ready)["ready"]


def ask(proc: subprocess.Popen, **req) -> dict:
    proc.stdin.write(json.dumps(req) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise SystemExit("a worker died (its error is above)")
    return json.loads(line)


def base_tree(commit: str) -> Path:
    sha = subprocess.check_output(["git", "rev-parse", "--short", commit], cwd=REPO, text=True).strip()
    tree = Path("/tmp") / f"drafttree-ab-{sha}"
    if not tree.exists():
        subprocess.check_call(["git", "worktree", "add", "--detach", str(tree), sha], cwd=REPO)
    return tree


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--base", default="HEAD", help="the commit to compare the working tree with")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--methods", default="ar,caddtree,lookup-caddtree")
    ap.add_argument("--datasets", default="gsm8k,humaneval,mtbench")
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, a.threads)
    sys.path.insert(0, str(REPO))
    from drafttree.atomic import atomic_write_text
    from drafttree.compute import cpu_info
    from drafttree.datasets import load_prompts

    cpu = cpu_info()
    print(f"CPU: {cpu.model} ({cpu.arch}); ISA: {cpu.isa_summary}; threads {a.threads}")
    revs = {"base " + a.base: base_tree(a.base), "working tree": REPO}
    started = {name: start_worker(tree, a.threads) for name, tree in revs.items()}
    procs, labels = {n: p for n, (p, _) in started.items()}, {n: label for n, (_, label) in started.items()}
    for name, label in labels.items():
        print(f"{name}: {label}")
    # Revisions on one compute path must emit the same tokens; on different paths (auto chose another) each
    # method is held to its own revision's AR instead (greedy: every method equals AR on the same weights).
    same_path = len(set(labels.values())) == 1
    methods = ["ar"] + [m for m in a.methods.split(",") if m != "ar"]
    prompts = [p for ds in a.datasets.split(",") for p in load_prompts(ds, a.limit)]
    keys = ("new_tokens", "total_s", "draft_s", "tree_s", "verify_s", "drafted", "rounds")
    totals = {(m, r): dict.fromkeys(keys, 0) for m in methods for r in revs}
    for i, prompt in enumerate(tqdm(prompts, desc="prompts")):
        for m in methods:
            order = list(revs) if i % 2 == 0 else list(revs)[::-1]
            outs = {r: ask(procs[r], prompt=prompt, method=m, max_new_tokens=a.max_new_tokens) for r in order}
            if m == "ar":
                ar_tokens = {r: o["tokens"] for r, o in outs.items()}
            if same_path and len({tuple(o["tokens"]) for o in outs.values()}) != 1:
                raise SystemExit(f"{m}: the revisions emit different tokens for prompt {i}: a bug")
            for r, o in outs.items():
                if o["tokens"] != ar_tokens[r]:
                    raise SystemExit(f"{m} ({r}): not AR's tokens for prompt {i}: a bug")
            for r, o in outs.items():
                for k in keys:
                    totals[(m, r)][k] += o[k]
    for p in procs.values():
        p.stdin.close()
    base = next(iter(revs))
    print("| method | revision | tok/s | × AR (same revision) | τ | draft ms | tree ms | verify ms per drafted round "
          "| draft + tree vs base |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    def draft_tree_ms(t: dict) -> float:  # per drafted round
        return (t["draft_s"] + t["tree_s"]) * 1e3 / max(t["drafted"], 1)

    for (m, r), t in totals.items():
        per = {k: t[k] * 1e3 / max(t["drafted"], 1) for k in ("draft_s", "tree_s", "verify_s")}
        ratio = draft_tree_ms(t) / max(draft_tree_ms(totals[(m, base)]), 1e-9)
        t.update(tokens_per_s=t["new_tokens"] / t["total_s"], tau=t["new_tokens"] / max(t["rounds"], 1),
                 draft_tree_vs_base=ratio, **{k.replace("_s", "_ms_per_drafted_round"): v for k, v in per.items()})
        t["vs_ar"] = t["tokens_per_s"] / (totals[("ar", r)]["new_tokens"] / totals[("ar", r)]["total_s"])
        print(f"| {m} | {r} | {t['tokens_per_s']:.1f} | {t['vs_ar']:.2f}× | {t['tau']:.2f} | {per['draft_s']:.2f} "
              f"| {per['tree_s']:.2f} | {per['verify_s']:.2f} | {ratio:.2f}x |")
    if a.out:
        atomic_write_text(a.out, json.dumps({"cpu": cpu.model, "isa": cpu.isa_summary, "threads": a.threads,
                                             "base": a.base, "compute": labels,
                                             "totals": {"|".join(k): v for k, v in totals.items()}},
                                            indent=1))


if __name__ == "__main__":
    main()
