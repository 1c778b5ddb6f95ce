"""`make demo`: answer a prompt with the embedded default model and report the speed."""
from __future__ import annotations

from .engine import generate_ar
from .load import load_target

DEMO_PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"


def run_demo(a) -> int:
    target = load_target(a.model, dtype=a.dtype, threads=a.threads)
    ids = target.encode_chat(DEMO_PROMPT)
    print(f"model: {target.name} ({a.dtype})\nprompt: {DEMO_PROMPT}\n")
    result = generate_ar(target, ids, a.max_new_tokens)
    print(target.decode(result.tokens))
    print()
    print(result.stats.line())
    return 0
