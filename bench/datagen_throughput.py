"""Reply tokens/s of the self-distillation generators, same prompts, same machine, same run: drafttree's
runtime (`train data --engine drafttree`: --width sequences in one batched forward a step, on --compute) beside
transformers' batched generate (`--engine hf`, bf16, the whole prompt set as one batch). Both keep the target's
top-k and the captured layers, as `train data` does. Prints the CPU's ISA.

  .venv/bin/python bench/datagen_throughput.py --prompts 64 --max-new-tokens 128 [--out results.json]
"""
import argparse
import json
import random
import time

import torch

from drafttree.compute import cpu_info
from drafttree.training.batched_replies import generate_batch, hf_model_for
from drafttree.training.datagen import gsm8k_train_prompts
from drafttree.training.runtime_replies import generate_runtime
from drafttree.load import load_target
from drafttree.sampling import SamplingParams

LAYERS = (1, 7, 14, 20, 27)


def timed(fn):
    t0 = time.perf_counter()
    replies = fn()
    seconds = time.perf_counter() - t0
    tokens = sum(r.tokens.numel() - r.prompt_len for r in replies)
    return replies, {"seconds": round(seconds, 2), "reply_tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--compute", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--gsm8k", default="../shared/data/gsm8k/train.jsonl")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--width", type=int, default=64, help="drafttree engine: sequences decoded together")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cpu = cpu_info()
    target = load_target(a.model, compute=a.compute, threads=a.threads)
    questions = gsm8k_train_prompts(a.gsm8k)
    random.Random(0).shuffle(questions)
    prompts = [target.encode_chat(q) for q in questions[: a.prompts]]
    stops = set(target.stop_token_ids)
    print(f"CPU: {cpu.model} ({cpu.arch}); ISA: {cpu.isa_summary}; torch threads {torch.get_num_threads()}; "
          f"{len(prompts)} GSM8K train prompts, greedy, <= {a.max_new_tokens} new tokens, top-{a.top_k}")
    ours, res_ours = timed(lambda: generate_runtime(target.model, prompts, a.max_new_tokens, SamplingParams(), LAYERS,
                                                    stops, top_k=a.top_k, width=a.width))
    hf, pad = hf_model_for(target, torch.bfloat16)
    theirs, res_hf = timed(lambda: generate_batch(hf, prompts, a.max_new_tokens, SamplingParams(), LAYERS, stops, pad,
                                                  top_k=a.top_k))
    same = sum(x.tokens.tolist() == y.tokens.tolist() for x, y in zip(ours, theirs))
    rows = {f"drafttree runtime ({target.compute_label}, width {a.width})": res_ours,
            f"transformers generate (bf16, batch {len(prompts)})": res_hf}
    print("| generator | s | reply tokens | reply tokens/s |\n|---|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['seconds']} | {r['reply_tokens']} | {r['tokens_per_s']} |")
    ratio = res_ours["tokens_per_s"] / res_hf["tokens_per_s"]
    print(f"drafttree ÷ transformers: {ratio:.2f}x; identical replies (q4 vs bf16 weights): {same}/{len(prompts)}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"cpu": cpu.model, "isa": cpu.isa_summary, "threads": torch.get_num_threads(),
                       "prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "top_k": a.top_k,
                       "results": rows, "ratio": round(ratio, 2), "identical_replies": same}, f, indent=1)


if __name__ == "__main__":
    main()
