"""`make demo`: answer a question with speculative decoding on the embedded default model, and
measure plain autoregressive decoding of the same prompt in the same run for the speedup."""
from __future__ import annotations

from .load import load_target
from .methods import SHIPPED_DRAFTERS, generate, make_proposer

DEMO_PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
               "How many clips did Natalia sell altogether in April and May?")


def run_demo(a) -> int:
    target = load_target(a.model, dtype=a.dtype, threads=a.threads)
    ids = target.encode_chat(DEMO_PROMPT)
    print(f"model: {target.name} ({a.dtype})\nprompt: {DEMO_PROMPT}\n")
    has_drafter = (SHIPPED_DRAFTERS.get(target.name, SHIPPED_DRAFTERS["smollm2-135m-instruct"]) / "config.json").exists()
    method = a.method if has_drafter else "ar"
    proposer = None if method == "ar" else make_proposer(method, target, budget=a.budget)
    generate(method, target, ids[:16], 8, proposer=proposer)  # warm-up: first calls pay one-off costs
    spec = generate(method, target, ids, a.max_new_tokens, proposer=proposer)
    print(target.decode(spec.tokens))
    print()
    print(spec.stats.line())
    if method != "ar":
        ar = generate("ar", target, ids, a.max_new_tokens)
        same = ("identical to" if ar.tokens == spec.tokens else
                "different from (bf16 rounding differs between a batched verify and one-token steps; "
                "--dtype float32 is bit-exact)")
        print(ar.stats.line())
        print(f"\n{method}: τ = {spec.stats.tau:.2f} tokens per target forward, "
              f"{spec.stats.tokens_per_s:.1f} tok/s vs AR {ar.stats.tokens_per_s:.1f} tok/s "
              f"= {spec.stats.tokens_per_s / ar.stats.tokens_per_s:.2f}x speedup; output {same} AR")
    else:
        print("(no drafter is shipped for this model: plain autoregressive decoding)")
    return 0
