"""Held-out metrics of saved Weaver checkpoints (the last `--val-sequences` sequences of the data, which
`drafttree train weaver` never trains on), with many more blocks than the trainer's periodic check: to
choose among checkpoints of one run by held-out loss.

  .venv/bin/python bench/weaver_heldout.py --data runs/weaver/data runs/weaver/ckpt-* --out runs/weaver/heldout.json
"""
from __future__ import annotations

import argparse
import json

import torch

from drafttree.atomic import atomic_write_text
from drafttree.drafter.checkpoint import load_drafter
from drafttree.training.data import FeatureDataset
from drafttree.training.train import BlockForward, build_batch, load_target_head
from drafttree.methods import SHIPPED_DRAFTERS
from drafttree.weaver.checkpoint import load_weaver
from drafttree.training.weaver_train import _add, step_metrics, summarise, teacher_forced


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("weavers", nargs="+")
    ap.add_argument("--data", required=True)
    ap.add_argument("--val-sequences", type=int, default=16)
    ap.add_argument("--blocks-per-seq", type=int, default=48)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    drafter = load_drafter(SHIPPED_DRAFTERS["smollm2-135m-instruct"], dtype=torch.float32).eval().requires_grad_(False)
    embed, head, _, _ = load_target_head("smollm2-135m-instruct")
    embed = embed.float()
    head = drafter.head_weight(head).to(torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32)
    token_ids = drafter.draft_vocab if drafter.config.draft_vocab_size else None
    data = FeatureDataset(a.data)
    n_val = min(a.val_sequences, len(data) // 5)
    gen = torch.Generator().manual_seed(777)
    batches = [build_batch([data[i]], drafter.config, a.blocks_per_seq, gen, 7.0, a.max_context)
               for i in range(len(data) - n_val, len(data))]
    batches = [b for b in batches if b is not None]
    forward = BlockForward(drafter, embed)
    results = {}
    for path in a.weavers:
        weaver = load_weaver(path)
        acc, loss, w = None, 0.0, 0.0
        with torch.no_grad():
            for b in batches:
                logp, cls, ids = teacher_forced(weaver, forward, b, embed, head, drafter.config.block_size, token_ids)
                loss += float(-(logp.gather(-1, cls[..., None])[..., 0] * b["weights"]).sum())
                w += float(b["weights"].sum())
                acc = _add(acc, step_metrics(logp, cls, ids, b["labels"], weaver.config.num_candidates))
        results[str(path)] = {"loss": loss / w, "blocks": acc["blocks"], **summarise(acc)}
        r = results[str(path)]
        print(f"{path}: loss {r['loss']:.4f}, chain τ Weaver {r['tau_weaver']:.3f} vs drafter {r['tau_drafter']:.3f} "
              f"({r['blocks']} blocks)", flush=True)
    if a.out:
        atomic_write_text(a.out, json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
