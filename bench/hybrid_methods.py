"""Speculative methods end to end on the random-weight hybrid at Qwen3.5-0.8B's shape (issue 38 item 3): the cost
model profiled on it as on any target (`drafttree.profile`), a random-weight DFlash drafter at the 0.8B's width, then
AR and the tree methods on the same prompt ids, alternating per prompt: tok/s, τ, and each greedy output against AR's.

    .venv/bin/python bench/hybrid_methods.py [--methods ar,caddtree,caddtree-online,lookup-caddtree-online] \
        [--prompts 3] [--new-tokens 64] [--out docs/gdn/hybrid_methods.json]

The target is bench/hybrid_scale.py's (24 layers as 6 x (3 Gated DeltaNet + 1 gated attention), hidden 1024, q4).
The drafter: no Qwen3.5-0.8B DFlash configuration is stored offline, so it takes the layout of the published Qwen3.5
drafters (Qwen3-style layers, head size 128, block 16, mask id 248070, target layers spread over 1..L-3) at this
target's width with 5 layers as z-lab's Qwen3-4B-DFlash-b16; int8, as the shipped drafter runs. Random weights mean
τ ≈ 1 for the drafter's trees: the figures are what a round costs at this shape, not what a trained drafter gains.
Prompt ids repeat a random 16-token phrase with variations (lookup finds its matches there, as in the tests).
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from drafttree.compute import choose_compute, cpu_info
from drafttree.drafter.model import DFlashConfig, DFlashDrafter
from drafttree.engine import generate_ar
from drafttree.methods import generate, make_proposer
from drafttree.model.hybrid import HybridModel
from drafttree.model.linear import quantize_linears, use_cpu_kernels
from drafttree.profile import profile_costs
from drafttree.target import Target
from hybrid_scale import HIDDEN, MLP, VOCAB, build_quantized, hybrid_config


def drafter_for(layers: int, isa: str, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    d = DFlashDrafter(DFlashConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=5,
                                   num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=VOCAB,
                                   num_target_layers=layers, block_size=16, mask_token_id=248070, rope_theta=1e7,
                                   max_position_embeddings=4096))
    d.reset_parameters(std=0.02)
    return use_cpu_kernels(quantize_linears(d.eval().fuse_projections(), isa), isa)


def prompt_ids(n: int, length: int, gen: torch.Generator) -> list[torch.Tensor]:
    out = []
    for _ in range(n):
        phrase = torch.randint(3, VOCAB, (16,), generator=gen)
        ids = phrase.repeat(length // 16 + 1)[:length].clone()
        flips = torch.randint(0, length, (length // 8,), generator=gen)
        ids[flips] = torch.randint(3, VOCAB, (flips.numel(),), generator=gen)
        out.append(ids)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--methods", default="ar,caddtree,caddtree-online,lookup-caddtree-online")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/gdn/hybrid_methods.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    info, isa = cpu_info(), choose_compute("q4").isa  # the q4 kernels' ISA (honours DRAFTTREE_ISA=avx2)
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    model, _ = build_quantized(HybridModel, hybrid_config(a.layers), isa, gen)
    target = Target(model, None, f"qwen3.5-0.8b-shape-random-{a.layers}l")
    drafter = drafter_for(a.layers, isa)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cost = profile_costs(target, drafter, quick=True, repeats=3, context_lens=(128,))
    profile_s = time.perf_counter() - t0
    methods = [m.strip() for m in a.methods.split(",")]
    proposers = {m: None if m == "ar" else make_proposer(m, target, drafter, budget=8, cost_model=cost)
                 for m in methods}
    prompts = prompt_ids(a.prompts, a.prompt_len, gen)
    rows = {m: {"tokens": 0, "s": 0.0, "accepted": 0, "rounds": 0, "equal_to_ar": 0} for m in methods}
    for ids in tqdm(prompts, desc="prompts"):
        ar = generate_ar(target, ids, a.new_tokens, stop_token_ids=()).tokens
        for m in methods:
            res = generate(m, target, ids, a.new_tokens, proposer=proposers[m], stop_token_ids=())
            r = rows[m]
            r["tokens"] += res.stats.new_tokens
            r["s"] += res.stats.total_s
            r["accepted"] += sum(res.stats.accept_lengths)
            r["rounds"] += len(res.stats.accept_lengths)
            r["equal_to_ar"] += res.tokens == ar
    ar_rate = rows["ar"]["tokens"] / rows["ar"]["s"] if "ar" in rows else None
    print(f"CPU: {info.model}; ISA: {info.isa_summary}; q4 ({isa}); {a.threads} threads; hybrid {a.layers} layers; "
          f"{a.prompts} prompts x {a.new_tokens} tokens after {a.prompt_len}; build {build_s:.0f} s, profile "
          f"{profile_s:.0f} s (draft round {cost.draft_cost_ms(a.prompt_len):.1f} ms at context {a.prompt_len})")
    print("| method | tok/s | × AR | τ | greedy = AR |\n|---|---:|---:|---:|---:|")
    for m, r in rows.items():
        rate = r["tokens"] / r["s"]
        r.update(tok_s=rate, tau=r["accepted"] / max(1, r["rounds"]))
        ratio = f"{rate / ar_rate:.2f}×" if ar_rate else "–"
        print(f"| {m} | {rate:.1f} | {ratio} | {r['tau']:.2f} | {r['equal_to_ar']}/{a.prompts} |")
    curve = {n: cost.verify_ms_for_tokens(n, 128) for n in (1, 2, 4, 8, 16, 32, 64)}
    print("cost model at context 128, ms: " + ", ".join(f"{n}: {v:.1f}" for n, v in curve.items()))
    if a.out:
        Path(a.out).write_text(json.dumps({"cpu": info.model, "isa": info.isa_summary, "machine": platform.machine(),
                                           "threads": a.threads, "layers": a.layers, "build_s": build_s,
                                           "profile_s": profile_s, "draft_ms": cost.draft_cost_ms(a.prompt_len),
                                           "verify_ms": curve, "methods": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
