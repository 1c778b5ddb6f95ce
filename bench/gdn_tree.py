"""GDN tree verification on CPU: the fused C++ kernel vs the composed masked solve vs per-node recursion
(parent snapshots) vs per-branch recursion, one layer, fp32 (default shape: Qwen3.5-0.8B's GDN layer,
16 key / 16 value heads, d_k = d_v = 128), plus the verify time per round of a small random hybrid model.

    .venv/bin/python bench/gdn_tree.py [--out runs/gdn_tree.json] [--threads 1]

Prints markdown tables and writes JSON. All methods run in this one process, on the same inputs.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from drafttree.ops.gdn.fused import default_isa, tree_gated_delta_verify_fused
from drafttree.ops.gdn.naive import tree_oracle, tree_per_branch
from drafttree.ops.gdn.random_inputs import make_gdn_inputs, make_parents, path_of
from drafttree.ops.gdn.tree import ancestor_mask, commit_gdn_path, tree_gated_delta_verify


def timed(fn, reps: int) -> tuple[float, object]:
    """Best wall time in ms over reps (after one warm-up call when reps > 1): the machine is shared,
    and the minimum is the least disturbed estimate."""
    out = fn() if reps > 1 else None
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times), out


def bench_layer(sizes, key_heads: int, heads: int, d: int, seed: int, isa: str) -> list[dict]:
    rows = []
    for n in tqdm(sizes, desc="one GDN layer"):
        gen = torch.Generator().manual_seed(seed + n)
        parents = make_parents("local", n, gen)  # parent among the previous 8 nodes
        x = make_gdn_inputs(key_heads, heads, n, d, d, gen, dtype=torch.float32)
        M = ancestor_mask(parents)
        depth = int(M.sum(1).max()) - 1
        leaves = n - len(set(int(p) for p in parents if p >= 0))
        t_masked, (o_masked, stash) = timed(lambda: tree_gated_delta_verify(*x, M), reps=7)
        t_fused, (o_fused, _) = timed(lambda: tree_gated_delta_verify_fused(*x, M, isa=isa, check_mask=False), reps=7)
        t_node, (o_node, _) = timed(lambda: tree_oracle(*x, parents), reps=3 if n <= 128 else 1)
        t_branch, o_branch = timed(lambda: tree_per_branch(*x, parents), reps=2 if n <= 128 else 1)
        deepest = int(M.sum(1).argmax())
        t_commit, _ = timed(lambda: commit_gdn_path(x[5], stash, path_of(parents, deepest)), reps=7)
        scale = 1 + float(o_node.abs().max())
        rows.append(dict(
            n=n, max_depth=depth, leaves=leaves,
            masked_ms=t_masked, fused_ms=t_fused, fused_speedup_vs_masked=t_masked / t_fused,
            max_rel_diff_fused_vs_per_node=float((o_fused - o_node).abs().max()) / scale,
            per_node_ms=t_node, per_branch_ms=t_branch, commit_fold_ms=t_commit,
            speedup_vs_per_node=t_node / t_masked, speedup_vs_per_branch=t_branch / t_masked,
            max_rel_diff_vs_per_node=float((o_masked - o_node).abs().max()) / scale,
            max_rel_diff_vs_per_branch=float((o_masked - o_branch).abs().max()) / scale,
        ))
    return rows


def random_hybrid_model(seed: int):
    """A small random hybrid model (6 GDN + 2 attention layers), built directly from a config."""
    from drafttree.model.hybrid import HybridModel
    from drafttree.model.hybrid_config import HybridConfig

    lt = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8))
    cfg = HybridConfig(
        family="qwen3_5", vocab_size=8192, hidden_size=512, num_layers=8, layer_types=lt, rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=4096, num_heads=8, num_kv_heads=2, head_dim=64,
        rotary_dim=16, rope_theta=1e7, attention_bias=False, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, intermediate_size=1408,
    )
    torch.manual_seed(seed)
    model = HybridModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            elif name.endswith("dt_bias") or name.endswith("gdn.norm.weight"):
                p.fill_(1.0)
            elif "norm" in name:
                p.zero_()
            else:
                p.normal_(0, 0.02)
    model.init_rope()
    return model.eval()


def bench_model(sizes, prefix: int, rounds: int, seed: int) -> tuple[dict, list[dict]]:
    model = random_hybrid_model(seed)
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in tqdm(sizes, desc="hybrid model verify"):
        state = model.new_state(prefix + rounds * n + 1)
        model.prefill(state, torch.randint(0, cfg.vocab_size, (prefix,), generator=gen))
        verify, commit = [], []
        for _ in range(rounds):
            parents = make_parents("local", n, gen)
            M = ancestor_mask(parents)
            tokens = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
            t0 = time.perf_counter()
            model.forward(state, tokens, positions=state.length + M.sum(1) - 1, tree_mask=M)
            t1 = time.perf_counter()
            model.commit(state, torch.tensor(path_of(parents, int(M.sum(1).argmax()))))
            t2 = time.perf_counter()
            verify.append((t1 - t0) * 1e3)
            commit.append((t2 - t1) * 1e3)
        rows.append(dict(n=n, verify_ms=min(verify), commit_ms=min(commit)))
    info = dict(hidden=cfg.hidden_size, layers=cfg.num_layers, gdn_layers=len(model.gdn_layers()),
                attention_layers=len(cfg.attention_layers), gdn_heads=f"{cfg.linear_num_key_heads}k/{cfg.linear_num_value_heads}v",
                d_k=cfg.linear_key_head_dim, vocab=cfg.vocab_size, prefix=prefix, rounds=rounds,
                params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 1))
    return info, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/gdn_tree.json")
    ap.add_argument("--threads", type=int, default=1,
                    help="1 by default: on a shared machine, OpenMP barriers with 2 threads stall for 100s of ms")
    ap.add_argument("--sizes", default="16,64,128,256")
    ap.add_argument("--key-heads", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16, help="value heads")
    ap.add_argument("--isa", default=default_isa(), help="the fused kernel's path: avx512_vnni (AVX-512F), avx2 or scalar")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]

    layer = bench_layer(sizes, args.key_heads, args.heads, args.dim, args.seed, args.isa)
    model_info, model_rows = bench_model([16, 64], prefix=128, rounds=5, seed=args.seed)

    print(f"\nOne GDN layer, fp32, {args.key_heads} key / {args.heads} value heads, fused kernel ISA {args.isa}, d_k = d_v = {args.dim}, tree: parent among the previous 8 nodes; "
          f"{args.threads} threads, torch {torch.__version__}\n")
    print("| n | max depth | leaves | fused (ms) | masked solve (ms) | fused vs masked | per-node + snapshots (ms) | per-branch (ms) "
          "| speedup vs per-node | speedup vs per-branch | fold commit (ms) | max rel diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in layer:
        diff = max(r["max_rel_diff_vs_per_node"], r["max_rel_diff_vs_per_branch"], r["max_rel_diff_fused_vs_per_node"])
        print(f"| {r['n']} | {r['max_depth']} | {r['leaves']} | {r['fused_ms']:.2f} | {r['masked_ms']:.2f} "
              f"| {r['fused_speedup_vs_masked']:.1f}× | {r['per_node_ms']:.1f} "
              f"| {r['per_branch_ms']:.0f} | {r['speedup_vs_per_node']:.1f}× | {r['speedup_vs_per_branch']:.0f}× "
              f"| {r['commit_fold_ms']:.2f} | {diff:.1e} |")
    print(f"\nSmall random hybrid model ({model_info}), verify forward per round (best of {model_info['rounds']}):\n")
    print("| tree nodes | verify forward (ms) | commit (ms) |")
    print("|---|---|---|")
    for r in model_rows:
        print(f"| {r['n']} | {r['verify_ms']:.1f} | {r['commit_ms']:.2f} |")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        config=dict(key_heads=args.key_heads, heads=args.heads, isa=args.isa, d=args.dim, threads=args.threads, torch=torch.__version__,
                    machine=platform.machine(), tree="local8"),
        layer=layer, model=dict(info=model_info, rows=model_rows)), indent=2))
    print(f"\nwrote {out}")
    at128 = [r for r in layer if r["n"] == 128]
    if at128 and not math.isnan(at128[0]["speedup_vs_per_branch"]):
        print(f"masked solve vs per-branch at 128 nodes: {at128[0]['speedup_vs_per_branch']:.0f}×")


if __name__ == "__main__":
    main()
