"""docs/weaver: the Weaver measurement as a markdown table and one plot, from `drafttree bench` runs at two
widths (results.json of each) and bench/weaver_build_time.py's JSON.

  .venv/bin/python bench/weaver_report.py --w8 runs/weaver/bench-w8 --w1 runs/weaver/bench-w1 \
      --build docs/weaver/build_time.json --training runs/weaver/train/metrics.json --out docs/weaver
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from drafttree.atomic import atomic_path, atomic_write_text


def load(path) -> dict:
    return json.loads((Path(path) / "results.json").read_text())


def fmt(x, spec=".2f") -> str:
    return "–" if x is None else format(x, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--w8", required=True, help="bench run with --weaver-width 8 (ar, ddtree, weaver-*, ...)")
    ap.add_argument("--w1", default=None, help="bench run of weaver-ddtree with --weaver-width 1")
    ap.add_argument("--build", default=None, help="bench/weaver_build_time.py JSON")
    ap.add_argument("--training", default=None, help="the Weaver's metrics.json")
    ap.add_argument("--step", type=int, default=None, help="the shipped checkpoint's step (default: the last check)")
    ap.add_argument("--out", default="docs/weaver")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    w8 = load(a.w8)
    w1 = load(a.w1) if a.w1 else None
    sets = list(w8["aggregates"])
    names = list(next(iter(w8["aggregates"].values())))
    cfg = w8["config"]

    lines = [f"Config: {cfg.get('model')} ({cfg.get('compute')}, {cfg.get('threads')} thread(s)), "
             f"{cfg.get('max_new_tokens')} new tokens, greedy, prompts per set {cfg.get('prompts')}, "
             f"weaver width {cfg.get('weaver_width')}; commit {cfg.get('git_commit')}.", "",
             "| set | method | nodes/round | τ | tok/s | × AR | tree-build share of decode | = AR |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for ds in sets + ["mean"]:
        rows = w8["mean_over_datasets"] if ds == "mean" else w8["aggregates"][ds]
        for n in names:
            r = rows[n]
            lines.append(f"| {ds} | {n} | {fmt(r.get('mean_tree_size'), '.1f')} | {fmt(r['tau'])} | "
                         f"{fmt(r['tokens_per_s'], '.1f')} | {fmt(r['speedup'])} | {fmt(r.get('tree_frac'), '.1%')} | "
                         f"{'yes' if not r.get('mismatches') else 'NO'} |")
        if w1 is not None:
            rows1 = w1["mean_over_datasets"] if ds == "mean" else w1["aggregates"][ds]
            for n, r in rows1.items():
                if n.startswith("weaver-"):
                    lines.append(f"| {ds} | {n} (w = 1) | {fmt(r.get('mean_tree_size'), '.1f')} | {fmt(r['tau'])} | "
                                 f"({fmt(r['tokens_per_s'], '.1f')}) | ({fmt(r['speedup'])}) | "
                                 f"{fmt(r.get('tree_frac'), '.1%')} | {'yes' if not r.get('mismatches') else 'NO'} |")
    lines += ["", "τ ratio at equal node counts, weaver-ddtree ÷ ddtree:", "",
              "| set | budget | w = 8 | w = 1 |", "|---|---:|---:|---:|"]
    budgets = sorted({r["budget"] for r in w8["mean_over_datasets"].values() if r["kind"] == "ddtree"})
    for ds in sets + ["mean"]:
        rows = w8["mean_over_datasets"] if ds == "mean" else w8["aggregates"][ds]
        rows1 = None if w1 is None else (w1["mean_over_datasets"] if ds == "mean" else w1["aggregates"][ds])
        for b in budgets:
            dd, wv = rows.get(f"ddtree-{b}"), rows.get(f"weaver-ddtree-{b}")
            one = rows1.get(f"weaver-ddtree-{b}") if rows1 else None
            if dd and wv:
                lines.append(f"| {ds} | {b} | {wv['tau'] / dd['tau']:.3f} | "
                             f"{fmt(one['tau'] / dd['tau'] if one else None, '.3f')} |")
    if a.build:
        b = json.loads(Path(a.build).read_text())
        lines += ["", f"Build time of a {b['nodes']}-node Weaver tree on real rounds ({b['rounds']} rounds, "
                  f"{b['compute']}, {b['threads']} thread): w = 1 {b['build_ms_median']['1']:.1f} ms "
                  f"({b['weaver_calls_median']['1']:.0f} calls), w = {b['width']} "
                  f"{b['build_ms_median'][str(b['width'])]:.1f} ms ({b['weaver_calls_median'][str(b['width'])]:.0f} calls): "
                  f"ratio {b['ratio']:.2f}; the paper's pop-{b['width']} steps {b['build_ms_median']['pop']:.1f} ms "
                  f"({b['weaver_calls_median']['pop']:.0f} calls); DDTree's heap over the marginals "
                  f"{b['ddtree_heap_ms_median']:.1f} ms. τ at {b['nodes']} nodes: w = 1 {b['tau_mean']['1']:.3f}, "
                  f"look-ahead w = {b['width']} {b['tau_mean'][str(b['width'])]:.3f} (ratio {b['tau_ratio']:.3f}), "
                  f"pop-{b['width']} {b['tau_mean']['pop']:.3f}; {b['prompts']} prompts."]
    if a.training:
        m = json.loads(Path(a.training).read_text())
        first, last = m["held_out"][0], next((h for h in m["held_out"] if h["step"] == a.step), m["held_out"][-1])
        lines += ["", f"Training (held-out blocks, teacher forcing): loss {first['loss']:.3f} → {last['loss']:.3f}; "
                  f"greedy-chain τ drafter {last['tau_drafter']:.3f}, Weaver {last['tau_weaver']:.3f} "
                  f"(step {last['step']}); top-1 at depth 1/2/4/8: drafter "
                  + "/".join(f"{last['drafter_top1'][i]:.2f}" for i in (0, 1, 3, 7))
                  + ", Weaver " + "/".join(f"{last['weaver_top1'][i]:.2f}" for i in (0, 1, 3, 7)) + "."]
    atomic_write_text(out / "results.md", "\n".join(lines) + "\n")
    plot(w8, w1, out / "tau_vs_nodes.png")
    print("\n".join(lines))
    return 0


def plot(w8: dict, w1: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {}
    for ds, rows in list(w8["aggregates"].items()) + [("mean", w8["mean_over_datasets"])]:
        for kind, style in (("ddtree", "o-"), ("weaver-ddtree", "D--")):
            pts = sorted((r["mean_tree_size"], r["tau"], r["tokens_per_s"]) for r in rows.values()
                         if r["kind"] == kind and r["mean_tree_size"])
            if not pts:
                continue
            kw = {"color": colors[ds]} if ds in colors else {}
            line, = ax[0].plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{ds}: {kind}", **kw)
            colors.setdefault(ds, line.get_color())
            ax[1].plot([p[0] for p in pts], [p[2] for p in pts], style, color=colors[ds], label=f"{ds}: {kind}")
        for name, marker in (("weaver-caddtree", "*"), ("caddtree", "P"), ("chain", "^")):
            r = rows.get(name)
            if r and r["mean_tree_size"]:
                ax[0].plot([r["mean_tree_size"]], [r["tau"]], marker, color=colors.get(ds), markersize=10, linestyle="none")
                ax[1].plot([r["mean_tree_size"]], [r["tokens_per_s"]], marker, color=colors.get(ds), markersize=10,
                           linestyle="none")
        ar = rows.get("ar")
        if ar:
            ax[1].axhline(ar["tokens_per_s"], color=colors.get(ds), linestyle=":", alpha=0.6)
    if w1 is not None:
        rows = w1["mean_over_datasets"]
        pts = sorted((r["mean_tree_size"], r["tau"]) for r in rows.values() if r["kind"] == "weaver-ddtree")
        if pts:
            ax[0].plot([p[0] for p in pts], [p[1] for p in pts], "s:", color=colors.get("mean"), label="mean: weaver-ddtree w=1")
    ax[0].set_xlabel("draft nodes per round"), ax[0].set_ylabel("τ (tokens per target forward)"), ax[0].legend(fontsize=7)
    ax[1].set_xlabel("draft nodes per round"), ax[1].set_ylabel("tokens/s (dotted: AR)")
    ax[0].set_title("τ vs nodes (★ weaver-caddtree, + caddtree, ▲ chain)"), ax[1].set_title("decode tokens/s")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
