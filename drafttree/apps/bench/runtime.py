"""`drafttree bench-runtime`: the lean runtime against transformers, and its forward-cost curve.

1. Autoregressive tokens/s of drafttree's `generate_ar` vs transformers' `generate()` (greedy, no
   compilation, same converted weights), fp32 and bf16, on real chat prompts (gsm8k / humaneval /
   mtbench in turn). EOS is ignored by both so every run produces exactly `max_new_tokens`; for each
   prompt the four configurations run back to back (in a rotating order) so machine noise hits all
   alike. Times are wall clock for the whole call, prefill included, for both libraries.
2. The floor of a decode step in eager PyTorch: one `F.linear` of a single row with every weight
   matrix of the model (the LM head included), nothing else. A decode step cannot beat it without
   fewer weight bytes (quantization) or fused kernels; both libraries' ms/token are shown against it.
3. The forward-cost curve of the runtime: milliseconds of one `forward` over n new tokens (chain
   mask, logits for every row, as tree verification needs them) on top of a committed context.

Usage: `drafttree bench-runtime [--prompts 5] [--max-new-tokens 256] [--threads 2] [--quick]`.
Writes results.json, results.md and cost_curve.png under --out.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ...atomic import atomic_path, atomic_write_text

PROMPT_SETS = ("gsm8k", "humaneval", "mtbench")
DTYPE_NAMES = ("float32", "bfloat16")
SHORT = {"float32": "fp32", "bfloat16": "bf16"}
SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXTS = (256, 1024)


# ---------------------------------------------------------------------------------------------- prompts
def pick_prompts(n: int) -> list[tuple[str, str]]:
    """(set name, user message) for n prompts, taking the sets in turn (first items of each)."""
    from ...datasets import load_prompts

    per_set = {name: load_prompts(name, limit=(n + len(PROMPT_SETS) - 1) // len(PROMPT_SETS)) for name in PROMPT_SETS}
    return [(PROMPT_SETS[k % 3], per_set[PROMPT_SETS[k % 3]][k // 3]) for k in range(n)]


# ------------------------------------------------------------------------------------------ AR decoding
def load_hf(path, dtype: str, attn: str = "eager"):
    """transformers' own model on a checkpoint directory (the converted weights drafttree loads too)."""
    from transformers import AutoModelForCausalLM

    from ...load import resolve_dtype

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(dtype), attn_implementation=attn).eval()


def run_drafttree_ar(target, ids: torch.Tensor, max_new: int) -> tuple[list[int], float]:
    from ...engine import generate_ar

    t0 = time.perf_counter()
    res = generate_ar(target, ids, max_new, stop_token_ids=())
    return res.tokens, time.perf_counter() - t0


def run_hf_ar(model, ids: torch.Tensor, max_new: int) -> tuple[list[int], float]:
    inp = ids[None]
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new, min_new_tokens=max_new,
                             do_sample=False, eos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    dt = time.perf_counter() - t0
    return out[0, ids.numel():].tolist(), dt


def agree_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def bench_ar(runners: dict[str, tuple[str, object]], prompts: list[torch.Tensor], max_new: int,
             warmup_tokens: int = 8, progress: bool = True) -> dict:
    """Interleaved AR timing.

    `runners`: config name -> ("drafttree", Target) or ("transformers", model). Configs are run back
    to back for each prompt, their order rotated from prompt to prompt. Returns per-config and
    per-prompt numbers; every run must produce exactly `max_new` tokens.
    """
    fns = {"drafttree": run_drafttree_ar, "transformers": run_hf_ar}
    names = list(runners)
    for name in names:  # warm-up: allocator, thread pools, first-call paths
        lib, obj = runners[name]
        fns[lib](obj, prompts[0], warmup_tokens)
    per_prompt = []
    bar = tqdm(total=len(prompts) * len(names), desc="AR tokens/s", unit="run", disable=not progress)
    for i, ids in enumerate(prompts):
        row = {"prompt_tokens": int(ids.numel()), "seconds": {}, "tokens": {}}
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            lib, obj = runners[name]
            bar.set_postfix_str(name)
            tokens, dt = fns[lib](obj, ids, max_new)
            if len(tokens) != max_new:
                raise RuntimeError(f"{name} produced {len(tokens)} tokens instead of {max_new}")
            row["seconds"][name] = dt
            row["tokens"][name] = tokens
            bar.update(1)
        per_prompt.append(row)
    bar.close()
    configs = {}
    for name in names:
        secs = [r["seconds"][name] for r in per_prompt]
        configs[name] = dict(
            library=runners[name][0], tokens=max_new * len(per_prompt), seconds=sum(secs),
            tokens_per_s=max_new * len(per_prompt) / sum(secs),
            median_tokens_per_s=statistics.median(max_new / s for s in secs),
        )
    # greedy agreement between the two libraries at the same dtype (fp32 should agree on long prefixes)
    for row in per_prompt:
        row["agree_prefix"] = {}
        for d in DTYPE_NAMES:
            a, b = f"drafttree-{SHORT[d]}", f"transformers-{SHORT[d]}"
            if a in row["tokens"] and b in row["tokens"]:
                row["agree_prefix"][SHORT[d]] = agree_prefix(row["tokens"][a], row["tokens"][b])
        row.pop("tokens")
    return dict(max_new_tokens=max_new, configs=configs, per_prompt=per_prompt, ratios=ar_ratios(configs))


def ar_ratios(configs: dict) -> dict:
    out = {}
    for d in DTYPE_NAMES:
        a, b = configs.get(f"drafttree-{SHORT[d]}"), configs.get(f"transformers-{SHORT[d]}")
        if a and b:
            out[f"drafttree/transformers {SHORT[d]}"] = a["tokens_per_s"] / b["tokens_per_s"]

    def best(lib):
        cands = [(c["tokens_per_s"], n) for n, c in configs.items() if c["library"] == lib]
        return max(cands) if cands else None

    bd, bh = best("drafttree"), best("transformers")
    if bd and bh:
        out["drafttree/transformers, each at its faster dtype"] = bd[0] / bh[0]
        out["faster dtype"] = {"drafttree": bd[1].split("-")[1], "transformers": bh[1].split("-")[1]}
    return out


# ------------------------------------------------------------------------------------ weight floor
@torch.inference_mode()
def weight_floor(model, repeats: int = 7) -> dict:
    """ms of one single-row `F.linear` with every weight matrix (each tensor once: a tied head counts
    once), median over repeats: the matmul work of one decode step with nothing around it."""
    weights, seen = [], set()
    for name, w in model.named_parameters():
        if w.dim() == 2 and w.data_ptr() not in seen:
            seen.add(w.data_ptr())
            weights.append(w)
    xs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights}
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)
        if r:
            times.append((time.perf_counter() - t0) * 1e3)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    ms = statistics.median(times)
    return dict(ms=ms, weight_mb=nbytes / 1e6, gb_per_s=nbytes / ms / 1e6, tokens_per_s=1e3 / ms)


# ------------------------------------------------------------------------------------ forward-cost curve
def forward_cost_curve(target, contexts=CONTEXTS, sizes=SIZES, repeats: int = 5, warmup: int = 1,
                       progress: bool = True, seed: int = 0) -> list[dict]:
    """Median ms of one `forward` over n new tokens (chain mask, logits for all rows) after ctx committed tokens.

    The n = 1 point is the AR decode step (no mask). Nothing is committed between repeats, so every
    repeat sees the same context. Returns rows {context, tokens, ms, ms_all, ratio_to_1}.
    """
    model = target.model
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    rows = []
    bar = tqdm(total=len(contexts) * len(sizes), desc=f"forward cost {SHORT.get(str(model.dtype)[6:], model.dtype)}",
               unit="pt", disable=not progress)
    for ctx in contexts:
        state = model.new_state(ctx + max(sizes) + 1)
        if ctx:
            model.prefill(state, torch.randint(0, vocab, (ctx,), generator=gen))
        base = None
        for n in sizes:
            tokens = torch.randint(0, vocab, (n,), generator=gen)
            mask = None if n == 1 else torch.ones(n, n, dtype=torch.bool).tril_()
            times = []
            for r in range(warmup + repeats):
                t0 = time.perf_counter()
                out = model.forward(state, tokens, tree_mask=mask)  # uncommitted: the context stays ctx long
                dt = time.perf_counter() - t0
                if r >= warmup:
                    times.append(dt * 1e3)
            assert out.logits.shape[0] == n
            ms = statistics.median(times)
            base = ms if n == sizes[0] else base
            rows.append(dict(context=ctx, tokens=n, ms=ms, ms_all=times, ratio_to_1=ms / base))
            bar.update(1)
    bar.close()
    return rows


# ---------------------------------------------------------------------------------------------- outputs
def plot_curves(curves: dict[str, list[dict]], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: leaves the global backend alone
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    ax_ms, ax_ratio = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for dtype, rows in curves.items():
        for ctx in sorted({r["context"] for r in rows}):
            pts = [r for r in rows if r["context"] == ctx]
            label = f"{dtype}, context {ctx}"
            style = "-" if dtype == "bf16" else "--"
            ax_ms.plot([r["tokens"] for r in pts], [r["ms"] for r in pts], style, marker="o", label=label)
            ax_ratio.plot([r["tokens"] for r in pts], [r["ratio_to_1"] for r in pts], style, marker="o", label=label)
    sizes = sorted({r["tokens"] for rows in curves.values() for r in rows})
    for ax, ylabel in ((ax_ms, "ms per forward"), (ax_ratio, "cost / cost of 1 token")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("new tokens per forward (chain mask, logits for all rows)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax_ms.set_title("forward cost")
    ax_ratio.set_title("relative to one token")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)


def markdown(results: dict) -> str:
    lines = [f"# bench-runtime: {results['model']}", "",
             f"{results['timestamp']} · {results['threads']} threads · torch {results['torch']} · "
             f"transformers {results['transformers']} · {results['cpu']}", ""]
    ar = results.get("ar")
    if ar:
        lines += [f"## AR decoding: {len(ar['per_prompt'])} prompts × {ar['max_new_tokens']} new tokens "
                  f"(greedy, EOS ignored, wall clock incl. prefill; transformers attention: {results['hf_attn']})", "",
                  "| config | tokens/s (total) | median tokens/s per prompt | ms/token |", "|---|---:|---:|---:|"]
        for name, c in ar["configs"].items():
            lines.append(f"| {name} | {c['tokens_per_s']:.1f} | {c['median_tokens_per_s']:.1f} | {1e3 / c['tokens_per_s']:.2f} |")
        lines += ["", "| ratio | value |", "|---|---:|"]
        for k, v in ar["ratios"].items():
            shown = ", ".join(f"{lib} {d}" for lib, d in v.items()) if isinstance(v, dict) else f"{v:.2f}×"
            lines.append(f"| {k} | {shown} |")
        lines += ["", "Per prompt (seconds; `agree` = greedy tokens identical between the libraries before the first difference):", ""]
        names = list(ar["configs"])
        lines += ["| # | set | prompt tokens | " + " | ".join(names) + " | agree fp32 | agree bf16 |",
                  "|---|---|---:|" + "---:|" * (len(names) + 2)]
        for i, row in enumerate(ar["per_prompt"]):
            secs = " | ".join(f"{row['seconds'][n]:.2f}" for n in names)
            ag = row["agree_prefix"]
            lines.append(f"| {i} | {row.get('set', '')} | {row['prompt_tokens']} | {secs} | {ag.get('fp32', '')} | {ag.get('bf16', '')} |")
        lines.append("")
    floor = results.get("weight_floor")
    if floor:
        lines += ["## The floor: one single-row `F.linear` per weight matrix (nothing else), median", "",
                  "| dtype | weights MB | floor ms | GB/s | floor tokens/s | drafttree ms/token | transformers ms/token |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for d, f in floor.items():
            cfg = (ar or {}).get("configs", {})
            mine, theirs = cfg.get(f"drafttree-{d}"), cfg.get(f"transformers-{d}")
            ms = lambda c: f"{1e3 / c['tokens_per_s']:.2f}" if c else "–"
            lines.append(f"| {d} | {f['weight_mb']:.0f} | {f['ms']:.2f} | {f['gb_per_s']:.1f} | {f['tokens_per_s']:.1f} | "
                         f"{ms(mine)} | {ms(theirs)} |")
        lines.append("")
    curves = results.get("curves")
    if curves:
        lines += [f"## Forward cost of the runtime (median of {results['repeats']} repeats; chain mask, logits for all rows)", ""]
        contexts = sorted({r["context"] for rows in curves.values() for r in rows})
        head = [f"{d} ctx {c}" for d in curves for c in contexts]
        lines += ["| new tokens | " + " | ".join(f"{h} ms | ×1" for h in head) + " |",
                  "|---:|" + "---:|---:|" * len(head)]
        sizes = sorted({r["tokens"] for rows in curves.values() for r in rows})
        for n in sizes:
            cells = []
            for d, rows in curves.items():
                for c in contexts:
                    r = next((r for r in rows if r["context"] == c and r["tokens"] == n), None)
                    cells.append(f"{r['ms']:.2f} | {r['ratio_to_1']:.2f}" if r else " | ")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines += ["", "![cost curves](cost_curve.png)", ""]
    return "\n".join(lines)


def write_outputs(results: dict, out_dir) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md"}
    atomic_write_text(paths["json"], json.dumps(results, indent=2))
    if results.get("curves"):
        paths["png"] = out / "cost_curve.png"
        plot_curves(results["curves"], paths["png"])
    atomic_write_text(paths["md"], markdown(results))
    return paths


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _ints(s, option: str = "", minimum: int = 0) -> tuple[int, ...]:
    from ...validate import InputError

    try:
        values = tuple(int(x) for x in str(s).split(",") if x.strip())
    except ValueError:
        raise InputError(f"{option} must be comma-separated integers, got {s!r}") from None
    if not values or min(values) < minimum:
        raise InputError(f"{option} must list integers >= {minimum}, got {s!r}")
    return values


CURVE_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "bfloat16": "bfloat16", "float32": "float32"}


def check_arguments(args) -> tuple[tuple[int, ...], tuple[int, ...], list[str]]:
    """(contexts, sizes, curve dtypes) of the forward-cost curve, checked before any model is converted or
    loaded: a size of 0 or an unknown dtype would otherwise fail after the AR comparison's minutes."""
    from ...validate import InputError

    def given(name, default):  # None: not given, the default; an empty string was given and is refused below
        value = getattr(args, name, None)
        return default if value is None else value

    quick = getattr(args, "quick", False)
    contexts = _ints(given("contexts", "256" if quick else "256,1024"), "--contexts", 0)
    sizes = _ints(given("sizes", ",".join(map(str, SIZES))), "--sizes", 1)
    dtypes = given("curve_dtypes", "bf16,fp32")
    curve_dtypes = [d.strip() for d in str(dtypes).split(",") if d.strip()]
    bad = [d for d in curve_dtypes if d not in CURVE_DTYPES]
    if bad or not curve_dtypes:
        raise InputError(f"--curve-dtypes {dtypes!r}: choose from bf16, fp32" +
                         (f" ({', '.join(bad)} is not measured)" if bad else ""))
    if getattr(args, "skip_ar", False) and getattr(args, "skip_curve", False):
        raise InputError("--skip-ar with --skip-curve leaves nothing to measure: drop one of them")
    return contexts, sizes, curve_dtypes


# ------------------------------------------------------------------------------------------------ CLI
def run(args) -> int:
    contexts, sizes, curve_dtypes = check_arguments(args)
    import transformers

    from ...gguf_convert import EMBEDDED, convert_embedded
    from ...load import load_target

    model_name = getattr(args, "model", None) or "smollm2-135m-instruct"
    quick = getattr(args, "quick", False)
    n_prompts = 2 if quick and args.prompts == 5 else args.prompts
    max_new = 32 if quick and args.max_new_tokens == 256 else args.max_new_tokens
    repeats = getattr(args, "repeats", None) or (3 if quick else 7)
    hf_attn = getattr(args, "hf_attn", None) or "eager"
    skip_ar, skip_curve = getattr(args, "skip_ar", False), getattr(args, "skip_curve", False)
    threads = args.threads
    torch.set_num_threads(threads)
    path = convert_embedded(model_name) if model_name in EMBEDDED else Path(model_name)

    targets = {d: load_target(str(path) if model_name not in EMBEDDED else model_name, dtype=d, threads=threads)
               for d in DTYPE_NAMES}
    results = dict(model=model_name, checkpoint=str(path), threads=threads, torch=torch.__version__,
                   transformers=transformers.__version__, cpu=_cpu_name(), hf_attn=hf_attn, repeats=repeats,
                   timestamp=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                   omp_num_threads=os.environ.get("OMP_NUM_THREADS"), quick=bool(quick))
    if not skip_ar:
        chosen = pick_prompts(n_prompts)
        prompt_ids = [targets["float32"].encode_chat(text) for _, text in chosen]
        runners = {}
        for d in DTYPE_NAMES:
            runners[f"drafttree-{SHORT[d]}"] = ("drafttree", targets[d])
            runners[f"transformers-{SHORT[d]}"] = ("transformers", load_hf(path, d, hf_attn))
        torch.set_num_threads(threads)
        ar = bench_ar(runners, prompt_ids, max_new)
        for row, (name, _) in zip(ar["per_prompt"], chosen):
            row["set"] = name
        results["ar"] = ar
        del runners
        results["weight_floor"] = {SHORT[d]: weight_floor(targets[d].model, repeats) for d in DTYPE_NAMES}
    if not skip_curve:
        results["curves"] = {}
        for d in curve_dtypes:
            full = CURVE_DTYPES[d]
            results["curves"][SHORT[full]] = forward_cost_curve(targets[full], contexts, sizes, repeats=repeats)
    paths = write_outputs(results, args.out)
    print(markdown(results))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
