"""`drafttree check-lossless`: every prompt of whole prompt sets through speculative methods (greedy,
fp32), each output checked against the target alone.

Running plain AR next to every method would double the cost, so each output is first checked by
teacher forcing: one target forward over prompt + output must pick every output token as its argmax
(and stop where the output stops). A batched forward rounds differently from one-token decoding, so
the two can disagree only at a near-tie; any prompt that fails is then decoded by real AR and
compared token for token — that comparison decides. Reports τ per method and set as well.

fp32 is not associative: a one-token step and a batched verify can round the same logit differently
in the 6th–7th significant digit, so where the target's top two logits are that close the two runs
may take different branches. A mismatch is therefore reported with the gap between the two tokens'
logits in AR's own step; a gap below `NEAR_TIE` is a rounding tie, anything larger a bug.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from ...atomic import atomic_write_text
from ...compute import add_compute_argument, compute_of
from ...datasets import load_prompts
from ...engine import generate_ar
from ...methods import COST_AWARE, METHODS, NO_DRAFTER, generate, make_proposer
from ...validate import InputError, check_positive_int
from .methods import BUDGETED, parse_datasets

NEAR_TIE = 1e-4  # logit units: fp32 rounding differences between one-token and batched forwards are ~1e-5


@torch.inference_mode()
def teacher_forced_ok(target, prompt_ids: torch.Tensor, tokens: list[int], max_new_tokens: int, stops) -> bool:
    """True iff greedy AR would emit `tokens`, judged by one forward over prompt + tokens[:-1]."""
    if not tokens:
        return max_new_tokens == 0
    if any(t in stops for t in tokens[:-1]) or (len(tokens) < max_new_tokens and tokens[-1] not in stops):
        return False  # ran past a stop token, or stopped early without one
    model = target.model
    seq = torch.cat([prompt_ids, torch.tensor(tokens[:-1], dtype=torch.long)])
    rows = torch.arange(prompt_ids.numel() - 1, seq.numel())
    logits = model.forward(model.new_state(seq.numel() + 1), seq, logits_rows=rows).logits
    return logits.argmax(-1).tolist() == tokens


@torch.inference_mode()
def divergence_gap(target, prompt_ids: torch.Tensor, ar_tokens: list[int], other_tokens: list[int]) -> tuple[int, float]:
    """(index, logit gap) at the first difference: AR's chosen token minus the other's, in AR's own
    one-token step there (as generate_ar computes it)."""
    i = next((k for k, (a, b) in enumerate(zip(ar_tokens, other_tokens)) if a != b), None)
    if i is None:
        return min(len(ar_tokens), len(other_tokens)), float("inf")  # one stopped early: not a tie
    model = target.model
    state = model.new_state(prompt_ids.numel() + i + 1)
    logits = model.prefill(state, prompt_ids).logits[-1]
    for t in ar_tokens[:i]:
        logits = model.forward(state, torch.tensor([t])).logits[-1]
        model.commit(state, torch.zeros(1, dtype=torch.long))
    return i, float(logits[ar_tokens[i]] - logits[other_tokens[i]])


def method_label(method: str, budget: int) -> str:
    return f"{method}-{budget}" if method in BUDGETED else method


def check(target, methods, prompts_by_set: dict, max_new_tokens: int = 256, drafter=None, cost_model=None,
          progress: bool = True, records=None, budget: int = 16, weaver=None, weaver_width: int = 8) -> dict:
    """`records`: an open text file that gets one JSON line per prompt as it finishes (survives a kill).
    `budget`: the node budget of ddtree and lookup-ddtree (their rows are named ddtree-<budget>, ...)."""
    stops = set(target.stop_token_ids)
    if any(m.startswith("weaver-") for m in methods) and (weaver is None or isinstance(weaver, (str, Path))):
        from ...methods import load_weaver_for

        weaver = load_weaver_for(target, drafter, weaver)  # once for both weaver-* methods
    proposers = {m: make_proposer(m, target, drafter=drafter, budget=budget, cost_model=cost_model,
                                  **(dict(weaver=weaver, weaver_width=weaver_width) if m.startswith("weaver-") else {}))
                 for m in methods}
    results = {}
    total = sum(len(p) for p in prompts_by_set.values()) * len(methods)
    bar = tqdm(total=total, desc="lossless check", unit="run", disable=not progress)
    for ds, prompts in prompts_by_set.items():
        for m in methods:
            name = method_label(m, budget)
            row = results.setdefault(ds, {}).setdefault(name, dict(prompts=0, mismatches=0, ar_adjudicated=0, near_ties=0,
                                                                   rounds=0, accepted=0, tokens=0, failed=[]))
            for i, text in enumerate(prompts):
                ids = target.encode_chat(text)
                res = generate(m, target, ids, max_new_tokens, proposer=proposers[m])
                ok = teacher_forced_ok(target, ids, res.tokens, max_new_tokens, stops)
                if not ok:  # a near-tie or a real difference: real AR decides
                    row["ar_adjudicated"] += 1
                    ar = generate_ar(target, ids, max_new_tokens).tokens
                    ok = ar == res.tokens
                    if not ok:
                        at, gap = divergence_gap(target, ids, ar, res.tokens)
                        row["failed"].append(dict(prompt=i, index=at, logit_gap=gap))
                        row["near_ties"] += gap < NEAR_TIE
                row["prompts"] += 1
                row["mismatches"] += 0 if ok else 1
                row["rounds"] += res.stats.rounds
                row["accepted"] += sum(res.stats.accept_lengths)
                row["tokens"] += len(res.tokens)
                if records is not None:
                    records.write(json.dumps(dict(set=ds, method=name, prompt=i, ok=ok, tokens=len(res.tokens),
                                                  rounds=res.stats.rounds, tau=res.stats.tau)) + "\n")
                    records.flush()
                bar.update(1)
                bar.set_postfix(set=ds, method=name, mismatches=row["mismatches"])
            row["tau"] = row["accepted"] / max(1, row["rounds"])
    bar.close()
    return results


def markdown(results: dict, config: dict) -> str:
    lines = ["# drafttree check-lossless", "",
             f"{config.get('compute', config.get('dtype'))}, greedy, at most {config['max_new_tokens']} new tokens, stop tokens honoured; "
             "every prompt of each set. `checked by AR`: outputs that failed the teacher-forced check and were "
             "therefore decoded by plain AR and compared token for token. `near-ties`: mismatches whose first "
             f"differing token trails AR's by less than {NEAR_TIE:g} in AR's own logits (fp32 rounding, see the "
             "module doc); any other mismatch is a bug.", "",
             "| set | method | prompts | tokens | τ (tokens per round) | checked by AR | mismatches | of which near-ties |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for ds, rows in results.items():
        for m, r in rows.items():
            lines.append(f"| {ds} | {m} | {r['prompts']} | {r['tokens']} | {r['tau']:.2f} | {r['ar_adjudicated']} | "
                         f"{r['mismatches']} | {r.get('near_ties', 0)} |")
    failed = [(ds, m, f) for ds, rows in results.items() for m, r in rows.items() for f in r["failed"]]
    if failed:
        lines += ["", "| set | method | prompt | first different token | AR logit − method logit there |", "|---|---|---:|---:|---:|"]
        lines += [f"| {ds} | {m} | {f['prompt']} | {f['index']} | {f['logit_gap']:.2e} |" for ds, m, f in failed]
    return "\n".join(lines) + "\n"


def add_arguments(p) -> None:
    p.add_argument("--methods", default="chain,caddtree", help=f"comma-separated, from {', '.join(METHODS[1:])}")
    p.add_argument("--datasets", default="gsm8k,humaneval,mtbench")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each set (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--budget", type=int, default=16, help="node budget of ddtree and lookup-ddtree")
    add_compute_argument(p, default="fp32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--drafter", default=None)
    from ...methods import add_weaver_args

    add_weaver_args(p)
    p.add_argument("--out", default="runs/lossless")


def run(a) -> int:
    from ...load import load_target
    from ...methods import load_drafter_for, load_or_profile_cost_model

    # everything that needs no model is checked first: a typo must not cost a model load
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS[1:]]
    if bad or not methods:
        raise InputError(f"unknown speculative methods {bad}: choose from {', '.join(METHODS[1:])}" if bad else
                         f"--methods is empty: name at least one of {', '.join(METHODS[1:])}")
    for name in ("limit", "max_new_tokens", "budget"):
        if getattr(a, name) is not None:
            check_positive_int("--" + name.replace("_", "-"), getattr(a, name))
    prompts = {d: load_prompts(d, a.limit) for d in parse_datasets(a.datasets)}
    if not any(prompts.values()):
        raise InputError(f"no prompts to check in --datasets {a.datasets!r}")
    target = load_target(a.model, compute=compute_of(a), threads=a.threads)
    drafter = None if all(m in NO_DRAFTER for m in methods) else load_drafter_for(target, a.drafter)
    cost_model = None
    if any(m in COST_AWARE for m in methods):
        cost_model = load_or_profile_cost_model(target, drafter)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "records.jsonl", "w") as records:
        results = check(target, methods, prompts, a.max_new_tokens, drafter, cost_model, records=records,
                        budget=a.budget, weaver=getattr(a, "weaver", None),
                        weaver_width=getattr(a, "weaver_width", 8))
    config = dict(model=target.name, compute=getattr(target, "compute_label", compute_of(a)), max_new_tokens=a.max_new_tokens, threads=torch.get_num_threads(),
                  drafter=a.drafter or "shipped", sets={d: len(p) for d, p in prompts.items()})
    atomic_write_text(out / "results.json", json.dumps(dict(config=config, results=results), indent=1) + "\n")
    md = markdown(results, config)
    atomic_write_text(out / "results.md", md)
    print(md)
    checked = sum(r["prompts"] for rows in results.values() for r in rows.values())
    mismatches = sum(r["mismatches"] for rows in results.values() for r in rows.values())
    bugs = mismatches - sum(r["near_ties"] for rows in results.values() for r in rows.values())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}; {checked} prompt runs checked, {mismatches} mismatching, "
          f"{bugs} not explained by an fp32 near-tie", file=sys.stderr)
    if checked == 0:  # a check of nothing must not pass as a check
        print("drafttree check-lossless: FAILED: no prompt was checked", file=sys.stderr)
        return 1
    return 1 if bugs else 0
