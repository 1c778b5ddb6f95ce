"""A random-weight hybrid at Qwen3.5-0.8B's published shape on the q4 path (issue 38 item 3): AR tok/s against a
dense random model of the same parameter count on the same path, and the verify cost of 1-64 tokens as a chain
and as a tree, with the share of it spent in the GDN layers and the fused GDN kernel against the composed op.
The hybrid's AR step is timed with the one-token GDN step kernel (ops/gdn/step.py) on and off, alternating.

    OMP_NUM_THREADS=1 .venv/bin/python bench/hybrid_scale.py [--layers 24] [--ar-only] [--out docs/gdn/hybrid_scale.json]

Weights are random (no GDN checkpoint installs offline); the timings depend on the shapes, not the values.
The shape (Qwen3.5-0.8B's text config): hidden 1024, 24 layers as 6 x (3 Gated DeltaNet + 1 gated attention),
MLP 3584, attention 8 query / 2 KV heads of 256 (rotary on 64 channels), GDN 16 key / 16 value heads of 128,
conv 4, vocabulary 248,320, tied embedding. The dense model has the same width, MLP and vocabulary, Qwen3-style
attention (16 x 128 query heads, 8 KV heads), and as many layers as make its parameter count closest.
Every timing is the median of --repeats runs after a warm-up; everything runs in this one process.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from drafttree.compute import choose_compute, cpu_info
from drafttree.engine import verify_input
from drafttree.model.config import ModelConfig
from drafttree.model.hybrid import HybridModel
from drafttree.model.hybrid_config import HybridConfig
from drafttree.model.linear import quantize_linears, quantize_target
from drafttree.model.transformer import Transformer
from drafttree.ops.gdn import fused, step
from drafttree.tree import random_tree

VOCAB, HIDDEN, MLP = 248_320, 1024, 3584
SIZES = (1, 2, 4, 8, 16, 32, 64)


def hybrid_config(layers: int) -> HybridConfig:
    return HybridConfig(
        family="qwen3_5", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=layers,
        layer_types=tuple("full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)),
        rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=4096,  # the real 262,144 only grows RoPE tables
        num_heads=8, num_kv_heads=2, head_dim=256, rotary_dim=64, rope_theta=1e7, attention_bias=False,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, intermediate_size=MLP)


def dense_config(layers: int) -> ModelConfig:
    return ModelConfig(model_type="qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_layers=layers,
                       num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                       max_position_embeddings=4096, tie_word_embeddings=True, qk_norm=True)


def linear_params(model: torch.nn.Module) -> int:
    """Weights of the layers' linear maps (the embedding, tied to the head, is counted once apart)."""
    return sum(m.weight.numel() for m in model.layers.modules() if isinstance(m, torch.nn.Linear))


def build_quantized(model_cls, cfg, isa: str, gen: torch.Generator):
    """The model with random weights on the q4 path, built a layer at a time (each layer quantized before the
    next is made: the fp32 model would need 3 GB at once). Returns (model, layer linear parameters)."""
    with torch.device("meta"):
        model = model_cls(cfg)
    n_linear = 0
    for layer in [*model.layers, model.embed_tokens, model.norm]:
        layer.to_empty(device="cpu")
        for name, p in layer.named_parameters():
            with torch.no_grad():
                if name.endswith("A_log"):
                    p.copy_(torch.empty_like(p).uniform_(1, 16, generator=gen).log())  # as transformers initializes
                elif name.endswith("dt_bias"):
                    p.fill_(1.0)
                elif "norm" in name:  # GDN's gated norm and the dense RMSNorms multiply by w; the (1 + w) ones add
                    p.fill_(0.0 if isinstance(model, HybridModel) and "gdn.norm" not in name else 1.0)
                else:
                    p.normal_(0, 0.02, generator=gen)
        if layer is not model.embed_tokens and layer is not model.norm:
            n_linear += sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
            quantize_linears(layer, isa, q4=True)
    model.init_rope()
    quantize_target(model, isa, q4=True)  # the tied head and embedding int8, the kernels switched on
    return model.eval(), n_linear


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def prefilled(model, prompt_len: int, room: int, gen: torch.Generator):
    state = model.new_state(prompt_len + room)
    model.prefill(state, torch.randint(0, VOCAB, (prompt_len,), generator=gen))
    return state


def ar_step_ms(model, prompt_len: int, steps: int, repeats: int, gen: torch.Generator) -> float:
    """One AR step (forward of one token, argmax, commit), averaged over `steps` steps a run."""
    state = prefilled(model, prompt_len, steps * (repeats + 1) + 8, gen)
    token = torch.tensor([1])

    def run():
        nonlocal token
        for _ in range(steps):
            token = model.forward(state, token).logits[-1].argmax().view(1)
            model.commit(state, torch.tensor([0]))

    return median_ms(run, repeats) / steps


class GDNTimer:
    """Wall time inside the GDN mixers (GatedDeltaNet.forward) and inside their two projections."""

    def __init__(self, model: HybridModel):
        self.mixer = self.proj = 0.0
        for gdn in model.gdn_layers():
            gdn.forward = self._timed(gdn.forward, "mixer")
            for lin in (gdn.in_proj, gdn.out_proj):
                lin.forward = self._timed(lin.forward, "proj")

    def _timed(self, fn, field: str):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            setattr(self, field, getattr(self, field) + (time.perf_counter() - t0) * 1e3)
            return out
        return wrapper

    def reset(self):
        self.mixer = self.proj = 0.0


def verify_costs(model, shape: str, prompt_len: int, repeats: int, gen: torch.Generator, timer: GDNTimer | None) -> list[dict]:
    """A round's verify as the engine runs it (every row through the layers, the head for the principal path),
    then a commit of the root (the next round starts from the same length)."""
    rows = []
    state = prefilled(model, prompt_len, 80, gen)
    for n in SIZES:
        tree = random_tree(n - 1, VOCAB, "chain" if shape == "chain" or n == 1 else "random", gen)
        batch = verify_input(tree, state.length)

        def run():
            model.verify(state, batch)
            model.commit(state, torch.tensor([], dtype=torch.long))  # keep the committed length: same work each run

        row = dict(n=n, shape=shape, head_rows=int(batch.logits_rows.numel()),
                   max_depth=int(tree.ancestor_mask.sum(1).max()) - 1)
        fused.USE_FUSED = step.USE_STEP = True
        row["verify_ms"] = median_ms(run, repeats)
        if timer is not None:
            timer.reset()
            t0 = time.perf_counter()
            run()
            total = (time.perf_counter() - t0) * 1e3
            row["gdn_mixer_share"] = timer.mixer / total  # the GDN layers' token mixers, projections included
            row["gdn_core_share"] = (timer.mixer - timer.proj) / total  # conv, gates, tree solve, norm: no matmuls
            fused.USE_FUSED = step.USE_STEP = False  # composed: no fused tree verify, no one-token step kernel
            row["verify_composed_gdn_ms"] = median_ms(run, repeats)
            fused.USE_FUSED = step.USE_STEP = True
        rows.append(row)
    return rows


def ar_rounds(hybrid, dense, prompt_len: int, steps: int, repeats: int, rounds: int, gen: torch.Generator):
    """AR ms a token of the hybrid with the GDN step kernel on, off, and of the dense model, one after the other in
    each of `rounds` rounds (each its own prefilled state): a load that comes and goes hits all three alike.
    Returns {name: [ms a token, one a round]}."""
    runs = {"hybrid_step_on": [], "hybrid_step_off": [], "dense": []}
    for _ in range(rounds):
        for name, model, use in (("hybrid_step_on", hybrid, True), ("hybrid_step_off", hybrid, False),
                                 ("dense", dense, True)):
            step.USE_STEP = use
            runs[name].append(ar_step_ms(model, prompt_len, steps, repeats, gen))
    step.USE_STEP = True
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24, help="hybrid layers (a multiple of 4; 24 is the real 0.8B)")
    ap.add_argument("--prompt", type=int, default=128, help="committed tokens before timing")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ar-steps", type=int, default=8)
    ap.add_argument("--ar-rounds", type=int, default=5,
                    help="rounds of AR timings: the hybrid with the GDN step kernel on, off, the dense model")
    ap.add_argument("--ar-only", action="store_true", help="AR tok/s only (no verify-cost tables)")
    ap.add_argument("--out", default="docs/gdn/hybrid_scale.json")
    args = ap.parse_args()
    choice = choose_compute("q4")
    gen = torch.Generator().manual_seed(0)
    info = dict(cpu=cpu_info().model, isa_flags=cpu_info().isa_summary, kernel_isa=choice.isa,
                gdn_fused_isa=fused.default_isa(), threads=torch.get_num_threads(), torch=torch.__version__,
                python=platform.python_version(), compute="q4 (Q4_1 layers, int8 tied head/embedding)",
                repeats=args.repeats, prompt_tokens=args.prompt, timing="median of repeats after a warm-up",
                load_average_at_start=os.getloadavg()[0])
    print(" ".join(f"{k}={v}" for k, v in info.items()), flush=True)

    hcfg = hybrid_config(args.layers)
    hybrid, h_params = build_quantized(HybridModel, hcfg, choice.isa, gen)
    per_dense_layer = HIDDEN * (2048 + 2 * 1024) + 2048 * HIDDEN + 3 * HIDDEN * MLP  # qkv (16 q, 8 KV heads of 128), o, MLP
    dense_layers = max(1, round(h_params / per_dense_layer))
    print(f"hybrid: {args.layers} layers, {h_params / 1e6:.1f}M layer weights + {VOCAB * HIDDEN / 1e6:.1f}M tied embedding",
          flush=True)
    info["gdn_step_isa"] = hybrid.gdn_layers()[0].kernel_isa if step.step_available() else None
    verify = []
    if not args.ar_only:
        timer = GDNTimer(hybrid)
        verify = [r for shape in ("chain", "tree") for r in verify_costs(hybrid, shape, args.prompt, args.repeats, gen, timer)]
        del timer

    dense, d_params = build_quantized(Transformer, dense_config(dense_layers), choice.isa, gen)
    print(f"dense: {dense_layers} layers, {d_params / 1e6:.1f}M layer weights", flush=True)
    dense_verify = [] if args.ar_only else verify_costs(dense, "tree", args.prompt, args.repeats, gen, None)
    runs = ar_rounds(hybrid, dense, args.prompt, args.ar_steps, args.repeats, args.ar_rounds, gen)
    del hybrid, dense
    hybrid_ar, hybrid_ar_off, dense_ar = (statistics.median(runs[k]) for k in ("hybrid_step_on", "hybrid_step_off", "dense"))
    # each round's own ratio (its three runs side by side), then their median: the figure least moved by the load
    round_ratio = statistics.median(d / h for d, h in zip(runs["dense"], runs["hybrid_step_on"]))
    round_ratio_off = statistics.median(d / h for d, h in zip(runs["dense"], runs["hybrid_step_off"]))

    info["load_average_at_end"] = os.getloadavg()[0]  # other processes on the machine: the timings' noise
    one = next((r["verify_ms"] for r in verify if r["shape"] == "tree" and r["n"] == 1), None)
    tree64 = next((r["verify_ms"] for r in verify if r["shape"] == "tree" and r["n"] == 64), None)
    result = dict(
        info=info,
        hybrid=dict(layers=args.layers, layer_types="3 GDN : 1 gated attention", layer_weights=h_params,
                    embedding_weights=VOCAB * HIDDEN, config=hcfg.__dict__ | dict(layer_types=None)),
        dense=dict(layers=dense_layers, layer_weights=d_params, config=dense_config(dense_layers).__dict__),
        ar=dict(hybrid_ms_per_token=hybrid_ar, dense_ms_per_token=dense_ar, hybrid_tok_s=1e3 / hybrid_ar,
                dense_tok_s=1e3 / dense_ar, hybrid_vs_dense=dense_ar / hybrid_ar,
                hybrid_step_off_ms_per_token=hybrid_ar_off, hybrid_step_off_tok_s=1e3 / hybrid_ar_off,
                hybrid_step_off_vs_dense=dense_ar / hybrid_ar_off, runs_ms=runs,
                hybrid_vs_dense_per_round_median=round_ratio, hybrid_step_off_vs_dense_per_round_median=round_ratio_off),
        verify=verify, dense_verify=dense_verify,
        targets=dict(ar_hybrid_vs_dense=dense_ar / hybrid_ar, ar_target=0.8,
                     tree64_vs_one_token=None if one is None else tree64 / one, tree64_target=2.5),
    )
    print(f"\nAR: hybrid {1e3 / hybrid_ar:.2f} tok/s with the GDN step kernel, {1e3 / hybrid_ar_off:.2f} without; "
          f"dense {1e3 / dense_ar:.2f} tok/s (hybrid / dense {dense_ar / hybrid_ar:.2f}x with, "
          f"{dense_ar / hybrid_ar_off:.2f}x without; target >= 0.8x)\n"
          f"    median of the rounds' own ratios: {round_ratio:.2f}x with, {round_ratio_off:.2f}x without; "
          f"runs (ms a token): " + "; ".join(f"{k} " + " ".join(f"{v:.1f}" for v in vs) for k, vs in runs.items()))
    if args.ar_only:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.out}")
        return
    print("\n| shape | n | head rows | max depth | verify (ms) | x 1 token | GDN mixers | GDN core | composed GDN (ms) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in verify:
        print(f"| {r['shape']} | {r['n']} | {r['head_rows']} | {r['max_depth']} | {r['verify_ms']:.1f} | "
              f"{r['verify_ms'] / one:.2f} | {r['gdn_mixer_share']:.0%} | {r['gdn_core_share']:.0%} | "
              f"{r['verify_composed_gdn_ms']:.1f} |")
    print("\ndense, tree: " + ", ".join(f"{r['n']}: {r['verify_ms']:.1f} ms" for r in dense_verify))
    print(f"64-node tree / one token: {tree64 / one:.2f}x (target <= 2.5x)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
