"""`make demo`: answer a question with speculative decoding on the embedded default model, and
measure plain autoregressive decoding of the same prompt in the same run for the speedup."""
from __future__ import annotations

from ..compute import compute_of
from ..load import load_target
from ..methods import NO_DRAFTER, SHIPPED_DRAFTERS, generate, load_drafter_for, make_proposer
from ..validate import check_int

DEMO_PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
               "How many clips did Natalia sell altogether in April and May?")


BESIDE = ("caddtree-online", "lookup")  # the best drafter-tree method (no lookup), and the lookup without a drafter


def run_demo(a) -> int:
    repeats = check_int("--repeats", getattr(a, "repeats", 3), minimum=1)  # before the model loads
    target = load_target(a.model, compute=compute_of(a), threads=a.threads)
    ids = target.encode_chat(DEMO_PROMPT)
    print(f"model: {target.name}, compute path {target.compute_label}: {target.compute.reason}\nprompt: {DEMO_PROMPT}\n")
    shipped = SHIPPED_DRAFTERS.get(target.name)
    has_drafter = a.drafter is not None or (shipped is not None and (shipped / "config.json").exists())
    if not has_drafter:
        print(target.decode(generate("ar", target, ids, a.max_new_tokens).tokens))
        print("(no drafter is shipped for this model: plain autoregressive decoding)")
        return 0
    # The chosen method, plus the drafter's own tree alone and the lookup alone beside it: what each source
    # earns on this machine is visible, not only their merge.
    methods = [] if a.method == "ar" else [a.method] + [m for m in BESIDE if m != a.method]
    drafter = load_drafter_for(target, a.drafter, a.draft_vocab)  # once: every method's proposer shares it
    proposers = {m: None if m == "ar" else make_proposer(m, target, drafter, budget=a.budget,
                                                         weaver=getattr(a, "weaver", None),
                                                         weaver_width=getattr(a, "weaver_width", 8))
                 for m in methods + ["ar"]}
    for m, proposer in proposers.items():
        generate(m, target, ids[:16], 8, proposer=proposer)  # warm-up: first calls pay one-off costs
    # Interleaved repeats, median tok/s: one run per method is at the mercy of a noisy neighbour on a small VM.
    all_runs = {m: [] for m in proposers}
    for _ in range(repeats):
        for m, proposer in proposers.items():
            all_runs[m].append(generate(m, target, ids, a.max_new_tokens, proposer=proposer))
    runs = {m: sorted(rs, key=lambda r: r.stats.tokens_per_s)[len(rs) // 2] for m, rs in all_runs.items()}
    print(target.decode(runs[a.method].tokens) + "\n")
    ar = runs["ar"]
    for run in runs.values():
        print(run.stats.line())
    print(f"(each line: the median-speed run of {repeats}, methods interleaved)\n" if repeats > 1 else "")
    for m in methods:
        spec = runs[m]
        same = ("identical to" if all(r.tokens == ar.tokens for r in all_runs[m] + all_runs["ar"]) else
                "different from (bf16 rounds a batched verify differently from one-token steps; "
                "--dtype float32 matches AR up to fp32 near-ties)")
        st = spec.stats
        if st.drafted_rounds == len(st.tree_sizes):
            gated = ""
        elif m in NO_DRAFTER:  # the lookup alone: a round without a match verifies the root alone
            gated = (f" ({st.drafted_rounds} of {st.rounds} rounds found a continuation to copy, τ {st.drafted_tau:.2f} "
                     "in those; the rest were plain steps)")
        else:
            gated = (f" ({st.drafted_rounds} of {st.rounds} rounds drafted, τ {st.drafted_tau:.2f} in those; the rest "
                     "were plain steps, where drafting did not pay)")
        print(f"{m}: τ = {spec.stats.tau:.2f} tokens per target forward{gated}, "
              f"{spec.stats.tokens_per_s:.1f} tok/s vs AR {ar.stats.tokens_per_s:.1f} tok/s "
              f"= {spec.stats.tokens_per_s / ar.stats.tokens_per_s:.2f}x speedup; output {same} AR")
    return 0
