"""Exact greedy τ of several drafters on whole prompt sets, side by side, without a clock.

Greedy speculative decoding emits AR's tokens whatever the drafter, so a round's outcome depends only on
where it starts (drafttree.apps.bench.replay): per prompt AR's reply is decoded once, then each drafter drafts
at every position of it (its context growing one token at a time, as in decoding) and the rounds of the
chain and of DDTree at fixed budgets are replayed on those drafts. Decoding with the same drafter on the
same compute path gives the same τ (`drafttree bench` / `check-lossless` measure it the slow way).

  .venv/bin/python bench/drafter_tau.py --drafters old=drafttree/weights/smollm2-135m-instruct-dflash,new=runs/x/drafter \\
      --part 0/2 --out runs/tau/part0.jsonl           # one process per core, then:
  .venv/bin/python bench/drafter_tau.py --merge runs/tau/part0.jsonl,runs/tau/part1.jsonl --out docs/drafter-tau
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from drafttree.atomic import atomic_path, atomic_write_text
from drafttree.compute import cpu_info
from drafttree.datasets import load_prompts, mtbench_turn_pairs
from drafttree.engine import generate_ar
from drafttree.load import load_target
from drafttree.methods import load_drafter_for
from drafttree.marginals import dense_logits
from drafttree.proposers import ChainPolicy, DFlashProposer
from drafttree.tree import best_first_nodes


@torch.no_grad()
def accepted_per_position(target, proposer, prompt_ids: torch.Tensor, ar: list[int], budgets: list[int]) -> dict:
    """For every round start s of AR's reply: drafts accepted by the chain and by DDTree-n (n in budgets)."""
    seq = torch.cat([prompt_ids, torch.tensor(ar, dtype=torch.long)])
    P, S, model = prompt_ids.numel(), max(len(ar) - 1, 0), target.model
    feats = model.forward(model.new_state(seq.numel()), seq, capture_layers=proposer.capture_layers,
                          logits_rows=torch.tensor([seq.numel() - 1])).features
    state = proposer.begin(prompt_ids, feats[:P])
    ids = proposer.draft_token_ids
    out = {"chain": np.zeros(S, np.int16), **{f"ddtree-{n}": np.zeros(S, np.int16) for n in budgets}}
    for s in range(S):
        q = P + s
        logits = dense_logits(proposer.draft(state, ar[s], q))
        room = seq.numel() - q - 1  # reply tokens after the root: deeper drafts cannot be checked
        truth = seq[q + 1:q + 1 + logits.shape[0]]
        top = logits[: truth.numel()].argmax(-1)
        top = ids[top] if ids is not None else top
        out["chain"][s] = int((top == truth).int().cumprod(0).sum())
        on_path, depth_ok = [True], []
        for node in best_first_nodes(logits.log_softmax(-1), max(budgets), ids):
            ok = on_path[node.parent] and node.depth <= room and int(seq[q + node.depth]) == node.token
            on_path.append(ok)
            depth_ok.append(node.depth if ok else 0)
        for n in budgets:
            out[f"ddtree-{n}"][s] = max(depth_ok[:n], default=0)
        proposer.advance(state, seq[q:q + 1], feats[q:q + 1], q)
    return out


def round_lengths(accepted: np.ndarray, reply_len: int) -> list[int]:
    """Accept lengths of the rounds a fixed policy runs on one reply: a round at s accepts accepted[s] drafts + 1."""
    s, lengths = 0, []
    while s < reply_len - 1:
        a = int(min(accepted[s], reply_len - 2 - s))  # as the engine: drafts past the reply's end are not kept
        lengths.append(a + 1)
        s += a + 1
    return lengths


def rounds_tau(accepted: np.ndarray, reply_len: int) -> tuple[float, int]:
    """(τ, rounds) on one reply."""
    lengths = round_lengths(accepted, reply_len)
    return (float(np.mean(lengths)) if lengths else 0.0), len(lengths)


def set_prompts(name: str, limit: int | None) -> list:
    """A set's prompts; `mtbench-turn2`: MT-Bench's (first turn, second turn) pairs."""
    return mtbench_turn_pairs(limit) if name == "mtbench-turn2" else load_prompts(name, limit)


def prompt_ids(target, prompt, max_new_tokens: int) -> torch.Tensor:
    """The chat prompt's ids; for a (first, second) turn pair, the conversation after the target's own greedy answer
    to the first turn, ending with the second (the reply measured is the second turn's, as MT-Bench asks it)."""
    if isinstance(prompt, str):
        return target.encode_chat(prompt)
    first, second = prompt
    answer = generate_ar(target, target.encode_chat(first), max_new_tokens, stop_token_ids=target.stop_token_ids).tokens
    return target.encode_chat([{"role": "user", "content": first},
                               {"role": "assistant", "content": target.decode(answer)},
                               {"role": "user", "content": second}])


def record(a) -> int:
    k, n = (int(x) for x in a.part.split("/"))
    target = load_target(a.model, compute=a.compute, threads=a.threads)
    drafters = dict(item.split("=", 1) for item in a.drafters.split(","))
    proposers = {name: DFlashProposer(load_drafter_for(target, path), target.model, ChainPolicy())
                 for name, path in drafters.items()}
    budgets = [int(b) for b in a.budgets.split(",")]
    jobs = [(ds, i, p) for ds in a.datasets.split(",") for i, p in enumerate(set_prompts(ds, a.limit))][k::n]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["set"], r["prompt"]) for r in map(json.loads, out.read_text().splitlines())} if out.exists() else set()
    cpu = cpu_info()
    with out.open("a") as f:
        for ds, i, prompt in tqdm(jobs, desc=f"τ part {a.part}", unit="prompt"):
            if (ds, i) in done:
                continue
            ids = prompt_ids(target, prompt, a.max_new_tokens)
            ar = generate_ar(target, ids, a.max_new_tokens, stop_token_ids=target.stop_token_ids).tokens
            rec = {"set": ds, "prompt": i, "reply_tokens": len(ar), "compute": target.compute_label,
                   "isa": cpu.isa_summary, "drafters": drafters, "tau": {}}
            for name, proposer in proposers.items():
                t0 = time.perf_counter()
                acc = accepted_per_position(target, proposer, ids, ar, budgets)
                rec["tau"][name] = {policy: rounds_tau(v, len(ar)) for policy, v in acc.items()}
                rec["tau"][name]["seconds"] = round(time.perf_counter() - t0, 2)
            f.write(json.dumps(rec) + "\n")  # one line per prompt: a killed run resumes where it stopped
            f.flush()
    return 0


def merge(a) -> int:
    recs = [json.loads(line) for p in a.merge.split(",") for line in Path(p).read_text().splitlines() if line.strip()]
    names = list(recs[0]["tau"])
    policies = [p for p in recs[0]["tau"][names[0]] if p != "seconds"]
    table = {}
    for ds in dict.fromkeys(r["set"] for r in recs):
        rows = [r for r in recs if r["set"] == ds]
        table[ds] = {"prompts": len(rows), **{name: {p: float(np.mean([r["tau"][name][p][0] for r in rows]))
                                                     for p in policies} for name in names}}
    lines = [f"Exact greedy τ (replayed; per prompt the mean accept length of its rounds, then the mean over prompts). "
             f"Compute path {recs[0]['compute']}; ISA {recs[0]['isa']}; drafters: "
             + ", ".join(f"{k} = `{v}`" for k, v in recs[0]["drafters"].items()) + ".", "",
             "| set | prompts | " + " | ".join(f"{n} {p}" for p in policies for n in names) + " |",
             "|---|---:|" + "---:|" * (len(policies) * len(names))]
    for ds, row in table.items():
        lines.append(f"| {ds} | {row['prompts']} | " + " | ".join(f"{row[n][p]:.2f}" for p in policies for n in names) + " |")
    md = "\n".join(lines) + "\n"
    print(md)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.md", md)
    atomic_write_text(out / "results.json", json.dumps({"compute": recs[0]["compute"], "isa": recs[0]["isa"],
                                                        "drafters": recs[0]["drafters"], "sets": table}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / (len(names) * len(policies))
    for j, (p, n) in enumerate((p, n) for p in policies for n in names):
        ax.bar(np.arange(len(table)) + j * width, [row[n][p] for row in table.values()], width, label=f"{n} {p}")
    ax.set_xticks(np.arange(len(table)) + 0.4 - width / 2, list(table))
    ax.set_ylabel("τ (accepted drafts + 1 per round)")
    ax.legend(fontsize=8, ncol=len(policies))
    fig.tight_layout()
    with atomic_path(out / "tau.png") as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--compute", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--drafters", help="name=directory,... (compared on the same AR replies)")
    ap.add_argument("--budgets", default="16")
    ap.add_argument("--datasets", default="gsm8k,humaneval,mtbench", help="comma list of prompt sets; also "
                    "mtbench-turn2: MT-Bench's second turns after the target's own answer to the first")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts per set (default: whole sets)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--part", default="0/1", help="K/N: every N-th prompt from the K-th (one process per core)")
    ap.add_argument("--merge", help="comma list of part files to tabulate into --out (a directory)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    return merge(a) if a.merge else record(a)


if __name__ == "__main__":
    sys.exit(main())
