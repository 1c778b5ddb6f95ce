"""`drafttree bench-peers`: drafttree's methods beside llama.cpp (AR and prompt-lookup decoding) and
transformers (AR) on the same prompts, in the same run, interleaved in a seeded random order per prompt.

Every system decodes greedily with the stop token honoured; tokens/s counts the generated tokens over
the decode time after the first token (prefill excluded; transformers' time includes its prefill).
The report also gives the machine's ISA, its memory bandwidth, and the weight-streaming floor per token
of each weight format (bytes a token must read ÷ bandwidth).
"""
from __future__ import annotations

import json
import platform
import random
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ...atomic import atomic_path, atomic_write_text
from ...compute import add_compute_argument, compute_of, cpu_info

DEFAULT_OUT = "docs/bench-peers"


def read_bandwidth_gbs(mib: int = 1024, repeats: int = 5) -> float:
    """Large-array read bandwidth with torch's threads (a sum over `mib` MiB of float32)."""
    a = torch.ones(mib * 2**18)
    a.sum()
    t0 = time.perf_counter()
    for _ in range(repeats):
        a.sum()
    return a.numel() * 4 * repeats / (time.perf_counter() - t0) / 1e9


def streaming_floors_ms(n_weights: int, gguf_bytes: int, bandwidth_gbs: float) -> dict[str, float]:
    per_weight = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "gguf (Q4_1 file)": gguf_bytes / n_weights}
    return {k: n_weights * b / (bandwidth_gbs * 1e9) * 1e3 for k, b in per_weight.items()}


class LlamaCpp:
    """llama.cpp through llama-cpp-python on the model's GGUF; `lookup` > 0 adds prompt-lookup drafts."""

    def __init__(self, gguf: Path, threads: int, lookup: int = 0):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
        self.llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=4096,
                         draft_model=draft, verbose=False)
        self.name = f"llama.cpp-lookup-{lookup}" if lookup else "llama.cpp-ar"
        self.evals = 0  # target forwards (Llama.eval calls): the prompt's, then one per verified draft or token
        evaluate = self.llm.eval

        def counted(tokens):
            self.evals += 1
            return evaluate(tokens)

        self.llm.eval = counted

    def run(self, ids: list[int], max_new: int, stop: int) -> tuple[int, float, tuple[int, int]]:
        n, t_first = 0, None
        for tok in self.llm.generate(ids, top_k=1, temp=0.0, reset=True):
            if t_first is None:  # the prompt's forward gave the first token; the clock and the forwards start here
                t_first, self.evals = time.perf_counter(), 0
            n += 1
            if tok == stop or n >= max_new:
                break
        return n, time.perf_counter() - t_first, (n - 1, self.evals)


class LlamaCppSpeculative:
    """llama.cpp's own speculative loop (`llama-speculative-simple --spec-type ...`, llama_tools), one process a
    prompt: its decode clock and target forwards from its log (model loading and the prompt's forward excluded)."""

    def __init__(self, binary: Path, gguf: Path, threads: int, tokenizer, name: str, spec_args: list[str]):
        self.binary, self.gguf, self.threads, self.tokenizer = binary, gguf, threads, tokenizer
        self.name, self.spec_args = name, spec_args

    def run(self, ids: list[int], max_new: int, stop: int) -> tuple[int, float, tuple[int, int]]:
        from .llama_tools import run_speculative

        prompt = self.tokenizer.decode(ids, skip_special_tokens=False)  # it tokenizes special tokens back
        out = run_speculative(self.binary, self.gguf, prompt, max_new, self.threads, self.spec_args)
        return out.tokens, out.seconds, (out.tokens, out.forwards)


# llama.cpp's n-gram speculator: its defaults (drafts of 48-64 tokens after a 24-token match, sized for MoEs on GPUs)
# and, as its docs/speculative.md suggests for dense models, shorter drafts (2-16) after shorter matches (12)
NGRAM_MOD = {"llama.cpp-ngram-mod": ["--spec-type", "ngram-mod"],
             "llama.cpp-ngram-mod-m12-d16": ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "12",
                                             "--spec-ngram-mod-n-min", "2", "--spec-ngram-mod-n-max", "16"]}


# llama.cpp's DFlash loop with drafttree's shipped drafter (llama_dflash: exported through llama.cpp's converter, in
# Q8_0 like drafttree's int8 drafter): whole blocks (15 drafted tokens, the trained block) and the shortest chains that
# were its fastest on a Zen 3 (one GSM8K prompt, 128 tokens: 15 / 6 / 3 drafted = 23 / 38 / 62 tok/s, f16 no faster)
DFLASH = {"llama.cpp-draft-dflash-15": ["--spec-type", "draft-dflash", "--spec-draft-n-max", "15"],
          "llama.cpp-draft-dflash-3": ["--spec-type", "draft-dflash", "--spec-draft-n-max", "3"]}


class Transformers:
    name = "transformers-ar"

    def __init__(self, path: Path, dtype: str):
        from .runtime import load_hf

        self.model = load_hf(path, dtype, attn="sdpa")

    def run(self, ids: list[int], max_new: int, stop: int) -> tuple[int, float, tuple[int, int]]:
        inp = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new, do_sample=False,
                                      eos_token_id=stop, pad_token_id=stop, temperature=None, top_p=None, top_k=None)
        n = out.shape[1] - len(ids)
        return n, time.perf_counter() - t0, (n - 1, n - 1)


class Drafttree:
    def __init__(self, target, method: str, proposer):
        self.target, self.method, self.proposer = target, method, proposer
        self.name = f"drafttree-{method}"

    def run(self, ids: list[int], max_new: int, stop: int) -> tuple[int, float, tuple[int, int]]:
        from ...methods import generate

        res = generate(self.method, self.target, torch.tensor(ids), max_new, proposer=self.proposer, stop_token_ids=(stop,))
        return res.stats.new_tokens, res.stats.total_s, (sum(res.stats.accept_lengths), len(res.stats.accept_lengths))


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="an embedded model (llama.cpp needs its GGUF)")
    add_compute_argument(p)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--methods", default="ar,chain,ddtree,caddtree-online", help="drafttree methods")
    p.add_argument("--budget", type=int, default=8, help="ddtree's node budget")
    p.add_argument("--lookup", default="2,5", help="llama.cpp prompt-lookup draft lengths (empty: none)")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--ngram-mod", action="store_true", help="also llama.cpp's own ngram-mod speculative decoding "
                   "(builds llama-speculative-simple from the sdist's llama.cpp once, about ten minutes)")
    p.add_argument("--dflash", action="store_true", help="also llama.cpp's own DFlash loop (draft-dflash) with the "
                   "shipped drafter, exported through llama.cpp's converter (needs the peers extra; builds "
                   "llama-speculative-simple once)")
    p.add_argument("--datasets", default="gsm8k,humaneval,mtbench")
    p.add_argument("--limit", type=int, default=2, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="the per-prompt order of the systems")
    p.add_argument("--out", default=DEFAULT_OUT)


def _systems(args, target):
    from ...gguf_convert import EMBEDDED, convert_embedded, find_embedded_gguf
    from ...methods import make_proposer

    if args.model not in EMBEDDED:
        raise ValueError(f"bench-peers needs an embedded model with a GGUF ({', '.join(EMBEDDED)}), got {args.model!r}")
    try:
        import llama_cpp
    except ImportError:
        raise ValueError("llama.cpp is not installed: `pip install -e '.[peers]'` builds it (about 10 minutes)") from None
    _check_llama_cpp_build(Path(llama_cpp.__file__).parent / "lib")
    gguf = find_embedded_gguf(args.model)
    systems = [LlamaCpp(gguf, args.threads)]
    systems += [LlamaCpp(gguf, args.threads, int(k)) for k in str(args.lookup).split(",") if k.strip()]
    if args.ngram_mod or args.dflash:
        from .llama_tools import build_tool

        binary = build_tool()
        variants = dict(NGRAM_MOD) if args.ngram_mod else {}
        if args.dflash:
            from ...methods import SHIPPED_DRAFTERS
            from .llama_dflash import drafter_gguf

            drafter = drafter_gguf(SHIPPED_DRAFTERS[args.model], convert_embedded(args.model), outtype="q8_0")
            variants.update({name: [*spec, "-md", str(drafter)] for name, spec in DFLASH.items()})
        systems += [LlamaCppSpeculative(binary, gguf, args.threads, target.tokenizer, name, spec)
                    for name, spec in variants.items()]
    if not args.no_transformers:
        systems.append(Transformers(convert_embedded(args.model), "float32"))
    for m in [m.strip() for m in args.methods.split(",") if m.strip()]:
        systems.append(Drafttree(target, m, None if m == "ar" else make_proposer(m, target, budget=args.budget)))
    return systems, gguf


def _check_llama_cpp_build(lib: Path) -> None:
    """On an AMX CPU, a llama-cpp-python built natively carries ggml's AMX matmul, which dies with SIGILL there
    (llama_tools.NO_AMX): say how to rebuild it before a run is lost to the crash."""
    from .llama_tools import LLAMA_CPP_PYTHON, NATIVE, ggml_cpu_flags

    flags = ggml_cpu_flags()
    if flags == NATIVE:
        return
    if any(b"ggml_backend_amx_mul_mat" in f.read_bytes() for f in lib.glob("libggml-cpu*.so*")):
        rebuild = (f'CMAKE_ARGS="{" ".join(flags)}" pip install --force-reinstall --no-deps --no-cache-dir '
                   f"llama-cpp-python=={LLAMA_CPP_PYTHON}")
        raise ValueError(f"llama-cpp-python in {lib.parent} carries ggml's AMX matmul, which dies with SIGILL on "
                         f"this CPU: rebuild it without (about 10 minutes): {rebuild}")


def run(args) -> int:
    from ..bench.methods import parse_datasets
    from ...datasets import load_prompts
    from ...load import load_target

    datasets = parse_datasets(args.datasets)
    target = load_target(args.model, compute=compute_of(args), threads=args.threads)
    systems, gguf = _systems(args, target)
    stop = target.tokenizer.eos_token_id
    prompts = [(d, target.encode_chat(p).tolist()) for d in datasets for p in load_prompts(d, args.limit)]
    for s in systems:  # warm-up: first calls pay one-off costs
        s.run(prompts[0][1][:16], 8, stop)
    rng, rows = random.Random(args.seed), []
    for i, (dataset, ids) in enumerate(tqdm(prompts, desc="prompts", file=sys.stderr)):
        for s in rng.sample(systems, len(systems)):
            n, dt, (verified, forwards) = s.run(ids, args.max_new_tokens, stop)
            rows.append(dict(dataset=dataset, prompt=i, system=s.name, tokens=n, seconds=dt, verified=verified,
                             forwards=forwards))
    n_weights = sum(p.numel() for p in load_target(args.model).model.parameters())
    bandwidth = read_bandwidth_gbs()
    cpu = cpu_info()
    results = dict(
        config=dict(model=args.model, compute=target.compute_label, compute_reason=target.compute.reason,
                    threads=args.threads, cpu=cpu.model, isa=cpu.isa_summary, torch=torch.__version__,
                    llama_cpp=_version("llama-cpp-python"), python=platform.python_version(),
                    datasets=datasets, limit=args.limit, max_new_tokens=args.max_new_tokens),
        bandwidth_gbs=bandwidth, floors_ms=streaming_floors_ms(n_weights, gguf.stat().st_size, bandwidth),
        rows=rows, table=summarize(rows, [s.name for s in systems], datasets))
    write_outputs(results, Path(args.out))
    print(markdown(results))
    return 0


def summarize(rows: list[dict], systems: list[str], datasets: list[str]) -> dict:
    """tokens/s per system per set (all tokens ÷ all seconds), each one's ratio to llama.cpp AR, and τ: the tokens
    the target forwards after the prompt's emitted, per forward (rows without those counts, from older files: None)."""
    table = {}
    for d in [*datasets, "all"]:
        sel = [r for r in rows if d == "all" or r["dataset"] == d]
        total = {s: {k: sum(r.get(k, 0) for r in sel if r["system"] == s)
                     for k in ("tokens", "seconds", "verified", "forwards")}
                 for s in systems}
        tps = {s: t["tokens"] / max(1e-9, t["seconds"]) for s, t in total.items()}
        base = tps.get("llama.cpp-ar") or float("nan")
        table[d] = {s: dict(tokens_per_s=v, vs_llama_cpp=v / base,
                            tau=total[s]["verified"] / total[s]["forwards"] if total[s]["forwards"] else None)
                    for s, v in tps.items()}
    return table


def markdown(results: dict) -> str:
    c, table = results["config"], results["table"]
    sets = list(table)
    lines = [f"# drafttree vs peers — {c['model']}, {c['threads']} threads", "",
             f"CPU: {c['cpu']}; ISA: {c['isa']}. drafttree compute path: {c['compute']} ({c['compute_reason']}).",
             f"torch {c['torch']}, llama-cpp-python {c['llama_cpp']}; {c['limit']} prompts per set, "
             f"≤ {c['max_new_tokens']} new tokens, greedy, stop token honoured.", "",
             f"Memory bandwidth {results['bandwidth_gbs']:.1f} GB/s; weight-streaming floor per token: "
             + ", ".join(f"{k} {v:.1f} ms" for k, v in results["floors_ms"].items()) + ".", "",
             "tokens/s (× llama.cpp AR, τ = tokens per target forward), measured side by side in one run:", "",
             "| system | " + " | ".join(sets) + " |", "|---|" + "---:|" * len(sets)]
    for s in table["all"]:
        lines.append(f"| {s} | " + " | ".join(_cell(table[d][s]) for d in sets) + " |")
    return "\n".join(lines) + "\n"


def _cell(entry: dict) -> str:
    tau = entry.get("tau")
    return f"{entry['tokens_per_s']:.1f} ({entry['vs_llama_cpp']:.2f}×{'' if tau is None else f', τ {tau:.2f}'})"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = results["table"]
    sets, systems = list(table), list(table["all"])
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(systems)), 4.5))
    width = 0.8 / len(sets)
    for k, d in enumerate(sets):
        ax.bar([i + k * width for i in range(len(systems))], [table[d][s]["tokens_per_s"] for s in systems], width, label=d)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(systems))], systems, rotation=30, ha="right")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{results['config']['model']}, {results['config']['threads']} threads, {results['config']['isa']}",
                 fontsize=8)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def write_outputs(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", json.dumps(results, indent=1))
    atomic_write_text(out / "results.md", markdown(results))
    plot(results, out / "tokens_per_s.png")


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None
