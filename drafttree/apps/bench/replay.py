"""`drafttree replay`: tree-size policies compared without a clock.

Greedy speculative decoding emits AR's tokens whatever the trees, so a round's outcome depends only on
where it starts: the drafter's marginals at root position q (its context: the AR text before q) fix the
best-first node stream, and the first n nodes of that stream accept the deepest of them whose path
matches AR's continuation. Recorded once per position, this replays any policy exactly (fixed budget
or CaDDTree's selection, the shipped code): τ is exact and time comes from the cost model, so a
policy's quality is measured without the wall-clock noise that dominates `drafttree bench` on small
machines. What replay cannot see: costs the model misses (read them off `drafttree bench`), and the lookup
methods (drafttree.lookup): their trees also hold continuations found in the request's own text, weighed by a
calibration that follows the rounds the policy chose, which a recorded drafter stream does not hold (compare
them with `drafttree bench`); and CaDDTree's default blocks that follow the request's trees (their drafts depend on
the trees before them): replay models CaDDTree with `follow_depth=False`, whose τ is 1-2 % above the default's.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ...atomic import atomic_path, atomic_write_text
from ...compute import add_compute_argument, compute_of
from ...costmodel import VerifyCostModel
from ...policies import caddtree_select
from ...engine import generate_ar
from ...marginals import log_marginals
from ...recalibrate import RoundCalibrator
from ...tree import TreeNode, best_first_nodes


@dataclass
class DraftStreams:
    """Per round start s (root = tokens[s] at position prompt_len + s): the best-first stream."""

    prompt_len: int
    tokens: list[int]  # AR's continuation; rounds start at s = 0 .. len - 2
    parents: np.ndarray  # [S, M] int32, tree indices (0 = root); -1 past the stream's end
    node_tokens: np.ndarray  # [S, M] int64
    depths: np.ndarray  # [S, M] int16
    path_logprobs: np.ndarray  # [S, M] float64
    matched_depth: np.ndarray  # [S, M] int16: the node's depth if its path is AR's continuation, else 0

    def nodes(self, s: int):
        """The stream at round start s, as the TreeNodes the tree builders produce (lazily)."""
        for j in range(self.parents.shape[1]):
            if self.parents[s, j] < 0:
                return
            yield TreeNode(int(self.parents[s, j]), int(self.node_tokens[s, j]), int(self.depths[s, j]), float("nan"),
                           float(self.path_logprobs[s, j]))

    ARRAYS = ("parents", "node_tokens", "depths", "path_logprobs", "matched_depth")

    def arrays(self, prefix: str) -> dict:
        """Plain arrays for np.savez (no pickles), keys prefixed."""
        out = {f"{prefix}{k}": getattr(self, k) for k in self.ARRAYS}
        out[f"{prefix}tokens"] = np.asarray(self.tokens, np.int64)
        out[f"{prefix}prompt_len"] = np.asarray(self.prompt_len)
        return out

    @classmethod
    def from_arrays(cls, z, prefix: str) -> "DraftStreams":
        return cls(int(z[f"{prefix}prompt_len"]), z[f"{prefix}tokens"].tolist(), *(z[f"{prefix}{k}"] for k in cls.ARRAYS))

    def accepted(self, s: int, n: int) -> int:
        """Draft tokens accepted when the first n nodes of stream s are verified."""
        return int(self.matched_depth[s, :n].max()) if n > 0 else 0


@torch.no_grad()
def record_draft_streams(target, proposer, prompt_ids: torch.Tensor, max_new_tokens: int, max_nodes: int,
                         stop_token_ids=None) -> DraftStreams:
    """AR's reply, then one draft per position of it, the drafter's context growing one token at a time."""
    prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    ar = generate_ar(target, prompt_ids, max_new_tokens, stop_token_ids=stop_token_ids).tokens
    seq = torch.cat([prompt_ids, torch.tensor(ar, dtype=torch.long)])
    P, S, model = prompt_ids.numel(), max(len(ar) - 1, 0), target.model
    feats = model.forward(model.new_state(seq.numel()), seq, capture_layers=proposer.capture_layers,
                          logits_rows=torch.tensor([seq.numel() - 1])).features
    state = proposer.begin(prompt_ids, None if feats is None else feats[:P])
    parents = np.full((S, max_nodes), -1, np.int32)
    node_tokens = np.zeros((S, max_nodes), np.int64)
    depths = np.zeros((S, max_nodes), np.int16)
    path_lp = np.full((S, max_nodes), -np.inf)
    matched = np.zeros((S, max_nodes), np.int16)
    for s in range(S):
        q = P + s
        logits = proposer.draft(state, ar[s], q)
        on_path = [True]  # the root is AR's token
        for j, node in enumerate(_node_stream(proposer, ar[s], logits, max_nodes)):
            ok = on_path[node.parent] and q + node.depth < seq.numel() and int(seq[q + node.depth]) == node.token
            on_path.append(ok)
            parents[s, j], node_tokens[s, j], depths[s, j], path_lp[s, j] = node.parent, node.token, node.depth, node.path_logprob
            matched[s, j] = node.depth if ok else 0
        proposer.advance(state, seq[q:q + 1], None if feats is None else feats[q:q + 1], q)
    return DraftStreams(P, ar, parents, node_tokens, depths, path_lp, matched)


def _node_stream(proposer, root: int, drafted, max_nodes: int):
    """The best-first stream the policies cut, as they build it: over the marginals, or (a Weaver proposer,
    `--weaver-stream`) over Weaver's path probabilities at its width."""
    if hasattr(proposer, "stream"):
        return iter(proposer.stream(root, drafted, max_nodes))
    return best_first_nodes(log_marginals(drafted), max_nodes, getattr(proposer, "draft_token_ids", None))


@dataclass
class Replay:
    tokens: int  # emitted after the first (prefill's) token
    modelled_ms: float
    accept_lengths: list[int]  # accepted drafts + 1, per round
    tree_sizes: list[int]


class FixedBudget:
    def __init__(self, budget: int):
        self.budget = budget

    def choose(self, streams: DraftStreams, s: int, context_len: int) -> int:
        return self.budget

    def observe(self, accepted: int) -> None:
        pass


class CostAware:
    """CaDDTree's selection (the shipped code) on the recorded stream. With `adapt_acceptance`, the
    acceptance half of caddtree-online's recalibration (its time half needs a clock)."""

    def __init__(self, cost_model: VerifyCostModel, max_nodes: int = 128, adapt_acceptance: bool = False):
        self.cost_model, self.max_nodes = cost_model, max_nodes
        self.calibrator = RoundCalibrator() if adapt_acceptance else None
        self._phi = 0.0

    def choose(self, streams: DraftStreams, s: int, context_len: int) -> int:
        scale = 1.0 if self.calibrator is None else self.calibrator.accept_scale
        sel = caddtree_select(streams.nodes(s), self.cost_model, context_len, self.max_nodes, accept_scale=scale)
        if self.calibrator is not None:  # Φ as the drafter predicted it, for the acceptance ratio
            self._phi = sum(math.exp(n.path_logprob) for n in sel.nodes)
        return len(sel.nodes)

    def observe(self, accepted: int) -> None:
        if self.calibrator is not None:
            self.calibrator.observe_acceptance(self._phi, accepted)



def replay(streams: DraftStreams, policy, cost_model: VerifyCostModel) -> Replay:
    """Run the rounds a policy would run on this reply; time them with the cost model."""
    s, ms, accept, sizes = 0, 0.0, [], []
    width = streams.parents.shape[1]
    while s < len(streams.tokens) - 1:
        ctx = streams.prompt_len + s
        n = min(policy.choose(streams, s, ctx), width)
        # as the engine does: nodes whose tokens could not be kept (past the reply's end) are not verified
        keep = streams.depths[s, :n] <= len(streams.tokens) - s - 2
        n, a = int(keep.sum()), int(streams.matched_depth[s, :n][keep].max(initial=0))
        policy.observe(a)
        ms += cost_model.round_ms(n, ctx)
        accept.append(a + 1)
        sizes.append(n)
        s += a + 1
    return Replay(len(streams.tokens) - 1, ms, accept, sizes)


def summarize(replays: list[Replay]) -> dict:
    tokens = sum(r.tokens for r in replays)
    rounds = sum(len(r.accept_lengths) for r in replays)
    ms = sum(r.modelled_ms for r in replays)
    taus = [float(np.mean(r.accept_lengths)) for r in replays if r.accept_lengths]
    sizes = [n for r in replays for n in r.tree_sizes]
    return dict(tau=float(np.mean(taus)) if taus else 0.0, tokens=tokens, rounds=rounds, modelled_s=ms / 1e3,
                modelled_tokens_per_s=tokens / ms * 1e3 if ms else 0.0, mean_tree_size=float(np.mean(sizes)) if sizes else 0.0)


# ---------------------------------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    add_compute_argument(p)
    p.add_argument("--threads", type=int, default=None, help="CPU threads for recording (replay itself is instant)")
    p.add_argument("--drafter", default=None)
    p.add_argument("--cost-model", default=None, help="cost model JSON (default: this machine's cached one)")
    p.add_argument("--budgets", default="4,8,16,32,64,128")
    p.add_argument("--max-tree-nodes", type=int, default=128)
    p.add_argument("--datasets", default="gsm8k,humaneval,mtbench")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--out", default="runs/replay")
    p.add_argument("--streams", default=None, help="replay streams recorded earlier (an --out's streams.npz) instead of recording")
    p.add_argument("--weaver-stream", action="store_true", help="record Weaver's stream (drafttree.weaver) instead of the "
                   "marginals' heap: the fixed budgets are then weaver-ddtree and caddtree is weaver-caddtree without "
                   "the Weaver's own call cost")
    from ...methods import add_weaver_args

    add_weaver_args(p)


def markdown(results: dict) -> str:
    lines = ["| set | policy | τ | mean tree | modelled tok/s | ÷ best fixed |", "|---|---|---:|---:|---:|---:|"]
    for ds, rows in results["datasets"].items():
        best = max(v["modelled_tokens_per_s"] for k, v in rows.items() if k.startswith("ddtree-"))
        for name, v in rows.items():
            lines.append(f"| {ds} | {name} | {v['tau']:.2f} | {v['mean_tree_size']:.1f} | "
                         f"{v['modelled_tokens_per_s']:.1f} | {v['modelled_tokens_per_s'] / best:.3f} |")
    names = list(next(iter(results["datasets"].values())))
    mean = {n: float(np.mean([rows[n]["modelled_tokens_per_s"] for rows in results["datasets"].values()])) for n in names}
    best = max(v for n, v in mean.items() if n.startswith("ddtree-"))
    lines += [f"| mean | {n} | | | {v:.1f} | {v / best:.3f} |" for n, v in mean.items()]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for ds, rows in results["datasets"].items():
        fixed = sorted((v["mean_tree_size"], v["modelled_tokens_per_s"]) for k, v in rows.items() if k.startswith("ddtree-"))
        line, = ax.plot(*zip(*fixed), marker="o", label=f"{ds}: DDTree fixed budget")
        for name, marker in (("caddtree", "*"), ("caddtree+accept-scale", "P")):
            c = rows[name]
            ax.plot([c["mean_tree_size"]], [c["modelled_tokens_per_s"]], marker=marker, markersize=12, color=line.get_color(),
                    linestyle="none", label=f"{ds}: {name} (mean tree)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft nodes per round")
    ax.set_ylabel("modelled tokens/s (replay)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def record_all(target, proposer, datasets, args) -> dict[str, list[DraftStreams]]:
    """Record every prompt of every set; saved to --out/streams.npz for later `--streams` replays."""
    from ...datasets import load_prompts

    streams = {ds: [record_draft_streams(target, proposer, target.encode_chat(p), args.max_new_tokens, args.max_tree_nodes)
                    for p in tqdm(load_prompts(ds, args.limit), desc=f"record {ds}")] for ds in datasets}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "streams.npz") as tmp:  # keeps the .npz suffix, which np.savez would otherwise add
        np.savez_compressed(tmp, **{k: v for ds, sts in streams.items() for i, st in enumerate(sts)
                                    for k, v in st.arrays(f"{ds}/{i}/").items()})
    return streams


def load_streams(path, datasets) -> dict[str, list[DraftStreams]]:
    import zipfile

    try:
        archive = np.load(path, allow_pickle=False)
    except (ValueError, OSError, zipfile.BadZipFile) as e:  # numpy's message would suggest unpickling
        raise ValueError(f"{path} is not a draft-stream archive (.npz written by `drafttree replay`): {type(e).__name__}; "
                         "drop --streams to record them again") from None
    if not hasattr(archive, "files"):
        raise ValueError(f"{path} holds one array, not a draft-stream archive (.npz written by `drafttree replay`)")
    with archive as z:
        keys = set(z.files)
        streams = {}
        for ds in datasets:
            n = sum(1 for k in keys if k.startswith(f"{ds}/") and k.endswith("/prompt_len"))
            if n == 0:
                raise ValueError(f"{path} holds no recorded streams for {ds!r}: record them first (drop --streams)")
            streams[ds] = [DraftStreams.from_arrays(z, f"{ds}/{i}/") for i in range(n)]
    return streams


def run(args) -> int:
    from ...load import load_target
    from ...methods import cost_model_path, load_drafter_for
    from ...proposers import ChainPolicy, DFlashProposer
    from .methods import parse_datasets, parse_variants

    budgets = [v.budget for v in parse_variants(["ddtree"], args.budgets) if v.method == "ddtree"]
    if max(budgets) > args.max_tree_nodes:
        raise ValueError(f"--budgets must not exceed --max-tree-nodes={args.max_tree_nodes}, got {args.budgets!r}")
    datasets = parse_datasets(args.datasets)
    target = load_target(args.model, compute=compute_of(args), threads=args.threads)
    cost_src = Path(args.cost_model) if args.cost_model else cost_model_path(target)
    if not cost_src.exists():
        raise FileNotFoundError(f"no cost model at {cost_src}: run `drafttree profile` first (same --dtype/--threads)")
    cost_model = VerifyCostModel.load(cost_src)
    proposer = None if args.streams else DFlashProposer(load_drafter_for(target, args.drafter), target.model, ChainPolicy())
    if proposer is not None and getattr(args, "weaver_stream", False):
        from ...methods import load_weaver_for
        from ...proposers import BestFirstPolicy
        from ...weaver import WeaverProposer

        weaver = load_weaver_for(target, proposer.drafter, getattr(args, "weaver", None))
        proposer = WeaverProposer(proposer.drafter, target.model, weaver, BestFirstPolicy(args.max_tree_nodes),
                                  getattr(args, "weaver_width", 8))
    policies = {f"ddtree-{b}": lambda b=b: FixedBudget(b) for b in budgets}
    policies["caddtree"] = lambda: CostAware(cost_model, args.max_tree_nodes)
    policies["caddtree+accept-scale"] = lambda: CostAware(cost_model, args.max_tree_nodes, adapt_acceptance=True)
    results = dict(config=dict(model=target.name, compute=target.compute_label, threads=torch.get_num_threads(), cost_model=str(cost_src),
                               limit=args.limit, max_new_tokens=args.max_new_tokens,
                               stream=f"weaver (width {getattr(args, 'weaver_width', 8)})" if getattr(args, "weaver_stream", False)
                               else "marginals"),
                   datasets={})
    streams = load_streams(args.streams, datasets) if args.streams else record_all(target, proposer, datasets, args)
    results["datasets"] = {ds: {} for ds in datasets}
    for name, make in policies.items():
        policy = make()  # one instance through all sets in order, as `drafttree bench` keeps its proposers
        for ds in datasets:
            results["datasets"][ds][name] = summarize([replay(st, policy, cost_model) for st in streams[ds]])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", json.dumps(results, indent=1))
    table = markdown(results)
    atomic_write_text(out / "results.md", f"# drafttree replay\n\n{json.dumps(results['config'])}\n\n{table}\n")
    plot(results, out / "replay_tokens_per_s.png")
    print(table)
    print(f"drafttree replay: wrote {out}/results.json, results.md, replay_tokens_per_s.png", file=sys.stderr)
    return 0
