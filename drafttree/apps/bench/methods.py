"""`drafttree bench`: decoding methods side by side on evaluation prompt sets.

For every prompt, every method runs back to back (interleaved, in a fresh seeded random order per
prompt, so no method always follows the same neighbour, e.g. the heavy ddtree-128), so machine noise
hits all methods alike and AR's speed is measured in the same run.
In greedy mode every method's tokens are compared with AR's: speculative decoding is lossless, so
the mismatch count must be 0.

Definitions used in every table and in results.json:
  τ        mean over prompts of the per-prompt mean acceptance length (accepted draft tokens + the
           bonus token per round); `tau_pooled` (all rounds of all prompts together) is in the JSON too.
  tok/s    total new tokens / total decode time (prefill excluded; prefill is reported separately).
  speedup  tok/s ÷ AR's tok/s on the same prompts in the same run.
  draft / verify / other   decode time split: drafter + tree building / target forward + acceptance
           walk + KV commit / the rest of the loop.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ...atomic import atomic_path, atomic_write_text
from ...compute import add_compute_argument, compute_of
from ...methods import COST_AWARE, METHODS, NO_DRAFTER, generate, make_proposer
from ...sampling import SamplingParams
from ...validate import InputError, check_positive_int

DATASETS = ("humaneval", "gsm8k", "mtbench", "copy")  # every prompt set a run may name (datasets.PROMPT_SETS)
DEFAULT_DATASETS = ("humaneval", "gsm8k", "mtbench")  # what a run without --datasets measures
DEFAULT_OUT = "runs/bench-methods"
BUDGETED = ("ddtree", "lookup-ddtree", "weaver-ddtree")  # run once per --budgets entry
POINT_MARKERS = {"chain": "^", "caddtree": "*", "caddtree-online": "P", "lookup": "v", "lookup-caddtree": "X", "lookup-caddtree-online": "d",
                 "weaver-caddtree": "D"}


# ---- method variants -------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One measured configuration: a method and, for ddtree and lookup-ddtree, its budget."""

    method: str
    budget: int | None = None

    @property
    def name(self) -> str:
        return f"{self.method}-{self.budget}" if self.budget is not None else self.method


def parse_datasets(text: str) -> list[str]:
    """`--datasets a,b`: names checked against DATASETS."""
    datasets = [d.strip() for d in text.split(",") if d.strip()]
    for d in datasets:
        if d not in DATASETS:
            raise ValueError(f"unknown dataset {d!r}: choose from {', '.join(DATASETS)}")
    return datasets


def parse_variants(methods, budgets) -> list[Variant]:
    """`ar` first (always: it is the reference), then the others in the order given; ddtree (and lookup-ddtree)
    once per budget."""
    methods = [m.strip() for m in (methods.split(",") if isinstance(methods, str) else methods) if m.strip()]
    budgets = [int(b) for b in (budgets.split(",") if isinstance(budgets, str) else budgets) if str(b).strip()]
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}: choose from {', '.join(METHODS)}")
    if any(m in BUDGETED for m in methods) and not budgets:
        raise ValueError("ddtree needs at least one budget (--budgets 4,8,16)")
    if any(b < 1 for b in budgets):
        raise ValueError(f"budgets must be >= 1, got {budgets}")
    variants = [Variant("ar")]
    for m in dict.fromkeys(methods):  # de-duplicated, order kept
        if m == "ar":
            continue
        if m in BUDGETED:
            variants += [Variant(m, b) for b in dict.fromkeys(budgets)]
        else:
            variants.append(Variant(m))
    return variants


# ---- the measurement ---------------------------------------------------------------------------


def _prompt_ids(target, prompt, chat: bool) -> torch.Tensor:
    if isinstance(prompt, str):
        return target.encode_chat(prompt) if chat else target.encode(prompt)
    return torch.as_tensor(prompt, dtype=torch.long)


def _sampling_for(sampling: SamplingParams, index: int) -> SamplingParams:
    """Sampling: each prompt gets its own seed (seed + prompt number), the same for every method."""
    if sampling.greedy or sampling.seed is None:
        return sampling
    return SamplingParams(sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed + index)


def _record(dataset: str, index: int, variant: Variant, result, ar_tokens) -> dict:
    s = result.stats
    rec = dict(dataset=dataset, prompt_index=index, method=variant.name, kind=variant.method, budget=variant.budget,
               **{k: v for k, v in s.summary().items() if k != "method"})
    rec["accept_lengths"] = list(s.accept_lengths)
    rec["tree_sizes"] = list(s.tree_sizes)
    if ar_tokens is None:
        rec["matches_ar"], rec["first_mismatch"] = None, None
    else:
        rec["matches_ar"] = result.tokens == ar_tokens
        rec["first_mismatch"] = None if rec["matches_ar"] else next(
            (i for i, (a, b) in enumerate(zip(result.tokens, ar_tokens)) if a != b), min(len(result.tokens), len(ar_tokens)))
    if variant.method == "ar" or rec["matches_ar"] is not True:  # the reference, and anything that differs from it
        rec["tokens"] = list(result.tokens)
    return rec


def benchmark(target, prompts_by_dataset: dict, methods=METHODS, *, drafter=None, budgets=(16,), max_new_tokens: int = 256,
              sampling: SamplingParams = SamplingParams(), cost_model=None, max_tree_nodes: int = 128, chat: bool = True,
              warmup_tokens: int = 8, stop_token_ids=None, out_dir=None, progress: bool = True, config: dict | None = None,
              proposers: dict | None = None, log=print, weaver=None, weaver_width: int = 8) -> dict:
    """Run every method on every prompt, interleaved; return (and, with out_dir, write) the results.

    `prompts_by_dataset` maps a dataset name to prompts: strings (chat template applied unless
    `chat=False`) or token-id sequences (used as they are). `drafter` is shared by all proposers;
    `cost_model` is CaDDTree's (profiled / loaded from the cache when None). `proposers` maps variant
    names ("chain", "ddtree-16", ...) to ready proposers that replace the default DFlash ones. `weaver`
    (a loaded Weaver or its directory; None: the shipped one) and `weaver_width` serve the weaver-* methods.
    """
    from tqdm import tqdm

    variants = parse_variants(methods, budgets)
    given = dict(proposers or {})
    if weaver is None or isinstance(weaver, (str, Path)):
        if any(v.method.startswith("weaver-") and v.name not in given for v in variants):
            from ...methods import load_drafter_for, load_weaver_for

            drafter = drafter if drafter is not None else load_drafter_for(target)
            weaver = load_weaver_for(target, drafter, weaver)  # loaded once for every weaver-* variant
    proposers = {v.name: given.get(v.name) or make_proposer(v.method, target, drafter=drafter, budget=v.budget or 16,
                                                            cost_model=cost_model, max_tree_nodes=max_tree_nodes,
                                                            **(dict(weaver=weaver, weaver_width=weaver_width)
                                                               if v.method.startswith("weaver-") else {}))
                 for v in variants if v.method != "ar"}
    prompts = {ds: [_prompt_ids(target, p, chat) for p in ps] for ds, ps in prompts_by_dataset.items()}
    if not any(prompts.values()):
        raise ValueError("no prompts to benchmark")
    out_path = Path(out_dir) if out_dir is not None else None
    stream = None
    if out_path is not None:
        out_path.mkdir(parents=True, exist_ok=True)
        stream = open(out_path / "records.jsonl", "w")  # grows as prompts finish: survives an interrupted run

    def run_one(variant: Variant, ids, n_tokens, params):
        return generate(variant.method, target, ids, n_tokens, params, proposer=proposers.get(variant.name),
                        stop_token_ids=stop_token_ids)

    if warmup_tokens > 0:  # first calls pay one-off costs (allocations, kernel selection): keep them out of the numbers
        first = next(ids for ps in prompts.values() for ids in ps)
        for v in variants:
            run_one(v, first, warmup_tokens, sampling)

    records: list[dict] = []
    total = sum(len(ps) for ps in prompts.values())
    bar = tqdm(total=total, desc="bench", unit="prompt", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    counter = 0
    try:
        for ds, ps in prompts.items():
            for i, ids in enumerate(ps):
                bar.set_description(f"{ds} {i + 1}/{len(ps)}")
                params = _sampling_for(sampling, counter)
                order = random.Random(counter).sample(variants, len(variants))
                results = {v.name: run_one(v, ids, max_new_tokens, params) for v in order}
                ar_tokens = results["ar"].tokens if sampling.greedy else None
                recs = [_record(ds, i, v, results[v.name], None if v.method == "ar" else ar_tokens) for v in variants]
                records += recs
                if stream is not None:
                    for r in recs:
                        stream.write(json.dumps(r) + "\n")
                    stream.flush()
                bad = [r["method"] for r in recs if r["matches_ar"] is False]
                if bad:
                    bar.write(f"MISMATCH vs AR: {ds} prompt {i}: {', '.join(bad)}")
                ar_tps = results["ar"].stats.tokens_per_s
                bar.set_postfix_str(" ".join(f"{v.name}={results[v.name].stats.tokens_per_s / ar_tps:.2f}x"
                                             for v in variants if v.method != "ar") if ar_tps > 0 else "")
                bar.update(1)
                counter += 1
    finally:
        bar.close()
        if stream is not None:
            stream.close()

    aggregates = {ds: {v.name: aggregate([r for r in records if r["dataset"] == ds and r["method"] == v.name], v,
                                         [r for r in records if r["dataset"] == ds and r["method"] == "ar"])
                       for v in variants}
                  for ds in prompts if prompts[ds]}
    results = dict(
        config=dict(config or {}, methods=[v.name for v in variants], max_new_tokens=max_new_tokens,
                    sampling=dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                  seed=sampling.seed, greedy=sampling.greedy),
                    max_tree_nodes=max_tree_nodes, chat=chat, warmup_tokens=warmup_tokens,
                    prompts={ds: len(ps) for ds, ps in prompts.items()},
                    definitions=dict(tau="mean over prompts of the per-prompt mean acceptance length (accepted + bonus)",
                                     tau_pooled="total accepted+bonus tokens / total rounds",
                                     tokens_per_s="total new tokens / total decode time (prefill excluded)",
                                     speedup="tokens_per_s / AR tokens_per_s, same prompts, same run",
                                     mean_over_datasets="unweighted mean of the per-dataset values")),
        aggregates=aggregates,
        mean_over_datasets=mean_over_datasets(aggregates, variants),
        records=records,
    )
    if out_path is not None:
        write_outputs(results, out_path, log=log)
    return results


# ---- aggregation -------------------------------------------------------------------------------


def aggregate(recs: list[dict], variant: Variant, ar_recs: list[dict]) -> dict:
    n_tokens = sum(r["new_tokens"] for r in recs)
    decode_s = sum(r["total_s"] for r in recs)
    rounds = sum(len(r["accept_lengths"]) for r in recs)
    tree_rounds = sum(len(r["tree_sizes"]) for r in recs)
    tps = n_tokens / decode_s if decode_s > 0 else 0.0
    ar_tokens, ar_s = sum(r["new_tokens"] for r in ar_recs), sum(r["total_s"] for r in ar_recs)
    ar_tps = ar_tokens / ar_s if ar_s > 0 else 0.0
    split = {k: sum(r[k] for r in recs) for k in ("draft_s", "tree_s", "verify_s", "other_s", "prefill_s")}
    checked = [r for r in recs if r["matches_ar"] is not None]
    return dict(
        method=variant.name, kind=variant.method, budget=variant.budget, prompts=len(recs), new_tokens=n_tokens,
        rounds=rounds,
        tau=sum(sum(r["accept_lengths"]) / max(1, len(r["accept_lengths"])) for r in recs) / max(1, len(recs)),
        tau_pooled=sum(sum(r["accept_lengths"]) for r in recs) / max(1, rounds),
        tokens_per_s=tps, speedup=tps / ar_tps if ar_tps > 0 else None,
        decode_s=decode_s, **split,
        draft_frac=split["draft_s"] / decode_s if decode_s > 0 else 0.0,
        tree_frac=split["tree_s"] / decode_s if decode_s > 0 else 0.0,
        verify_frac=split["verify_s"] / decode_s if decode_s > 0 else 0.0,
        other_frac=split["other_s"] / decode_s if decode_s > 0 else 0.0,
        mean_tree_size=sum(sum(r["tree_sizes"]) for r in recs) / tree_rounds if tree_rounds else None,
        checked=len(checked),  # prompts compared with AR (greedy only)
        mismatches=sum(not r["matches_ar"] for r in checked) if variant.method != "ar" else 0,
        mismatched_prompts=[r["prompt_index"] for r in checked if not r["matches_ar"]],
    )


def mean_over_datasets(aggregates: dict, variants: list[Variant]) -> dict:
    out = {}
    for v in variants:
        rows = [agg[v.name] for agg in aggregates.values() if v.name in agg]

        def mean(key):
            vals = [r[key] for r in rows if r[key] is not None]
            return sum(vals) / len(vals) if vals else None

        out[v.name] = dict(method=v.name, kind=v.method, budget=v.budget, datasets=len(rows),
                           prompts=sum(r["prompts"] for r in rows), new_tokens=sum(r["new_tokens"] for r in rows),
                           **{k: mean(k) for k in ("tau", "tau_pooled", "tokens_per_s", "speedup", "draft_frac", "tree_frac",
                                                   "verify_frac", "other_frac", "mean_tree_size", "draft_s", "verify_s",
                                                   "other_s", "prefill_s", "decode_s")},
                           checked=sum(r["checked"] for r in rows), mismatches=sum(r["mismatches"] for r in rows))
    return out


# ---- reports -----------------------------------------------------------------------------------


def _fmt(x, spec: str, none: str = "–") -> str:
    return none if x is None else format(x, spec)


def markdown_table(rows: dict, greedy: bool) -> str:
    head = ("| method | τ | tok/s | speedup | mean tree | draft | tree | verify | other | decode s | prefill s | mismatches |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows.values():
        mism = (f"{r['mismatches']}/{r['checked']}" if r["kind"] != "ar" else "ref") if greedy else "n/a"
        lines.append(f"| {r['method']} | {_fmt(r['tau'], '.2f')} | {_fmt(r['tokens_per_s'], '.1f')} | "
                     f"{_fmt(r['speedup'], '.2f')}× | {_fmt(r['mean_tree_size'], '.1f')} | "
                     f"{_fmt(r['draft_frac'], '.0%')} | {_fmt(r['tree_frac'], '.1%')} | {_fmt(r['verify_frac'], '.0%')} | "
                     f"{_fmt(r['other_frac'], '.0%')} | "
                     f"{_fmt(r['decode_s'], '.2f')} | {_fmt(r['prefill_s'], '.2f')} | {mism} |")
    return "\n".join(lines)


def markdown_report(results: dict) -> str:
    cfg = results["config"]
    greedy = cfg["sampling"]["greedy"]
    s = cfg["sampling"]
    sampling = "greedy" if greedy else f"temperature {s['temperature']}, top-p {s['top_p']}, top-k {s['top_k']}, seed {s['seed']}"
    parts = [
        "# drafttree bench: decoding methods",
        "",
        f"model `{cfg.get('model', '?')}` ({cfg.get('compute', cfg.get('dtype', '?'))}, {cfg.get('threads', '?')} threads), "
        f"drafter `{cfg.get('drafter', '?')}`, {sampling}, max {cfg['max_new_tokens']} new tokens, "
        f"prompts: {', '.join(f'{k} {v}' for k, v in cfg['prompts'].items())}.",
        "",
        "τ: mean over prompts of the per-prompt mean acceptance length (accepted draft tokens + bonus per round). "
        "tok/s: total new tokens / total decode time (prefill excluded, shown separately). "
        "speedup: tok/s ÷ AR's tok/s on the same prompts in this run (methods interleaved per prompt). "
        "draft / verify / other: shares of decode time. mean tree: draft nodes verified per round. "
        "mismatches: prompts whose tokens differ from AR's (greedy only; must be 0).",
    ]
    for ds, rows in results["aggregates"].items():
        parts += ["", f"## {ds}", "", markdown_table(rows, greedy)]
    if len(results["aggregates"]) > 1:
        parts += ["", "## mean over datasets", "",
                  "Unweighted mean of the per-dataset values (speedup: mean of per-dataset speedups); "
                  "decode/prefill seconds are per-dataset means; mismatches are summed.", "",
                  markdown_table(results["mean_over_datasets"], greedy)]
    return "\n".join(parts) + "\n"


def mismatch_lines(results: dict) -> list[str]:
    if not results["config"]["sampling"]["greedy"]:
        return ["lossless check: skipped (sampling; tokens are compared with AR in greedy mode only)"]
    lines = []
    for name, r in results["mean_over_datasets"].items():
        if r["kind"] == "ar":
            continue
        where = "; ".join(f"{ds}: prompts {agg[name]['mismatched_prompts']}"
                          for ds, agg in results["aggregates"].items() if agg[name]["mismatches"])
        lines.append(f"mismatches vs AR: {name}: {r['mismatches']}/{r['checked']}" + (f" ({where})" if where else ""))
    return lines


# ---- plots -------------------------------------------------------------------------------------


def _figure(w=7.0, h=4.5):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: leaves the global backend alone

    fig = Figure(figsize=(w, h))
    FigureCanvasAgg(fig)
    return fig


def plot_vs_budget(results: dict, key: str, ylabel: str, path: Path) -> None:
    """One line per dataset (and the mean) over ddtree budgets (lookup-ddtree dashed); CaDDTree, chain and lookup
    as points at their mean tree size."""
    fig = _figure(10.0, 4.8)
    ax = fig.add_subplot(1, 1, 1)
    series = dict(results["aggregates"])
    if len(series) > 1:
        series["mean"] = results["mean_over_datasets"]
    for i, (ds, rows) in enumerate(series.items()):
        color = "black" if ds == "mean" else f"C{i % 10}"
        for kind, style in (("ddtree", "o-"), ("lookup-ddtree", "s--"), ("weaver-ddtree", "D-.")):
            dd = sorted((r["budget"], r[key]) for r in rows.values() if r["kind"] == kind and r[key] is not None)
            if dd:
                ax.plot([b for b, _ in dd], [y for _, y in dd], style, color=color, label=f"{ds}: {kind}",
                        lw=2 if ds == "mean" else 1.2)
        for r in rows.values():
            if r["kind"] in POINT_MARKERS and r[key] is not None and r["mean_tree_size"]:
                marker = POINT_MARKERS[r["kind"]]
                ax.scatter([r["mean_tree_size"]], [r[key]], marker=marker, s=60 if marker in "^v" else 160, color=color,
                           edgecolor="black", zorder=5, label=f"{ds}: {r['kind']} (mean tree {r['mean_tree_size']:.1f})")
        if key == "tokens_per_s" and "ar" in rows and rows["ar"][key]:
            ax.axhline(rows["ar"][key], color=color, ls=":", lw=1, label=f"{ds}: ar")
        if key == "speedup":
            ax.axhline(1.0, color="gray", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft-tree nodes per round (ddtree: budget; caddtree/chain: mean size)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)


def plot_tree_sizes(results: dict, path: Path) -> None:
    """CaDDTree's chosen tree size per round, one histogram per dataset."""
    from matplotlib.ticker import MaxNLocator

    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    by_ds = {}
    for r in results["records"]:
        if r["kind"] in COST_AWARE:
            label = r["dataset"] if r["kind"] == "caddtree" else f"{r['dataset']} ({r['kind']})"
            by_ds.setdefault(label, []).extend(r["tree_sizes"])
    top = max((max(v) for v in by_ds.values() if v), default=1)
    bins = range(0, top + 2)
    ax.hist(list(by_ds.values()), bins=bins, label=[f"{ds} (mean {sum(v) / max(1, len(v)):.1f})" for ds, v in by_ds.items()],
            align="left", stacked=True)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft nodes in the verified tree")
    ax.set_ylabel("rounds (stacked by dataset)")
    ax.set_title("CaDDTree: chosen tree size per round")
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)


def plot_accept_lengths(results: dict, path: Path) -> None:
    """Share of rounds per acceptance length (accepted + bonus), one panel per speculative method, all datasets."""
    from matplotlib.ticker import MaxNLocator

    names = [n for n, r in results["mean_over_datasets"].items() if r["kind"] != "ar"]
    cols = min(3, len(names))
    rows_n = (len(names) + cols - 1) // cols
    fig = _figure(4.0 * cols, 3.0 * rows_n)
    for k, name in enumerate(names):
        ax = fig.add_subplot(rows_n, cols, k + 1)
        lengths = [a for r in results["records"] if r["method"] == name for a in r["accept_lengths"]]
        if lengths:
            top = max(lengths)
            ax.hist(lengths, bins=range(1, top + 2), align="left", weights=[1 / len(lengths)] * len(lengths),
                    color=f"C{k % 10}")
            ax.axvline(sum(lengths) / len(lengths), color="black", ls="--", lw=1)
        tau = results["mean_over_datasets"][name]["tau_pooled"]
        ax.set_title(f"{name} (τ pooled {_fmt(tau, '.2f')})", fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("tokens per round")
        ax.set_ylabel("share of rounds")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)


def write_outputs(results: dict, out: Path, log=print) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "results.md"]
    atomic_write_text(written[0], json.dumps(results, indent=1))
    atomic_write_text(written[1], markdown_report(results))
    kinds = {r["kind"] for r in results["mean_over_datasets"].values()}
    if kinds & {*BUDGETED, *POINT_MARKERS}:
        for key, label, name in (("tau", "τ (mean acceptance length)", "tau_vs_budget.png"),
                                 ("tokens_per_s", "tokens/s (decode)", "tokens_per_s_vs_budget.png"),
                                 ("speedup", "speedup over AR", "speedup_vs_budget.png")):
            plot_vs_budget(results, key, label, out / name)
            written.append(out / name)
        plot_accept_lengths(results, out / "accept_lengths.png")
        written.append(out / "accept_lengths.png")
    if kinds & set(COST_AWARE):
        plot_tree_sizes(results, out / "caddtree_tree_sizes.png")
        written.append(out / "caddtree_tree_sizes.png")
    log(f"wrote {', '.join(str(p) for p in written)} (+ records.jsonl)")
    return written


# ---- command line ------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name, checkpoint directory or .gguf file")
    add_compute_argument(p)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma list of {', '.join(METHODS)} (ar always runs: it is the reference)")
    p.add_argument("--budgets", "--budget", dest="budgets", default="16",
                   help="ddtree (and lookup-ddtree) node budgets, comma list (e.g. 4,8,16,32,64,128)")
    p.add_argument("--max-tree-nodes", type=int, default=128, help="caddtree's tree-size cap")
    p.add_argument("--cost-model", default=None,
                   help="caddtree's cost model JSON (default: this machine's cached one, profiled on first use)")
    from ...methods import add_drafter_args, add_weaver_args

    add_drafter_args(p)
    add_weaver_args(p)
    p.add_argument("--datasets", "--sets", dest="datasets", default=",".join(DEFAULT_DATASETS),
                   help=f"comma list of {', '.join(DATASETS)} (default: {','.join(DEFAULT_DATASETS)})")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each dataset")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (and the lossless check against AR)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (prompt k uses seed + k, for every method)")
    p.add_argument("--warmup-tokens", type=int, default=8, help="untimed warm-up generation per method (0: none)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run(args) -> int:
    """Returns 0, or 1 when a greedy run found a method whose tokens differ from AR's."""
    from ...datasets import load_prompts
    from ...load import load_target
    from ...methods import load_drafter_for, load_or_profile_cost_model

    datasets = parse_datasets(args.datasets)  # validate everything before loading anything
    if not datasets:
        raise InputError(f"--datasets is empty: name at least one of {', '.join(DATASETS)}")
    for name in ("limit", "max_new_tokens"):
        if getattr(args, name) is not None:
            check_positive_int("--" + name.replace("_", "-"), getattr(args, name))
    if not args.methods.strip(", "):
        raise InputError(f"--methods is empty: name at least one of {', '.join(METHODS)}")
    variants = parse_variants(args.methods, args.budgets)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    prompts = {d: load_prompts(d, args.limit) for d in datasets}

    target = load_target(args.model, compute=compute_of(args), threads=args.threads)
    speculative = [v for v in variants if v.method not in NO_DRAFTER]  # `lookup` runs without one
    drafter = load_drafter_for(target, args.drafter, args.draft_vocab) if speculative else None
    cost_model, cost_model_src = None, None
    if any(v.method in COST_AWARE for v in variants):
        from ...costmodel import VerifyCostModel

        if args.cost_model:
            cost_model, cost_model_src = VerifyCostModel.load(args.cost_model), str(args.cost_model)
        else:
            from ...methods import cost_model_path

            cost_model = load_or_profile_cost_model(target, drafter)
            cost_model_src = str(cost_model_path(target))
    config = dict(model=target.name, compute=target.compute_label, threads=torch.get_num_threads(),
                  drafter=str(args.drafter) if args.drafter else ("shipped" if drafter is not None else None),
                  cost_model=cost_model_src, weaver=(str(args.weaver) if getattr(args, "weaver", None) else "shipped") if any(
                      v.method.startswith("weaver-") for v in variants) else None,
                  weaver_width=getattr(args, "weaver_width", 8),
                  datasets=datasets, limit=args.limit, torch=torch.__version__,
                  python=platform.python_version(), machine=platform.machine(), processor=platform.processor() or None,
                  cpu_count=os.cpu_count(), git_commit=_git_commit(),
                  started=datetime.datetime.now().isoformat(timespec="seconds"))
    print(f"drafttree bench: {target.name} ({target.compute_label}, {torch.get_num_threads()} threads); methods "
          f"{', '.join(v.name for v in variants)}; {', '.join(f'{d} {len(p)}' for d, p in prompts.items())} prompts",
          file=sys.stderr)
    results = benchmark(target, prompts, [v.method for v in variants], drafter=drafter, budgets=args.budgets,
                        max_new_tokens=args.max_new_tokens, sampling=sampling, cost_model=cost_model,
                        max_tree_nodes=args.max_tree_nodes, chat=not args.no_chat, warmup_tokens=args.warmup_tokens,
                        out_dir=args.out, progress=not args.no_progress, config=config,
                        log=lambda m: print(m, file=sys.stderr), weaver=getattr(args, "weaver", None),
                        weaver_width=getattr(args, "weaver_width", 8))
    print(markdown_report(results))
    lines = mismatch_lines(results)
    for line in lines:
        print(line)
    failed = any(r["mismatches"] for r in results["mean_over_datasets"].values())
    if failed:
        print("drafttree bench: LOSSLESS CHECK FAILED: some method's greedy tokens differ from AR's", file=sys.stderr)
    return 1 if failed else 0
