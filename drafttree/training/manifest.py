"""Training-data manifests: what a drafter was trained on, and the proof that no evaluation prompt is in it.

Each generator writes manifest.json beside its shards (settings, decontamination, per-source counts and
licences, and `prompt_digest` of every prompt). Shards made before manifests existed get their digests from
the shards themselves (`digests_from_shards`: the user turn decoded from the stored prompt tokens). `merge`
joins the manifests of every data directory a drafter was trained on into the one shipped beside its weights;
tests/training/test_training_manifest.py checks it against every evaluation prompt.

  python -m drafttree.training.manifest --out drafttree/weights/NAME/data-manifest.json runs/data-a runs/data-b
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from ..atomic import atomic_write_text
from ..datasets import CODE_INSTRUCTION, MATH_INSTRUCTION
from ..validate import InputError
from .sources import SOURCES_INFO


def prompt_digest(prompt: str) -> str:
    """A short hash of a prompt without the instructions this repository adds, case and spacing folded: the
    manifest lists these so a test can check that no evaluation prompt was trained on."""
    text = prompt.replace(MATH_INSTRUCTION, "").replace(CODE_INSTRUCTION, "")
    return hashlib.sha256(" ".join(text.lower().split()).encode()).hexdigest()[:16]


def evaluation_digests() -> set[str]:
    """`prompt_digest` of every evaluation prompt (HumanEval, the GSM8K test sample, both MT-Bench turns) and of
    drafttree's own prompt sets: what a training manifest's digests must never contain."""
    from ..datasets import BUILT_IN, SOURCES, _read_lines, load_prompts

    digests = {prompt_digest(p) for name in (*SOURCES, *BUILT_IN) for p in load_prompts(name)}
    digests |= {prompt_digest(t) for r in _read_lines(*SOURCES["mtbench"]) for t in r["turns"]}
    return digests


class DataManifest:
    """manifest.json beside the shards: settings, decontamination, per-source counts and licences, and the
    digest of every prompt decoded (`prompt_digest`), rewritten atomically after each shard."""

    def __init__(self, out: Path, settings: dict, decontamination: dict):
        out.mkdir(parents=True, exist_ok=True)
        self.file, self.t0 = out / "manifest.json", time.perf_counter()
        old = json.loads(self.file.read_text()) if self.file.exists() else None
        if old is not None and old.get("settings") != settings:
            raise InputError(f"{self.file} was made with other settings ({old.get('settings')}): use another --out")
        self.data = old or {"generator": "self-distillation", "settings": settings, "decontamination": decontamination,
                            "answers": "the target's own replies (greedy, or sampled where counted below)",
                            "sources": {k: {**v, "prompts": 0, "reply_tokens": 0, "tokens": 0}
                                        for k, v in SOURCES_INFO.items() if k != "python-stdlib-docs"},
                            "sampled_prompts": 0, "wall_s": 0.0, "prompt_digests": []}
        self.wall0 = self.data["wall_s"]

    def add(self, user_turns: list[str], source: str, tokens: int, reply_tokens: int, sampled: bool):
        """One decoded prompt: its user turns (one, or a conversation's, each digested: the evaluation check and
        --skip-seen see every turn the target read)."""
        entry = self.data["sources"][source]
        entry["prompts"] += 1
        entry["user_turns"] = entry.get("user_turns", 0) + len(user_turns)  # a digest each
        entry["tokens"] += tokens
        entry["reply_tokens"] += reply_tokens
        self.data["sampled_prompts"] += int(sampled)
        self.data["prompt_digests"].extend(prompt_digest(t) for t in user_turns)

    def save(self):
        self.data["wall_s"] = round(self.wall0 + time.perf_counter() - self.t0, 1)
        atomic_write_text(self.file, json.dumps(self.data, indent=1))


def user_turn(prompt_text: str) -> str:
    """The user message of a chat-formatted prompt (ChatML, as SmolLM2's template writes it)."""
    head, sep, rest = prompt_text.rpartition("<|im_start|>user\n")
    if not sep:
        raise ValueError("no ChatML user turn in the prompt")
    return rest.split("<|im_end|>", 1)[0]


def digests_from_shards(data_dir: str | Path, tokenizer) -> list[str]:
    """`prompt_digest` of every sequence's user turn, decoded from the prompt rows (loss mask 0) of the shards
    (token ids and masks only: the features are never read)."""
    from safetensors import safe_open

    out = []
    for f in sorted(Path(data_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            ids, mask, offsets = (sf.get_tensor(k) for k in ("input_ids", "loss_mask", "offsets"))
        for lo, hi in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            m = mask[lo:hi].bool()
            first = int(m.nonzero()[0]) if m.any() else hi - lo
            out.append(prompt_digest(user_turn(tokenizer.decode(ids[lo:lo + first].tolist()))))
    return out


def merge(paths: list[Path], out: Path, tokenizer=None) -> dict:
    """One manifest for everything a drafter saw: each directory's manifest.json, or (none there) digests
    recovered from its shards with the tokenizer; a path that is a file is an earlier merged manifest (a
    fine-tuned drafter's data is its parent's plus its own)."""
    merged = {"parts": [], "sources": {}, "prompt_digests": []}

    def add_sources(sources: dict):
        for name, entry in sources.items():
            if "prompts" in entry and "user_turns" not in entry:  # made before conversations: a user turn a prompt
                entry = {**entry, "user_turns": entry["prompts"]}
            tot = merged["sources"].setdefault(name, {k: v for k, v in entry.items() if isinstance(v, str)})
            for k, v in entry.items():
                if not isinstance(v, str):
                    tot[k] = tot.get(k, 0) + v

    for d in paths:
        if d.is_file():
            m = json.loads(d.read_text())
            if not {"parts", "sources", "prompt_digests"} <= set(m):
                raise InputError(f"{d} is not a merged data manifest (parts, sources, prompt_digests): give data "
                                 "directories or a drafter's data-manifest.json")
            merged["parts"] += m["parts"]
            add_sources(m["sources"])
            merged["prompt_digests"] += m["prompt_digests"]
            continue
        f = d / "manifest.json"
        if f.exists():
            m = json.loads(f.read_text())
            part = {k: m[k] for k in ("generator", "settings", "decontamination", "wall_s") if k in m}
            digests = m["prompt_digests"]
            add_sources(m["sources"])
        else:
            if tokenizer is None:
                raise InputError(f"{d} has no manifest.json: give --model so its prompts can be read from the shards")
            digests = digests_from_shards(d, tokenizer)
            part = {"generator": "self-distillation (shards made before manifests; digests read from the shards)"}
            entry = merged["sources"].setdefault("recovered-from-shards", {"origin": "user turns decoded from the "
                                                 "shards' prompt tokens", "prompts": 0})
            entry["prompts"] += len(digests)
        part.update(directory=str(d), prompts=len(digests))
        merged["parts"].append(part)
        merged["prompt_digests"] += digests
    atomic_write_text(out, json.dumps(merged, indent=1))
    return merged


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", help="data directories the drafter was trained on (or earlier merged manifests)")
    ap.add_argument("--out", required=True, help="the merged manifest (JSON)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="its tokenizer reads shards without a manifest")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from ..gguf_convert import EMBEDDED, convert_embedded

    path = convert_embedded(a.model) if a.model in EMBEDDED else a.model
    m = merge([Path(d) for d in a.dirs], Path(a.out), AutoTokenizer.from_pretrained(str(path)))
    print(f"{len(m['prompt_digests'])} prompts from {len(m['parts'])} directories -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
