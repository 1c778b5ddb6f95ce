"""Give a trained drafter a reduced draft vocabulary after training: its head scores only the N most
frequent reply tokens of the training shards (rows of the target's head, nothing retrained;
drafter.reduce_vocab.with_draft_vocab).

  python -m drafttree.training.draft_vocab --drafter DIR --data DATA_DIR --size 8192 --out DIR
"""
from __future__ import annotations

import argparse

from ..drafter.checkpoint import load_drafter, save_drafter
from ..drafter.reduce_vocab import with_draft_vocab
from .data import FeatureDataset

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--data", required=True, help="feature shards whose reply tokens are counted")
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    drafter = load_drafter(a.drafter)
    counts = FeatureDataset(a.data).token_counts(drafter.config.vocab_size)
    reduced, coverage = with_draft_vocab(drafter, counts, a.size)
    save_drafter(reduced, a.out)
    print(f"draft vocabulary {a.size} ids cover {coverage:.2%} of the reply tokens; saved to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
