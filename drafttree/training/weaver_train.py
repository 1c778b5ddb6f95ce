"""`drafttree train weaver`: train a Weaver on the drafter's self-distillation data, drafter and target frozen.

Teacher forcing along the target's own continuation: for a block at anchor a (drawn as the drafter's
trainer draws them, drafttree.training.train.build_batch), the path is root = token a, then the target's
tokens a+1, a+2, ...; the node at depth d sees that path and the drafter's hidden state h_{d+1}, and is
trained to give the target's token at depth d+1 among the drafter's top-K candidates there, or "other"
when it is not among them. Cross-entropy weighted exp(-(d-1)/gamma) by depth, like the drafter's loss.
Under teacher forcing a greedy chain's accepted length is the leading run of correct top-1 picks, so
the logged τ (Weaver vs the drafter alone) is exact for chains on these blocks.

  drafttree train weaver --data runs/data --drafter DIR --out runs/weaver --steps 3000 --threads 1
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from tqdm import tqdm

from ..atomic import atomic_path, atomic_write_text
from ..drafter.checkpoint import load_drafter
from .data import FeatureDataset
from .train import BlockForward, build_batch, load_optimizer, lr_at, save_optimizer
from ..validate import InputError
from ..weaver.checkpoint import check_weaver_fits, load_weaver, save_weaver
from ..weaver.model import Weaver, WeaverConfig, candidates_from_logits


@dataclass
class WeaverTrainConfig:
    steps: int = 3000
    seqs_per_step: int = 4
    blocks_per_seq: int = 8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    loss_decay_gamma: float = 7.0
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 100
    max_context: int | None = 1024  # context tokens before the anchor the drafter sees (None: all)
    stop_at: int | None = None  # end this run after that step (the schedule still spans `steps`): time-sliced jobs
    val_sequences: int = 16  # the data's last N sequences are held out for the validation metrics
    val_blocks_per_seq: int = 8
    # shape of a new Weaver
    hidden_size: int = 256
    num_layers: int = 1
    num_heads: int = 4
    intermediate_size: int = 512
    num_candidates: int = 32


def teacher_forced(weaver: Weaver, drafter_forward: BlockForward, batch: dict, embed: torch.Tensor,
                   head: torch.Tensor, block_size: int, token_ids: torch.Tensor | None = None):
    """Weaver's log-probs along the target's continuation: (logp [N, D, K+1], class [N, D] (K = other),
    drafter candidate ids [N, D, K]). The drafter part runs without gradients. With a reduced draft
    vocabulary, `head` holds its rows and token_ids [Vd] their target ids (candidates as at decoding)."""
    K = weaver.config.num_candidates
    with torch.no_grad():
        hidden = drafter_forward(batch["context_features"].float(), batch["context_positions"], batch["anchor_tokens"],
                                 batch["block_positions"], batch["attn_mask"])
        h = hidden.reshape(-1, block_size, hidden.shape[-1])[:, 1:]  # [N, D, H]: h_{d+1} for nodes at depth d
        logits = (h.to(head.dtype) @ head.t()).float()
        ids, lp, log_rest = candidates_from_logits(logits, K)
        ids = ids if token_ids is None else token_ids[ids]
        del logits
    labels = batch["labels"]  # [N, D]: the target's token at depth d+1, -1 where none
    path = torch.cat([batch["anchor_tokens"].reshape(-1, 1), labels[:, :-1]], dim=1).clamp(min=0)
    depths = torch.arange(labels.shape[1]).expand_as(labels)
    s = weaver.forward_paths(weaver.node_inputs(embed[path], h.float(), depths))
    logp = weaver.candidate_logprobs(s, lp, log_rest, embed[ids])
    hit = ids == labels[..., None]
    cls = torch.where(hit.any(-1), hit.int().argmax(-1), K)
    return logp, cls, ids


def step_metrics(logp, cls, ids, labels, K: int) -> dict:
    """Per-depth counts: valid labels, Weaver top-1 right, drafter top-1 right, label among the K; and the
    chain τ (1 + leading run of right top-1 picks) summed over blocks, for both."""
    valid = labels >= 0
    weaver_ok = (logp[..., :K].argmax(-1) == cls) & valid  # "other" is no token: a tree places a candidate
    drafter_ok = (ids[..., 0] == labels) & valid
    return {"valid": valid.sum(0), "weaver": weaver_ok.sum(0), "drafter": drafter_ok.sum(0),
            "in_k": ((cls < K) & valid).sum(0),
            "tau_weaver": float((1 + weaver_ok.int().cumprod(1).sum(1)).sum()),
            "tau_drafter": float((1 + drafter_ok.int().cumprod(1).sum(1)).sum()), "blocks": labels.shape[0]}


def summarise(acc: dict) -> dict:
    v = acc["valid"].clamp(min=1).float()
    return {"weaver_top1": (acc["weaver"] / v).tolist(), "drafter_top1": (acc["drafter"] / v).tolist(),
            "in_k": (acc["in_k"] / v).tolist(), "tau_weaver": acc["tau_weaver"] / max(1, acc["blocks"]),
            "tau_drafter": acc["tau_drafter"] / max(1, acc["blocks"])}


def _add(acc: dict | None, m: dict) -> dict:
    return dict(m) if acc is None else {k: acc[k] + m[k] for k in m}


def _sequence_for(g: int, n: int, seed: int) -> int:
    """Epoch-wise shuffled order over n training sequences, a pure function of the draw index (resuming needs
    no sampler state)."""
    epoch, i = divmod(g, n)
    return int(torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))[i])


def save_plots(metrics: list[dict], val: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not metrics:
        return
    steps = [m["step"] for m in metrics]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot(steps, [m["loss"] for m in metrics], label="train")
    if val:
        ax[0].plot([m["step"] for m in val], [m["loss"] for m in val], "o-", label="held out")
    ax[0].set_xlabel("step"), ax[0].set_ylabel("weighted CE over K + other"), ax[0].set_title("Weaver loss"), ax[0].legend()
    for series, label, style in ((metrics, "train", "-"), (val, "held out", "o-")):
        if series:
            st = [m["step"] for m in series]
            ax[1].plot(st, [m["tau_weaver"] for m in series], style, label=f"Weaver chain ({label})")
            ax[1].plot(st, [m["tau_drafter"] for m in series], style, alpha=0.5, label=f"drafter chain ({label})")
    ax[1].set_xlabel("step"), ax[1].set_ylabel("τ of a greedy chain (teacher forcing)"), ax[1].legend()
    fig.tight_layout()
    with atomic_path(out / "loss.png") as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)

    last = val[-1] if val else metrics[-1]
    depth = range(1, len(last["weaver_top1"]) + 1)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(depth, last["weaver_top1"], "o-", label="Weaver top-1")
    ax.plot(depth, last["drafter_top1"], "s--", label="drafter top-1")
    ax.plot(depth, last["in_k"], ":", label="target token among the K")
    ax.set_xlabel("depth"), ax.set_ylim(0, 1), ax.legend()
    ax.set_title(f"top-1 of the target token by depth, step {last['step']} ({'held out' if val else 'train'})")
    fig.tight_layout()
    with atomic_path(out / "accuracy.png") as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)


def _write_checkpoint(out: Path, weaver: Weaver, opt, state: dict) -> None:
    """Write to a temporary directory, then swap it in: a crash never leaves a half-written checkpoint."""
    tmp, final, old = out / "checkpoint.tmp", out / "checkpoint", out / "checkpoint.old"
    shutil.rmtree(tmp, ignore_errors=True)
    save_weaver(weaver, tmp)
    save_optimizer(opt, weaver, tmp / "optimizer.safetensors")
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1) + "\n")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    atomic_write_text(out / "metrics.json", json.dumps({"train": state["metrics"], "held_out": state["val_metrics"]},
                                                       indent=1) + "\n")
    save_plots(state["metrics"], state["val_metrics"], out)


def _resume(ckpt: Path):
    state_file = ckpt / "trainer_state.json"
    try:
        state = json.loads(state_file.read_bytes().decode("utf-8"))
        if not (isinstance(state, dict) and isinstance(state.get("step"), int) and isinstance(state.get("metrics"), list)):
            raise ValueError("it needs a step and a list of metrics")
        return load_weaver(ckpt), state
    except (ValueError, UnicodeDecodeError, InputError) as e:
        raise InputError(f"{ckpt}: unusable checkpoint ({e}); delete it or pass --no-resume to start over") from None


def train_weaver(data_dir, out_dir, drafter, embed: torch.Tensor, head: torch.Tensor,
                 tc: WeaverTrainConfig | None = None, resume: bool = True, progress: bool = True,
                 bf16: bool | None = None) -> dict:
    """Train (or resume) a Weaver for `drafter` (frozen) on feature shards; writes out_dir/{checkpoint/, weaver/,
    metrics.json, loss.png, accuracy.png}. Returns {"weaver", "final", "held_out"}."""
    tc = tc or WeaverTrainConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = FeatureDataset(data_dir)
    data.check_token_ids(embed.shape[0])
    dcfg = drafter.config
    if data.target_layer_ids != dcfg.target_layer_ids:
        raise InputError(f"{data_dir}: the data has target layers {data.target_layer_ids}, the drafter reads "
                         f"{dcfg.target_layer_ids}: generate the data for this drafter")
    n_val = min(tc.val_sequences, len(data) // 5)  # the data's last sequences, never trained on
    n_train = len(data) - n_val
    if n_train < 1:
        raise InputError(f"{data_dir}: no training sequences")
    ckpt = out / "checkpoint"
    if resume and not ckpt.exists() and (out / "checkpoint.old" / "trainer_state.json").exists():
        (out / "checkpoint.old").rename(ckpt)  # killed between the two renames: the old one is whole
    state = {"step": 0, "metrics": [], "val_metrics": []}
    if resume and (ckpt / "trainer_state.json").exists():
        weaver, state = _resume(ckpt)
        state.setdefault("val_metrics", [])
    else:
        torch.manual_seed(tc.seed)
        weaver = Weaver(WeaverConfig(vocab_size=embed.shape[0], embed_size=embed.shape[1],
                                     drafter_hidden_size=dcfg.hidden_size, max_depth=dcfg.block_size - 1,
                                     hidden_size=tc.hidden_size, num_layers=tc.num_layers, num_heads=tc.num_heads,
                                     intermediate_size=tc.intermediate_size, num_candidates=tc.num_candidates))
    check_weaver_fits(weaver.config, dcfg, _TargetShape(embed.shape[0], embed.shape[1]))
    weaver.float().train()
    drafter = drafter.float().eval().requires_grad_(False)
    use_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) if bf16 is None else bf16
    # the drafter's own head: its draft vocabulary's rows when it has one (candidates as at decoding)
    head = drafter.head_weight(head.detach()).to(torch.bfloat16 if use_bf16 else torch.float32)
    token_ids = drafter.draft_vocab if dcfg.draft_vocab_size else None
    embed = embed.detach().float()
    forward = BlockForward(drafter, embed)
    B, K = dcfg.block_size, weaver.config.num_candidates
    decay = [p for p in weaver.parameters() if p.ndim >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": [p for p in weaver.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                            lr=tc.lr, betas=(0.9, 0.95))
    if state["step"] > 0 and (ckpt / "optimizer.safetensors").exists():
        try:
            load_optimizer(opt, weaver, ckpt / "optimizer.safetensors")
        except (SafetensorError, ValueError) as e:
            raise InputError(f"{ckpt / 'optimizer.safetensors'}: unreadable optimizer state ({e}); delete {ckpt} "
                             "or pass --no-resume") from None

    val_gen = torch.Generator().manual_seed(12345)
    val_batches = [build_batch([data[i]], dcfg, tc.val_blocks_per_seq, val_gen, tc.loss_decay_gamma, tc.max_context)
                   for i in range(n_train, len(data))]
    val_batches = [b for b in val_batches if b is not None]

    def evaluate(step: int) -> dict | None:
        if not val_batches:
            return None
        weaver.eval()
        acc, loss, w = None, 0.0, 0.0
        with torch.no_grad():
            for b in val_batches:
                logp, cls, ids = teacher_forced(weaver, forward, b, embed, head, B, token_ids)
                ww = b["weights"]
                loss += float(-(logp.gather(-1, cls[..., None])[..., 0] * ww).sum())
                w += float(ww.sum())
                acc = _add(acc, step_metrics(logp, cls, ids, b["labels"], K))
        weaver.train()
        return {"step": step, "loss": loss / max(w, 1e-8), **summarise(acc)}

    if state["step"] == 0 and not state["val_metrics"]:
        first = evaluate(0)  # the untrained Weaver is the drafter: the baseline
        if first:
            state["val_metrics"].append(first)
    window, window_loss, window_n, window_t = None, 0.0, 0, 0.0
    bar = tqdm(range(state["step"], tc.steps), initial=state["step"], total=tc.steps, disable=not progress,
               desc="weaver", dynamic_ncols=True)
    for step in bar:
        if tc.stop_at is not None and step >= tc.stop_at:
            break
        t0 = time.perf_counter()
        seqs = [data[_sequence_for(step * tc.seqs_per_step + j, n_train, tc.seed)] for j in range(tc.seqs_per_step)]
        gen = torch.Generator().manual_seed(tc.seed * 7919 + step * 131)
        batch = build_batch(seqs, dcfg, tc.blocks_per_seq, gen, tc.loss_decay_gamma, tc.max_context)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        if batch is not None:
            logp, cls, ids = teacher_forced(weaver, forward, batch, embed, head, B, token_ids)
            weights = batch["weights"]
            loss = -(logp.gather(-1, cls[..., None])[..., 0] * weights).sum() / weights.sum().clamp(min=1e-8)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(weaver.parameters(), tc.grad_clip)
            opt.step()
            window = _add(window, step_metrics(logp.detach(), cls, ids, batch["labels"], K))
            window_loss, window_n = window_loss + float(loss.detach()), window_n + 1
        window_t += time.perf_counter() - t0
        done = step + 1
        if (done % tc.log_every == 0 or done in (tc.steps, tc.stop_at)) and window is not None:
            rec = {"step": done, "loss": window_loss / window_n, "lr": lr_at(step, tc),
                   "sec_per_step": window_t / window_n, **summarise(window)}
            state["metrics"].append(rec)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", tau_w=f"{rec['tau_weaver']:.2f}", tau_d=f"{rec['tau_drafter']:.2f}")
            window, window_loss, window_n, window_t = None, 0.0, 0, 0.0
        if done % tc.checkpoint_every == 0 or done in (tc.steps, tc.stop_at):
            val = evaluate(done)
            if val:
                state["val_metrics"].append(val)
                bar.write(f"step {done}: held-out loss {val['loss']:.3f}, chain τ Weaver {val['tau_weaver']:.3f} "
                          f"vs drafter {val['tau_drafter']:.3f}")
            state.update(step=done, train_config=asdict(tc))
            _write_checkpoint(out, weaver, opt, state)
    bar.close()
    save_weaver(weaver, out / "weaver")
    return {"weaver": weaver.eval(), "final": state["metrics"][-1] if state["metrics"] else None,
            "held_out": state["val_metrics"][-1] if state["val_metrics"] else None}


@dataclass
class _TargetShape:
    vocab_size: int
    hidden_size: int


def main(argv=None) -> int:
    from .train import load_target_head
    from ..validate import check_threads, check_writable

    p = argparse.ArgumentParser(prog="drafttree train weaver", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="feature shards (`drafttree train data`)")
    p.add_argument("--out", required=True, help="output directory (checkpoint/, weaver/, metrics.json, plots)")
    p.add_argument("--target", default="smollm2-135m-instruct", help="embedded model name or HF directory: its "
                   "embedding and LM head are read")
    p.add_argument("--drafter", default=None, help="the frozen drafter (default: the one shipped for the target)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--bf16", choices=("auto", "on", "off"), default="auto", help="bf16 LM-head matmul for the drafter's marginals")
    for f in WeaverTrainConfig.__dataclass_fields__.values():
        kind = float if f.type in ("float", float) else int
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    a = p.parse_args(argv)
    for name in ("steps", "seqs_per_step", "blocks_per_seq", "log_every", "checkpoint_every", "hidden_size",
                 "num_layers", "num_heads", "intermediate_size", "num_candidates"):
        if getattr(a, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if not (a.lr > 0 and math.isfinite(a.lr)):
        raise InputError(f"--lr must be a finite number > 0, got {a.lr}")
    if a.threads:
        check_threads(a.threads)
        torch.set_num_threads(a.threads)
    check_writable(a.out, "--out")
    drafter_dir = a.drafter
    if drafter_dir is None:
        from ..methods import SHIPPED_DRAFTERS

        if a.target not in SHIPPED_DRAFTERS:
            raise InputError(f"no drafter ships for {a.target!r}: pass --drafter DIR")
        drafter_dir = SHIPPED_DRAFTERS[a.target]
    FeatureDataset(a.data)  # a missing or broken shard fails before the target is read
    drafter = load_drafter(drafter_dir, dtype=torch.float32)
    embed, head, _, _ = load_target_head(a.target)
    tc = WeaverTrainConfig(**{k: getattr(a, k) for k in WeaverTrainConfig.__dataclass_fields__})
    bf16 = {"auto": None, "on": True, "off": False}[a.bf16]
    res = train_weaver(a.data, a.out, drafter, embed, head, tc, resume=not a.no_resume, bf16=bf16)
    if res["held_out"]:
        print(json.dumps({k: res["held_out"][k] for k in ("step", "loss", "tau_weaver", "tau_drafter")}))
    return 0
