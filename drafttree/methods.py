"""Decoding methods by name: `ar`, `chain`, `ddtree`, `caddtree`, `caddtree-online`, with retrieval branches
(drafttree.lookup) `lookup` (no drafter), `lookup-ddtree`, `lookup-caddtree`, `lookup-caddtree-online` (with
caddtree-online's draft gate, one for rounds with a lookup match and one for rounds without: lookup-only rounds
where the drafter does not pay), and with Weaver's path-conditioned
trees (drafttree.weaver) `weaver-ddtree`, `weaver-caddtree` — the one place the CLI, the demo,
the benchmark and the server turn a method name into a generation call."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from .engine import GenerationResult, Sequence, generate_ar, generate_speculative
from .gguf_convert import cache_root
from .sampling import SamplingParams
from .target import Target

METHODS = ("ar", "chain", "ddtree", "caddtree", "caddtree-online", "lookup", "lookup-ddtree", "lookup-caddtree",
           "lookup-caddtree-online", "weaver-ddtree", "weaver-caddtree")
COST_AWARE = ("caddtree", "caddtree-online", "lookup-caddtree", "lookup-caddtree-online",
              "weaver-caddtree")  # need the machine's cost model
WEAVER_METHODS = ("weaver-ddtree", "weaver-caddtree")  # need a trained Weaver beside the drafter
DEFAULT_WEAVER_WIDTH = 8  # Weaver expands this many nodes per call
NO_DRAFTER = ("ar", "lookup")  # run without a drafter
WEIGHTS_DIR = Path(__file__).parent / "weights"
SHIPPED_DRAFTERS = {"smollm2-135m-instruct": WEIGHTS_DIR / "smollm2-135m-instruct-dflash"}
SHIPPED_WEAVERS = {"smollm2-135m-instruct": WEIGHTS_DIR / "smollm2-135m-instruct-weaver"}


def add_drafter_args(p) -> None:
    """--drafter / --draft-vocab (an argparse parser): which drafter, and how much of its draft vocabulary."""
    p.add_argument("--drafter", default=None, help="drafter directory (default: the one shipped for the model)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help=f"draft-vocabulary ids the drafter's head scores, most frequent first (default "
                        f"{DEFAULT_DRAFT_VOCAB} where the drafter ranks them; 0: all of its draft vocabulary)")


def add_weaver_args(p) -> None:
    """--weaver / --weaver-width (an argparse parser), wherever --drafter is: the weaver-* methods' adapter and its
    expansion width."""
    p.add_argument("--weaver", default=None, help="Weaver directory for weaver-ddtree / weaver-caddtree "
                   "(default: the one shipped for the model)")
    p.add_argument("--weaver-width", type=int, default=DEFAULT_WEAVER_WIDTH,
                   help="nodes Weaver expands per call (1: exact best-first)")


def default_drafter_path(target: Target) -> Path:
    path = SHIPPED_DRAFTERS.get(target.name)
    if path is None or not (path / "config.json").exists():
        raise FileNotFoundError(f"no drafter ships for {target.name!r}: pass --drafter DIR (a DFlash checkpoint directory)")
    return path


# The draft vocabulary a drafter keeps where its directory ranks its ids (draft_vocab_rank.safetensors): the head's
# rows read per drafted depth. Measured on a Zen 3 (AVX2, 2 threads, 9 prompts): see the drafter's model card.
DEFAULT_DRAFT_VOCAB = 8192


def load_drafter_for(target: Target, path: str | Path | None = None, draft_vocab: int | None = None):
    """The drafter for `target` (the shipped one without `path`), on the target's compute path. `draft_vocab`: how
    many of its draft-vocabulary ids to keep, most frequent first (None: DEFAULT_DRAFT_VOCAB where the directory
    ranks them, else all; 0: all)."""
    from .drafter.checkpoint import load_drafter
    from .drafter.reduce_vocab import RANK_FILE, load_rank, narrow_draft_vocab

    path = Path(path or default_drafter_path(target))
    drafter = load_drafter(path, dtype=target.model.dtype)
    rank_file = path / RANK_FILE
    if draft_vocab and not rank_file.exists():
        raise FileNotFoundError(f"--draft-vocab {draft_vocab} needs {rank_file} (the draft vocabulary ranked by "
                                "frequency): write it with `python -m drafttree.training.text_vocab --rank-out`")
    size = DEFAULT_DRAFT_VOCAB if draft_vocab is None else draft_vocab
    if size and rank_file.exists() and size < drafter.config.draft_vocab_size:
        narrow_draft_vocab(drafter, load_rank(rank_file), size)
    if target.compute is not None and target.compute.path in ("int8", "q4"):  # the drafter runs int8 (it is small)
        from .model.linear import quantize_linears, use_cpu_kernels

        use_cpu_kernels(quantize_linears(drafter.fuse_projections(), target.compute.isa), target.compute.isa)
    cfg, tcfg = drafter.config, target.model.config
    if cfg.vocab_size != tcfg.vocab_size or cfg.target_hidden_size != tcfg.hidden_size:
        raise ValueError(f"drafter (vocab {cfg.vocab_size}, target hidden {cfg.target_hidden_size}) does not fit "
                         f"target {target.name!r} (vocab {tcfg.vocab_size}, hidden {tcfg.hidden_size})")
    if max(cfg.target_layer_ids) >= tcfg.num_layers:
        raise ValueError(f"drafter reads target layers {cfg.target_layer_ids} but the target has {tcfg.num_layers}")
    return drafter.eval()


def load_weaver_for(target: Target, drafter, path: str | Path | None = None):
    """The Weaver for this target and drafter: `path`, or the one shipped for the target."""
    from .weaver.checkpoint import check_weaver_fits, load_weaver

    if path is None:
        path = SHIPPED_WEAVERS.get(target.name)
        if path is None or not (path / "config.json").exists():
            raise FileNotFoundError(f"no Weaver ships for {target.name!r}: pass --weaver DIR (a Weaver directory from "
                             "`drafttree train weaver`)")
    weaver = load_weaver(path)
    check_weaver_fits(weaver.config, drafter.config, target.model.config, where=f"the Weaver in {path}")
    return weaver


def cost_model_path(target: Target) -> Path:
    name = Path(target.name).name
    isa = ""
    if target.compute is not None and target.compute.isa:  # the C++ kernels' path: their build too (a kernel
        from .ops.cpu_extension import build_name            # change re-profiles instead of reusing old costs)

        isa = f"-{target.compute.isa}-{build_name()}"
    return (cache_root() / "costmodels" /
            f"{name}-{target.compute_path}{isa}-t{torch.get_num_threads()}-v{COST_MODEL_VERSION}.json")


# 2: the draft cost is a CaDDTree round's (its depth cap, the first lazy chunk of head rows), not a 15-deep chain's;
# 3: its drafter block stops at the depth cap and its first lazy chunk of head rows is 4 rows
# 4: the drafter's block follows a one-deep tree, 2-row first chunk, the drafter's default (narrowed) draft vocabulary
COST_MODEL_VERSION = 4


def load_or_profile_cost_model(target: Target, drafter, quiet: bool = False):
    """The machine's verify-cost model for this target, profiled (about a minute) on first use."""
    from .costmodel import VerifyCostModel
    from .profile import profile_costs

    from .validate import CACHE_HINT, check_writable

    path = cost_model_path(target)
    if path.exists():
        return VerifyCostModel.load(path)
    check_writable(path.parent, "the cost-model cache", hint=CACHE_HINT)  # before a minute of profiling, not after
    if not quiet:
        print(f"drafttree: no cost model for this machine and compute path yet; profiling into {path} "
              "(about a minute; `drafttree profile` redoes it)", file=sys.stderr)
    model = profile_costs(target, drafter, quick=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save(path)
    return model


def make_proposer(method: str, target: Target, drafter=None, budget: int = 16, cost_model=None, max_tree_nodes: int = 128,
                  weaver=None, weaver_width: int = DEFAULT_WEAVER_WIDTH):
    """`weaver` (weaver-* methods): a loaded Weaver, its directory, or None for the one shipped for the target."""
    from .proposers import BestFirstPolicy, ChainPolicy, CostAwarePolicy, DFlashProposer

    if method not in METHODS or method == "ar":
        raise ValueError(f"unknown speculative method {method!r}: choose from {METHODS[1:]}")
    if method == "lookup":
        from .lookup import LookupProposer

        return LookupProposer(budget)
    if method.startswith("lookup-"):  # the drafter's method, its marginals merged with lookup continuations
        from .lookup import LookupDFlashProposer

        return LookupDFlashProposer(make_proposer(method.removeprefix("lookup-"), target, drafter, budget, cost_model,
                                                  max_tree_nodes))
    drafter = drafter if drafter is not None else load_drafter_for(target)
    if method in WEAVER_METHODS:
        from .weaver import WeaverProposer

        if weaver is None or isinstance(weaver, (str, Path)):
            weaver = load_weaver_for(target, drafter, weaver)
        base = make_proposer(method.removeprefix("weaver-"), target, drafter, budget, cost_model, max_tree_nodes)
        return WeaverProposer(drafter, target.model, weaver, base.policy, weaver_width)
    if method == "chain":
        policy = ChainPolicy()
    elif method == "ddtree":
        if budget < 1:
            raise ValueError(f"--budget must be >= 1, got {budget}")
        policy = BestFirstPolicy(budget)
    else:
        if cost_model is None:
            cost_model = load_or_profile_cost_model(target, drafter)
        policy = CostAwarePolicy(cost_model, max_tree_nodes, recalibrate=method == "caddtree-online")
    # caddtree-online adapts to the request: recalibrated trees, and plain rounds where drafting does not pay
    return DFlashProposer(drafter, target.model, policy, gate=method == "caddtree-online")


class Decoder:
    """One target with its drafter and cost model loaded once; makes independent sequences for any
    method (proposers are stateless and shared; each sequence holds its own state)."""

    def __init__(self, target: Target, drafter=None, budget: int = 16, max_tree_nodes: int = 128, cost_model=None,
                 weaver=None, weaver_width: int = DEFAULT_WEAVER_WIDTH):
        self.target, self.budget, self.max_tree_nodes, self.cost_model = target, budget, max_tree_nodes, cost_model
        self.weaver_width = weaver_width
        self._weaver = weaver  # a path, a loaded Weaver, or None (the shipped one); loaded by the first weaver-* method
        self._drafter_source = drafter  # a path, a loaded drafter, or None (the shipped one)
        self._drafter = None if drafter is None or isinstance(drafter, (str, Path)) else drafter
        self._proposers: dict[str, object] = {}

    @property
    def drafter(self):
        if self._drafter is None:
            self._drafter = load_drafter_for(self.target, self._drafter_source)
        return self._drafter

    def proposer(self, method: str):
        """None for "ar"; otherwise the method's proposer, built on first use."""
        if method == "ar":
            return None
        if method not in self._proposers:
            drafter = None if method in NO_DRAFTER else self.drafter
            if method in WEAVER_METHODS and (self._weaver is None or isinstance(self._weaver, (str, Path))):
                self._weaver = load_weaver_for(self.target, self.drafter, self._weaver)  # once for both methods
            self._proposers[method] = make_proposer(method, self.target, drafter, self.budget, self.cost_model,
                                                    self.max_tree_nodes, self._weaver, self.weaver_width)
            if method in COST_AWARE and self.cost_model is None:
                self.cost_model = self._proposers[method].policy.cost_model  # profiled once for both
        return self._proposers[method]

    def prepare(self, methods=METHODS) -> None:
        """Build the methods' proposers now (loading the drafter, profiling a cost model on first use),
        rather than on a first request."""
        for method in methods:
            self.proposer(method)

    def sequence(self, method: str, prompt_ids, max_new_tokens: int = 256, sampling: SamplingParams = SamplingParams(),
                 stop_token_ids=None) -> Sequence:
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}: choose from {METHODS}")
        return Sequence(self.target, prompt_ids, self.proposer(method), max_new_tokens, sampling, stop_token_ids)


def generate(method: str, target: Target, prompt_ids, max_new_tokens: int = 256, sampling: SamplingParams = SamplingParams(),
             proposer=None, on_tokens=None, stop_token_ids=None, **proposer_kwargs) -> GenerationResult:
    if method == "ar":
        return generate_ar(target, prompt_ids, max_new_tokens, sampling, stop_token_ids, on_tokens)
    proposer = proposer or make_proposer(method, target, **proposer_kwargs)
    return generate_speculative(target, prompt_ids, proposer, max_new_tokens, sampling, stop_token_ids, on_tokens)


def proposer_with(method: str, target: Target, args):
    """CLI glue: the method's proposer (None for "ar") from parsed arguments, everything it prepares done now."""
    if method == "ar":
        return None
    drafter = None if method in NO_DRAFTER else load_drafter_for(target, getattr(args, "drafter", None),
                                                                 getattr(args, "draft_vocab", None))
    return make_proposer(method, target, drafter, budget=getattr(args, "budget", 16), weaver=getattr(args, "weaver", None),
                         weaver_width=getattr(args, "weaver_width", DEFAULT_WEAVER_WIDTH))


def generate_with(method: str, target: Target, prompt_ids, args, proposer, on_tokens=None) -> GenerationResult:
    """CLI glue: sampling options from parsed arguments; `proposer` from `proposer_with` (None for "ar")."""
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    return generate(method, target, prompt_ids, args.max_new_tokens, sampling, proposer=proposer, on_tokens=on_tokens)
