"""Command line: `drafttree generate|demo|bench-runtime|...`."""
from __future__ import annotations

import argparse
import sys
import time

from ..compute import add_compute_argument, compute_of
from ..methods import METHODS, add_drafter_args, add_weaver_args


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name, checkpoint directory or .gguf file")
    add_compute_argument(p)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def cmd_generate(a) -> int:
    from ..load import load_target
    from ..methods import generate_with, proposer_with
    from ..streaming import TextStream

    t0 = time.perf_counter()
    target = load_target(a.model, compute=compute_of(a), threads=a.threads)
    ids = target.encode(a.prompt) if a.no_chat else target.encode_chat(a.prompt, system=a.system)
    text = TextStream(target.tokenizer)

    def stream(tokens):
        sys.stdout.write(text.push(tokens))  # complete characters only: no U+FFFD for a split emoji
        sys.stdout.flush()

    proposer = proposer_with(a.method, target, a)  # loading and preparing: not decoding time
    load_s = time.perf_counter() - t0
    result = generate_with(a.method, target, ids, a, proposer, on_tokens=stream)
    print(text.finish())
    print(f"load {load_s:.2f} s (the model and what the method prepares; not in the figures below)", file=sys.stderr)
    print(result.stats.line(), file=sys.stderr)
    return 0


def cmd_info(a) -> int:
    import os

    import torch

    from ..compute import choose_compute, cpu_info
    from ..model.arena import huge_pages_status
    from ..ops.cpu_extension import build_dir, kernel_error

    cpu, err = cpu_info(), kernel_error()
    choice = choose_compute(compute_of(a))
    print(f"CPU: {cpu.model} ({cpu.arch}), {os.cpu_count()} cores\nISA: {cpu.isa_summary}")
    print(f"C++ kernels: {'ready in ' + str(build_dir()) if err is None else 'unavailable: ' + err}")
    print(f"compute path: {choice.path}{' (' + choice.isa + ')' if choice.isa else ''}: {choice.reason}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ATen CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print(huge_pages_status())
    print("override with --compute fp32|bf16|int8 (int8 uses AMX tiles where the CPU has them; DRAFTTREE_AMX=0 turns them off); ATEN_CPU_CAPABILITY=avx2 (or DRAFTTREE_ISA=avx2) restricts to AVX2")
    return 0


def cmd_demo(a) -> int:
    from .demo import run_demo

    return run_demo(a)


def cmd_bench_runtime(a) -> int:
    from .bench.runtime import run

    return run(a)


def cmd_profile(a) -> int:
    from pathlib import Path

    from ..load import load_target
    from ..methods import cost_model_path, load_drafter_for
    from ..profile import profile_costs

    target = load_target(a.model, compute=compute_of(a), threads=a.threads)
    drafter = load_drafter_for(target, a.drafter)
    model = profile_costs(target, drafter, quick=a.quick)
    path = Path(a.out) if a.out else cost_model_path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save(path)
    model.plot(path.with_suffix(".png"), title=f"{target.name} {target.compute_label}")
    print(f"cost model: {path}\nplot: {path.with_suffix('.png')}")
    meas = model.measurements
    print("| context | " + " | ".join(f"{n} tok" for n in meas["token_counts"]) + " |")
    print("|---|" + "---|" * len(meas["token_counts"]))
    for ctx, row in meas["median_ms"].items():
        print(f"| {ctx} | " + " | ".join(f"{v:.1f}" for v in row) + " |")
    print(f"draft: {model.draft_ms:.2f} ms + {model.draft_ms_per_context_token:.4f} ms per context token")
    return 0


def cmd_bench(a) -> int:
    from .bench.methods import run

    return run(a)


def cmd_bench_peers(a) -> int:
    from .bench.peers import run

    return run(a)


def cmd_replay(a) -> int:
    from .bench.replay import run

    return run(a)


def cmd_check_lossless(a) -> int:
    from .bench.lossless import run

    return run(a)


def cmd_train(a) -> int:
    if a.what == "drafter":
        from ..training.train import main as train_main

        return train_main(a.rest) or 0
    if a.what == "weaver":
        from ..training.weaver_train import main as weaver_main

        return weaver_main(a.rest)
    if _option(a.rest, "--engine") == "anchors":  # labels from existing text: its own options (`--engine anchors --help`)
        from ..training.anchor_labels import main as anchors_main

        return anchors_main(a.rest)
    from ..training.datagen import main as datagen_main

    return datagen_main(a.rest)


def _option(argv: list[str], name: str) -> str | None:
    """The value of `name` in an argument list passed on whole (`train data ...`), or None."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="drafttree", description="Lossless speculative decoding with draft trees")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a reply to a prompt")
    g.add_argument("prompt")
    g.add_argument("--method", default="ar", choices=list(METHODS))
    g.add_argument("--budget", type=int, default=16, help="draft-tree nodes for --method ddtree")
    add_drafter_args(g)
    add_weaver_args(g)
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("--system", default=None, help="system message")
    _add_model_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="this CPU, its instruction sets, and the compute path drafttree chooses")
    add_compute_argument(i)
    i.set_defaults(func=cmd_info)

    d = sub.add_parser("demo", help="the main job on the embedded default model")
    _add_model_args(d)
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--method", default="lookup-caddtree-online", choices=list(METHODS))
    d.add_argument("--budget", type=int, default=16)
    add_drafter_args(d)
    d.add_argument("--repeats", type=int, default=3, help="timed runs per method, interleaved; the median is reported")
    add_weaver_args(d)
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench-runtime", help="AR tokens/s vs transformers, and the forward-cost curve")
    b.add_argument("--prompts", type=int, default=5)
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--out", default="runs/bench-runtime")
    b.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name, checkpoint directory or .gguf file")
    b.add_argument("--contexts", default=None, help="forward-cost context lengths, comma-separated (default 256,1024)")
    b.add_argument("--sizes", default=None, help="forward-cost new-token counts (default 1,2,4,...,128)")
    b.add_argument("--repeats", type=int, default=None, help="forward-cost repeats per point, median kept (default 7)")
    b.add_argument("--curve-dtypes", default="bf16,fp32", help="dtypes of the forward-cost curve")
    b.add_argument("--hf-attn", default="eager", choices=["eager", "sdpa"], help="transformers attention implementation")
    b.add_argument("--skip-ar", action="store_true", help="only the forward-cost curve")
    b.add_argument("--skip-curve", action="store_true", help="only the AR comparison")
    b.add_argument("--quick", action="store_true", help="2 prompts x 32 tokens, context 256, 3 repeats")
    b.set_defaults(func=cmd_bench_runtime)

    pr = sub.add_parser("profile", help="measure verify/draft costs for CaDDTree on this machine")
    _add_model_args(pr)
    pr.add_argument("--drafter", default=None)
    pr.add_argument("--quick", action="store_true", help="a smaller grid (about a minute)")
    pr.add_argument("--out", default=None, help="cost model JSON (default: the per-machine cache)")
    pr.set_defaults(func=cmd_profile)

    try:
        from .bench.methods import add_arguments
    except ImportError:  # the benchmark module is optional at import time
        add_arguments = None
    if add_arguments is not None:
        bm = sub.add_parser("bench", help="τ, tokens/s and speedup of ar/chain/ddtree/caddtree on prompt sets")
        add_arguments(bm)
        bm.set_defaults(func=cmd_bench)

    from .bench.lossless import add_arguments as lossless_arguments

    lc = sub.add_parser("check-lossless", help="whole prompt sets through speculative methods, each output checked "
                        "against the target alone (teacher forcing; real AR where that fails)")
    lossless_arguments(lc)
    lc.set_defaults(func=cmd_check_lossless)

    from .bench.peers import add_arguments as peers_arguments

    bp = sub.add_parser("bench-peers", help="drafttree's methods beside llama.cpp (AR, prompt lookup) and "
                        "transformers on the same prompts, same run; ISA, bandwidth and per-format floors")
    peers_arguments(bp)
    bp.set_defaults(func=cmd_bench_peers)

    from .bench.replay import add_arguments as replay_arguments

    rp = sub.add_parser("replay", help="tree-size policies replayed on recorded draft streams: exact τ, "
                        "modelled time, no clock noise")
    replay_arguments(rp)
    rp.set_defaults(func=cmd_replay)

    t = sub.add_parser("train", help="`train data ...` (self-distillation data), `train drafter ...` or `train weaver "
                       "...`; options: see `drafttree train drafter -- --help`")
    t.add_argument("what", choices=["data", "drafter", "weaver"])
    t.add_argument("rest", nargs=argparse.REMAINDER)
    t.set_defaults(func=cmd_train)

    from .serve.cli import add_parser as serve_parser  # `drafttree serve`: the OpenAI-compatible server
    serve_parser(sub)

    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    for sp in sub.choices.values():  # `drafttree generate ... --debug` too; SUPPRESS keeps the top-level value
        if sp is not t:  # train passes everything after its first word on
            sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    return p


def check_args(a) -> None:
    """Every check that needs no model, for whichever of these options the command has: run before
    anything is loaded, so a bad value costs a second, not a model load. (Method and prompt-set names are
    checked by the commands themselves, also before loading.)"""
    from ..validate import check_int, check_model_dir, check_positive_int, check_sampling, check_text, check_threads

    for name in ("prompt", "system"):
        if getattr(a, name, None) is not None:
            check_text("the prompt" if name == "prompt" else "--system", getattr(a, name))
    if hasattr(a, "temperature"):
        check_sampling(a.temperature, a.top_p, a.top_k)
    check_threads(getattr(a, "threads", None))
    for name in ("max_new_tokens", "limit", "budget", "prompts", "max_tree_nodes", "repeats", "weaver_width"):
        if getattr(a, name, None) is not None:
            check_positive_int("--" + name.replace("_", "-"), getattr(a, name))
    if getattr(a, "warmup_tokens", None) is not None:
        check_int("--warmup-tokens", a.warmup_tokens, minimum=0)
    if getattr(a, "model", None):
        check_model_dir(a.model)
    if getattr(a, "drafter", None):
        from pathlib import Path

        from ..drafter.checkpoint import load_drafter_config
        from ..validate import check_safetensors

        load_drafter_config(a.drafter)
        for f in sorted(Path(a.drafter).glob("*.safetensors")):
            check_safetensors(f, "the drafter's weights", "copy the drafter again or retrain it (`drafttree train drafter`)")
    if getattr(a, "weaver", None):
        from ..weaver.checkpoint import load_weaver_config

        load_weaver_config(a.weaver)
    if getattr(a, "cost_model", None):
        from ..costmodel import VerifyCostModel

        VerifyCostModel.load(a.cost_model)  # a FileNotFoundError names the path
    _check_output_paths(a)


def _check_output_paths(a) -> None:
    """Everything the command will write can be written: --out, the model cache when the embedded model is
    still to be converted, and the cost-model cache when a cost-aware method will profile this machine.
    Checked now, not after minutes of profiling whose measurements would then be lost."""
    from ..methods import COST_AWARE
    from ..validate import CACHE_HINT, check_model_cache, check_writable

    out = getattr(a, "out", None)
    if out is not None:
        check_writable(out, "--out", kind="file" if a.command == "profile" else "dir")
    model = getattr(a, "model", None)
    check_model_cache(model)
    _check_kernel_cache(a)
    methods = [a.method] if hasattr(a, "method") else [m.strip() for m in str(getattr(a, "methods", "")).split(",")]
    profiles = (a.command == "profile" and out is None) or (
        any(m in COST_AWARE for m in methods) and not getattr(a, "cost_model", None))
    if profiles and model:
        paths = _cached_cost_model_paths(a)
        if paths and not any(p.exists() for p in paths):
            alternative = {"profile": " or pass --out FILE"}.get(a.command, "")
            if hasattr(a, "cost_model"):
                alternative = " or pass --cost-model FILE"
            check_writable(paths[0], "the cost-model cache", kind="file", hint=f"{CACHE_HINT}{alternative} (this "
                           "machine's costs are profiled once, about a minute, and saved there)")


def _check_kernel_cache(a) -> None:
    """The C++ kernels (int8, q4) are compiled into the cache on first use: with an unwritable cache an
    explicit --compute int8/q4 fails now, in one line (not as a traceback after the model load), and
    --compute auto says that it will fall back to a float path."""
    from ..compute import LEGACY_DTYPES
    from ..validate import CACHE_HINT, InputError, check_writable, warn

    if not hasattr(a, "compute"):
        return
    requested = LEGACY_DTYPES.get(compute_of(a), compute_of(a))
    if requested not in ("auto", "int8", "q4"):
        return
    from ..ops.cpu_extension import build_dir

    out = build_dir()
    if any(out.glob("*.so")):
        return
    try:
        check_writable(out, "the kernel cache", need_bytes=50_000_000,
                       hint=f"{CACHE_HINT} (the C++ kernels are compiled there once, about a minute)")
    except InputError as e:
        if requested != "auto":
            raise InputError(f"{e}; or use --compute fp32 or bf16") from None
        warn(f"{e}; --compute auto falls back to a float path without them")


def _cached_cost_model_paths(a) -> list:
    """Where methods.cost_model_path will look for the target these arguments load, without loading it or
    building the C++ kernels (which decide between q4 and a float path under --compute auto): one path per
    compute path the choice may end in; [] when that cannot be foreseen (the loader then says what is wrong)."""
    import os
    from types import SimpleNamespace

    import torch

    from ..compute import LEGACY_DTYPES, cpu_info
    from ..methods import cost_model_path

    threads = getattr(a, "threads", None) or int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1
    before = torch.get_num_threads()
    try:
        requested = LEGACY_DTYPES.get(compute_of(a), compute_of(a))
        isa = cpu_info().int8_isa
        paths = {"fp32": [("fp32", None)], "bf16": [("bf16", None)], "int8": [("int8", isa)], "q4": [("q4", isa)],
                 "auto": [("q4", isa), ("bf16", None), ("fp32", None)]}[requested]
        torch.set_num_threads(threads)  # as load_target will: the file name carries the thread count
        return [cost_model_path(SimpleNamespace(name=str(a.model), compute=SimpleNamespace(path=p, isa=i), compute_path=p))
                for p, i in paths]
    except Exception:  # noqa: BLE001 - a guess that fails is no error of the user's
        return []
    finally:
        torch.set_num_threads(before)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        return args.func(args)
    except (ValueError, OSError) as e:  # includes JSONDecodeError, UnicodeDecodeError, FileNotFoundError, InputError
        if args.debug:
            raise
        print(f"drafttree: error: {str(e).replace(chr(10), ' ')}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("drafttree: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
