"""Labelled positions/s of the anchor-parallel generator (drafttree.training.anchor_labels) beside the
self-distillation generator (datagen.generate_packed), same machine, same run; prints the CPU's ISA.

  .venv/bin/python bench/anchor_labels_throughput.py --seconds 40 --threads 1 [--out results.json]
"""
import argparse
import json

from drafttree.compute import cpu_info
from drafttree.training.anchor_labels import measure_throughput
from drafttree.load import load_target


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--compute", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=40.0, help="for the old generator and stride-8 anchors; "
                    "half of it for the two other variants")
    ap.add_argument("--gsm8k", default="../shared/data/gsm8k/train.jsonl")
    ap.add_argument("--hf-batch", type=int, default=128, help="transformers' batched generate at this batch "
                    "(`train data --engine hf`), whole batches")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cpu = cpu_info()
    target = load_target(a.model, compute=a.compute, threads=a.threads)
    import torch

    print(f"CPU: {cpu.model} ({cpu.arch}); ISA: {cpu.isa_summary}; torch threads {torch.get_num_threads()}; "
          f"target {a.model} on {target.compute_label}")
    s = a.seconds
    res = measure_throughput(target, {"packed": s, f"hf-{a.hf_batch}": s, "anchors-s8": s, "anchors-s8-decode-all": s / 2,
                                      "anchors-s1": s / 2}, gsm8k=a.gsm8k)
    print("| generator | s | texts | labelled blocks/s | label tokens/s |\n|---|---:|---:|---:|---:|")
    for name, r in res.items():
        print(f"| {name} | {r['seconds']} | {r['texts']} | {r['blocks_per_s']} | {r['label_tokens_per_s']} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"cpu": cpu.model, "isa": cpu.isa_summary, "compute": target.compute_label,
                       "threads": torch.get_num_threads(), "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
