"""How close each kernel path's next-token distribution is to the float model's, on the same token sequences.

The reference is the fp32 path (the embedded model's GGUF dequantized). For each prompt its AR reply (fp32, greedy)
is generated once; every path then scores the same prompt + reply in one forward (teacher forcing) and is compared
position by position: top-1 agreement and KL(fp32 ‖ path) in nats. The int8 path is measured with and without the
activation smoothing it loads with (drafttree.model.smoothing); --sweep tries one smoothing α per linear kind on
the given prompts (pick α on training prompts, report on evaluation prompts).

    .venv/bin/python bench/int8_fidelity.py --limit 7
    .venv/bin/python bench/int8_fidelity.py --prompts-jsonl ../shared/data/gsm8k/train.jsonl --limit 21 --sweep
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json

import torch

from drafttree.compute import choose_compute
from drafttree.datasets import load_prompts
from drafttree.engine import generate_ar
from drafttree.gguf_convert import find_embedded_gguf
from drafttree.load import load_target
from drafttree.model.gguf_blocks import q4_1_blocks
from drafttree.model.linear import quantize_target
from drafttree.model.smoothing import SmoothingAlphas, calibration_tokens, smooth_for_int8


def scored(model, sequences) -> torch.Tensor:
    """Log-probabilities at every reply position (and the last prompt position) of every sequence."""
    out = []
    for seq, n_prompt in sequences:
        rows = torch.arange(n_prompt - 1, seq.numel())
        out.append(model.forward(model.new_state(seq.numel() + 1), seq, logits_rows=rows).logits.float())
    return torch.cat(out).log_softmax(-1)


def compare(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    return agree, kl


def int8_model(fp32_model, tokenizer, alphas: SmoothingAlphas | None, q4_blocks: dict | None = None):
    """The int8 path on a copy of the float model; with `q4_blocks`, those linears keep the GGUF's Q4_1 blocks."""
    model = copy.deepcopy(fp32_model)
    if alphas is not None:
        smooth_for_int8(model, calibration_tokens(tokenizer, model.config.vocab_size), alphas)
    return quantize_target(model, choose_compute("int8").isa, q4_blocks or False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--limit", type=int, default=7, help="prompts per evaluation set (GSM8K, HumanEval, MT-Bench)")
    ap.add_argument("--prompts-jsonl", help="prompts from a JSONL file's 'question' field instead (e.g. GSM8K train)")
    ap.add_argument("--reply-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sweep", action="store_true", help="also try α 0.4-0.8 for one linear kind at a time")
    args = ap.parse_args()

    ref_target = load_target(args.model, compute="fp32", threads=args.threads)
    if args.prompts_jsonl:
        with open(args.prompts_jsonl) as f:
            prompts = [json.loads(line)["question"] for line in f][: args.limit]
    else:
        prompts = [p for ds in ("gsm8k", "humaneval", "mtbench") for p in load_prompts(ds, args.limit)]
    sequences = []
    for text in prompts:
        ids = ref_target.encode_chat(text)
        reply = generate_ar(ref_target, ids, args.reply_tokens, stop_token_ids=()).tokens
        sequences.append((torch.cat([ids, torch.tensor(reply[:-1], dtype=torch.long)]), ids.numel()))
    ref = scored(ref_target.model, sequences)
    print(f"{len(prompts)} prompts, {ref.shape[0]} positions, against fp32; kernels: {choose_compute('int8').isa}")
    print("| path | top-1 agreement | KL (nats) |\n|---|---:|---:|")

    def report(label, model):
        agree, kl = compare(ref, scored(model, sequences))
        print(f"| {label} | {100 * agree:.2f} % | {kl:.4f} |", flush=True)

    report("q4 (the GGUF's Q4_1 blocks)", load_target(args.model, compute="q4", threads=args.threads).model)
    report("int8, no smoothing", int8_model(ref_target.model, ref_target.tokenizer, None))
    report(f"int8, smoothed {SmoothingAlphas()}", int8_model(ref_target.model, ref_target.tokenizer, SmoothingAlphas()))
    downs = {k: v for k, v in q4_1_blocks(find_embedded_gguf(args.model)).items() if k.endswith("mlp.down")}
    report("int8 smoothed, down on Q4_1", int8_model(ref_target.model, ref_target.tokenizer,
                                                      SmoothingAlphas(down=None), downs))
    if args.sweep:
        for kind in ("qkv", "o", "gate_up", "down"):
            for alpha in (0.4, 0.5, 0.6, 0.7, 0.8):
                alphas = dataclasses.replace(SmoothingAlphas(), **{kind: alpha})
                report(f"int8, α {kind} {alpha} (others default)", int8_model(ref_target.model, ref_target.tokenizer,
                                                                            alphas))


if __name__ == "__main__":
    main()
