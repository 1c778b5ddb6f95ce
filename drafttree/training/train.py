"""Train a DFlash drafter on precomputed target features (see drafttree/training/data.py).

One step: for each of a few sequences pick random anchors a in the response; block = [token a,
mask x (B-1)] at positions a..a+B-1 sees the context features of positions < a and its own block
(bidirectional); block index i is trained to predict token a+i with weight exp(-(i-1)/gamma).
All blocks of a step run in one packed forward with a block-diagonal + context-prefix mask.
The target's embedding and LM head are frozen tensors passed in. Runs alone or under torchrun
(DDP, gloo). Checkpoints are safetensors + JSON only.

  python -m drafttree.training.train --data DIR --target TARGET_DIR --out DIR --steps 2000
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from drafttree.atomic import atomic_path, atomic_write_text
from drafttree.drafter.checkpoint import load_drafter, save_drafter
from drafttree.drafter.reduce_vocab import RANK_FILE, load_rank, top_ranked_ids
from drafttree.training.data import FeatureDataset
from drafttree.training.loss import linear_ce_kl, linear_cross_entropy
from drafttree.drafter.model import DFlashConfig, DFlashDrafter, block_attention_mask
from drafttree.validate import InputError


@dataclass
class TrainConfig:
    steps: int = 1000
    seqs_per_step: int = 4  # per rank
    blocks_per_seq: int = 8  # anchors per sequence (fewer if the response is short)
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    loss_decay_gamma: float = 7.0  # position weight exp(-(i-1)/gamma); DFlash decays the loss with depth
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 200
    ce_chunk_rows: int = 128
    # bf16 for the frozen LM-head matmuls (the dominant cost) and autocast for the drafter body, fp32
    # master weights and softmax statistics. "auto": on where the CPU has native bf16 (avx512_bf16/AMX).
    bf16: str = "auto"
    max_context: int | None = None  # clip context to the last N tokens before the anchor (None: all)
    stop_at: int | None = None  # end this run after that step (schedule still spans `steps`): time-sliced jobs
    soft_target_weight: float = 0.0  # lambda of the top-k sparse KL to the target (anchor-label shards with top-k)
    # score the loss over the init drafter's `loss_vocab` highest-ranked draft ids (0: its whole draft vocabulary):
    # the ids decoding narrows the head to (methods.DEFAULT_DRAFT_VOCAB), at a fraction of the head's matmuls
    loss_vocab: int = 0


# ---- batches ------------------------------------------------------------------------------
def build_batch(seqs: list[dict], cfg: DFlashConfig, blocks_per_seq: int, gen: torch.Generator,
                gamma: float, max_context: int | None = None) -> dict | None:
    """Sample anchors and lay out one forward's inputs, one row of a leading axis per sequence.

    Sequences are padded to the longest context (masked out) and to the same number of blocks
    (repeats of the first anchor with zero loss weight). Labels [S*nb, B-1] are the tokens at
    a+1..a+B-1 (-1 where past the end or outside the response); weights decay with depth.
    """
    B = cfg.block_size
    depth = torch.arange(1, B)
    pos_weight = torch.exp(-(depth - 1).float() / gamma)
    picked = []
    for s in seqs:
        ids, mask = s["input_ids"], s["loss_mask"]
        # anchor a is useful when the token it first predicts (a+1) is a response token; a >= 1 keeps
        # at least one context token
        cand = torch.nonzero(mask[2:], as_tuple=False).flatten() + 1
        if "anchors" in s:  # anchor-label shards: their own anchors, each with the target's greedy block
            cand = s["anchors"][s["anchors"] >= 1]
        if cand.numel():
            picked.append((s, cand[torch.randperm(cand.numel(), generator=gen)[:blocks_per_seq]].sort().values))
    if not picked:
        return None
    nb = max(a.numel() for _, a in picked)
    spans = [(0 if max_context is None else max(0, int(a.min()) - max_context), int(a.max())) for _, a in picked]
    C = max(hi - lo for lo, hi in spans)
    S, F = len(picked), picked[0][0]["features"].shape[1]
    feats = torch.zeros(S, C, F, dtype=picked[0][0]["features"].dtype)
    ctx_pos = torch.zeros(S, C, dtype=torch.long)
    anchors = torch.zeros(S, nb, dtype=torch.long)
    masks, labels, weights, tokens = [], [], [], []
    top_k = max((s["topk_ids"].shape[-1] for s, _ in picked if "topk_ids" in s), default=0)
    top_ids, top_lps = [], []
    for i, ((s, a), (lo, hi)) in enumerate(zip(picked, spans)):
        ids, lmask = s["input_ids"], s["loss_mask"]
        T, n = ids.shape[0], a.numel()
        feats[i, :hi - lo] = s["features"][lo:hi]
        ctx_pos[i, :hi - lo] = torch.arange(lo, hi)
        real = torch.arange(nb) < n
        a = torch.cat([a, a[:1].expand(nb - n)])  # padding blocks: copies with no loss
        anchors[i] = a
        ctx_seq = torch.where(torch.arange(C) < hi - lo, 0, -1)  # -1: padding, never visible
        m = block_attention_mask(ctx_seq, ctx_pos[i], torch.zeros(nb, dtype=torch.long), a, B)
        if max_context is not None:  # also hide context older than the window
            m[:, :C] &= (ctx_pos[i][None, :] >= (a[:, None] - max_context)).repeat_interleave(B, dim=0)
        masks.append(m)
        tgt = a[:, None] + depth[None, :]
        ok = (tgt < T) & real[:, None]
        tgt = tgt.clamp(max=T - 1)
        ok &= lmask[tgt]
        lab = torch.where(ok, ids[tgt], -1)
        if "anchors" in s:  # the stored block after each anchor (not the text's next tokens)
            lab = _stored_blocks(s, "labels", a, B - 1, -1)
            ok = (lab >= 0) & real[:, None]
            lab = torch.where(ok, lab, -1)
        labels.append(lab)
        weights.append(ok.float() * pos_weight)
        if top_k:  # the target's top-k at each label position; -inf: no soft target there
            ids_k, lp = _soft_targets(s, a, tgt, B - 1, top_k)
            top_ids.append(ids_k)
            top_lps.append(lp.masked_fill(~ok[..., None], float("-inf")))
        tokens.append(ids[a])
    batch = {"context_features": feats, "context_positions": ctx_pos, "anchor_tokens": torch.stack(tokens),
             "block_positions": (anchors[..., None] + torch.arange(B)).reshape(S, nb * B),
             "attn_mask": torch.stack(masks), "labels": torch.cat(labels), "weights": torch.cat(weights)}
    if top_k:
        batch["topk_ids"], batch["topk_logprobs"] = torch.cat(top_ids), torch.cat(top_lps)
    return batch


def _soft_targets(s: dict, anchors: torch.Tensor, rows: torch.Tensor, depth: int, width: int):
    """(ids, logprobs) [nb, depth, width] of the target's top-k at each label position: an anchor-label shard
    stores them per anchor, a self-distillation shard per row (`rows` [nb, depth] index it), others have none."""
    if "topk_ids" not in s:
        return torch.zeros(anchors.numel(), depth, width, dtype=torch.long), \
            torch.full((anchors.numel(), depth, width), float("-inf"))
    if "anchors" in s:
        return (_stored_blocks(s, "topk_ids", anchors, depth, 0, width),
                _stored_blocks(s, "topk_logprobs", anchors, depth, float("-inf"), width))
    pad = [0, width - s["topk_ids"].shape[-1]]
    return (torch.nn.functional.pad(s["topk_ids"][rows][..., :width], pad, value=0),
            torch.nn.functional.pad(s["topk_logprobs"][rows][..., :width], pad, value=float("-inf")))


def _stored_blocks(s: dict, key: str, anchors: torch.Tensor, depth: int, fill, width: int | None = None):
    """s[key] rows of the given anchors (positions in s["anchors"]), cut or padded (with `fill`) to `depth`
    label positions and, for top-k tensors, to `width` entries."""
    x = s[key][torch.searchsorted(s["anchors"], anchors)]
    x = x[:, :depth]
    pad = [0, 0] * (x.dim() - 2) + [0, depth - x.shape[1]]
    if width is not None:
        x = x[..., :width]
        pad[0:2] = [0, width - x.shape[-1]]
    return torch.nn.functional.pad(x, pad, value=fill) if any(pad) else x


class BlockForward(nn.Module):
    """drafter + frozen target embedding as one module, so DDP sees every trainable use in forward."""

    def __init__(self, drafter: DFlashDrafter, embed_weight: torch.Tensor):
        super().__init__()
        self.drafter = drafter
        self.embed_weight = embed_weight  # plain attribute: not a parameter, not a buffer (never synced)

    def forward(self, context_features, context_positions, anchor_tokens, block_positions, attn_mask):
        """anchor_tokens [..., nb]: builds the blocks [token, mask x (B-1)] and runs the drafter."""
        d = self.drafter
        B, H = d.config.block_size, d.config.hidden_size
        dtype = d.fc.weight.dtype
        tok = self.embed_weight[anchor_tokens].to(dtype)  # [..., nb, H]
        maskv = d.mask_vector(self.embed_weight).to(dtype)
        blocks = torch.cat([tok.unsqueeze(-2), maskv.expand(*tok.shape[:-1], B - 1, H)], dim=-2).flatten(-3, -2)
        return d(context_features, context_positions, blocks, block_positions, attn_mask)


class LossHead(NamedTuple):
    """The rows of the target's frozen LM head the loss scores (in the dtype its matmuls run in) and the token id of
    each row (None: every id, in order). Targets outside these ids cannot be drafted and carry no loss."""
    weight: torch.Tensor
    ids: torch.Tensor | None
    columns: torch.Tensor | None  # [vocab]: each token id's row of `weight`, -1 where it has none


def loss_vocab_ranking(init_from: str | Path | None, size: int) -> Path:
    """The ranking file `--loss-vocab` reads: the one beside the drafter training starts from."""
    if init_from is None or not (Path(init_from) / RANK_FILE).exists():
        raise InputError(f"--loss-vocab {size} needs {RANK_FILE} beside the --init-from drafter (the ranking decoding "
                         "narrows by; `python -m drafttree.training.text_vocab --rank-out` writes it), or leave "
                         "--loss-vocab at 0")
    return Path(init_from) / RANK_FILE


def loss_head(lm_head: torch.Tensor, drafter: DFlashDrafter, dtype: torch.dtype, ranked_ids: torch.Tensor | None = None,
              size: int = 0) -> LossHead:
    """The drafter's draft vocabulary, or with `size` the `size` highest-ranked of its ids (`ranked_ids`: the
    drafter's draft_vocab_rank): the vocabulary decoding narrows the head to, so training scores what decoding
    drafts, and the head's matmuls (the largest cost of a step) shrink with it."""
    if size:
        if ranked_ids is None:
            raise ValueError("a loss vocabulary of `size` ids needs the drafter's ranking (`ranked_ids`)")
        ids = top_ranked_ids(drafter, ranked_ids, size)
    else:
        ids = drafter.draft_vocab if drafter.config.draft_vocab_size else None
    if ids is None:
        return LossHead(lm_head.detach().to(dtype).contiguous(), None, None)
    columns = torch.full((drafter.config.vocab_size,), -1, dtype=torch.long)
    columns[ids] = torch.arange(ids.numel())
    return LossHead(lm_head.detach()[ids].to(dtype).contiguous(), ids, columns)


def block_loss(hidden: torch.Tensor, batch: dict, head: LossHead, chunk_rows: int, soft_weight: float = 0.0):
    """Weighted CE of block rows 1..B-1 (same-position targets) over the head's ids, plus soft_weight x the
    weighted top-k sparse KL to the target's distribution where the batch has one. Returns (loss, correct
    [nb,B-1] bool)."""
    B, H = batch["labels"].shape[-1] + 1, hidden.shape[-1]
    rows = hidden.reshape(-1, B, H)[:, 1:].reshape(-1, H)
    labels, weights = batch["labels"].reshape(-1), batch["weights"].reshape(-1)
    soft = soft_weight > 0 and "topk_ids" in batch
    if soft:
        top_ids = batch["topk_ids"].reshape(rows.shape[0], -1)
        top_lp = batch["topk_logprobs"].reshape(rows.shape[0], -1)
        soft_w = weights * torch.isfinite(top_lp).any(-1)
    targets = labels
    if head.ids is not None:  # targets outside the head's ids cannot be drafted: no loss
        targets = torch.where(labels >= 0, head.columns[labels.clamp(min=0)], -1)
        weights = weights * (targets >= 0)
        if soft:  # soft targets outside it drop out of the renormalised top-k
            top_ids = head.columns[top_ids]
            top_lp = top_lp.masked_fill(top_ids < 0, float("-inf"))
            top_ids = top_ids.clamp(min=0)
    if soft:
        losses, kl, preds = linear_ce_kl(rows, head.weight, targets, top_ids, top_lp, chunk_rows)
    else:
        losses, preds = linear_cross_entropy(rows, head.weight, targets, chunk_rows)
    if head.ids is not None:
        preds = head.ids[preds]
    loss = (losses * weights).sum() / weights.sum().clamp(min=1e-8)
    if soft:
        loss = loss + soft_weight * (kl * soft_w).sum() / soft_w.sum().clamp(min=1e-8)
    correct = (preds == labels).view(batch["labels"].shape)
    return loss, correct


def block_tally(correct: torch.Tensor, labels: torch.Tensor) -> dict:
    """Per-depth correct and valid counts, the sum of block τ (1 + leading correct drafts: the greedy chain's
    acceptance estimate) and the block count of one batch; sums of these give the logged accuracy and τ."""
    valid = labels >= 0
    run = (correct & valid).int().cumprod(1).sum(1)
    return {"correct": (correct & valid).sum(0), "valid": valid.sum(0), "tau": float((1 + run).float().sum()),
            "blocks": run.numel()}


def heldout_batches(data: FeatureDataset, cfg: DFlashConfig, tc: TrainConfig, sequences: int = 64,
                    per_forward: int = 8) -> list[dict]:
    """Batches over the first `sequences` held-out sequences with fixed anchors, built once per run."""
    ids = list(range(min(sequences, len(data))))
    batches = (build_batch([data[i] for i in ids[k:k + per_forward]], cfg, tc.blocks_per_seq,
                           torch.Generator().manual_seed(tc.seed * 7919 + k), tc.loss_decay_gamma, tc.max_context)
               for k in range(0, len(ids), per_forward))
    return [b for b in batches if b is not None]


@torch.no_grad()
def heldout_metrics(model: nn.Module, batches: list[dict], drafter: DFlashDrafter, head: LossHead, tc: TrainConfig,
                    use_bf16: bool) -> dict:
    """Block τ and top-1 accuracy by depth on the held-out batches, the same anchors every time: the curve that
    tells learning from memorising."""
    was_training = drafter.training
    drafter.eval()
    total = {"correct": 0, "valid": 0, "tau": 0.0, "blocks": 0}
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            hidden = model(batch["context_features"].float(), batch["context_positions"], batch["anchor_tokens"],
                           batch["block_positions"], batch["attn_mask"])
        _, correct = block_loss(hidden, batch, head, tc.ce_chunk_rows)
        total = {k: total[k] + v for k, v in block_tally(correct, batch["labels"]).items()}
    drafter.train(was_training)
    valid = torch.as_tensor(total["valid"]).clamp(min=1)
    return {"heldout_tau": total["tau"] / max(1, total["blocks"]),
            "heldout_accuracy": (torch.as_tensor(total["correct"]) / valid).tolist()}


# ---- optimizer / schedule -----------------------------------------------------------------
def lr_at(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * cos)


def make_optimizer(drafter: DFlashDrafter, tc: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in drafter.parameters() if p.ndim >= 2]
    no_decay = [p for p in drafter.parameters() if p.ndim < 2]  # norms and the mask vector
    return torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=tc.lr, betas=tc.betas)


def save_optimizer(opt: torch.optim.Optimizer, drafter: DFlashDrafter, path: Path) -> None:
    """AdamW state as safetensors (`<state>.<param name>`); hyperparameters live in the JSON trainer state."""
    names = {p: n for n, p in drafter.named_parameters()}
    tensors = {}
    for p, st in opt.state.items():
        for k, v in st.items():
            tensors[f"{k}.{names[p]}"] = torch.as_tensor(v).detach().clone().contiguous()
    save_file(tensors, str(path))


def load_optimizer(opt: torch.optim.Optimizer, drafter: DFlashDrafter, path: Path) -> None:
    tensors = load_file(str(path))
    params = dict(drafter.named_parameters())
    for key, v in tensors.items():
        k, name = key.split(".", 1)
        if name not in params:
            raise ValueError(f"{path}: optimizer state for unknown parameter {name!r}")
        opt.state[params[name]][k] = v


# ---- target tensors -----------------------------------------------------------------------
def load_target_head(target_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict]:
    """Embedding, LM head and final-norm weights (+ config dict) from a Hugging Face target directory (or an
    embedded model name such as smollm2-135m-instruct), read straight from its safetensors (tied
    heads reuse the embedding)."""
    from drafttree.gguf_convert import EMBEDDED, convert_embedded

    target_dir = convert_embedded(str(target_dir)) if str(target_dir) in EMBEDDED else Path(target_dir)
    cfg = json.loads((target_dir / "config.json").read_text())
    index = target_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    embed = head = norm = None
    for f in files:
        with safe_open(str(target_dir / f), framework="pt") as sf:
            for name in sf.keys():
                if name.endswith("embed_tokens.weight"):
                    embed = sf.get_tensor(name)
                elif name == "lm_head.weight" or name.endswith(".lm_head.weight"):
                    head = sf.get_tensor(name)
                elif name in ("model.norm.weight", "norm.weight", "model.language_model.norm.weight"):
                    norm = sf.get_tensor(name)
    if embed is None:
        raise ValueError(f"{target_dir}: no *embed_tokens.weight tensor")
    return embed, head if head is not None else embed, norm, cfg


def drafter_config_from_target(target_cfg: dict, target_layer_ids: list[int], num_layers: int,
                               block_size: int, draft_vocab_size: int | None = None) -> DFlashConfig:
    """A drafter shaped like the target's layers (DFlash's recipe), with a learned mask vector."""
    rope = dict(target_cfg.get("rope_parameters") or {})
    n_heads = target_cfg["num_attention_heads"]
    return DFlashConfig(
        hidden_size=target_cfg["hidden_size"], intermediate_size=target_cfg["intermediate_size"],
        num_hidden_layers=num_layers, num_attention_heads=n_heads,
        num_key_value_heads=target_cfg.get("num_key_value_heads") or n_heads,
        head_dim=target_cfg.get("head_dim") or target_cfg["hidden_size"] // n_heads,
        vocab_size=target_cfg["vocab_size"], target_layer_ids=list(target_layer_ids),
        num_target_layers=target_cfg["num_hidden_layers"], block_size=block_size, mask_token_id=None,
        rms_norm_eps=target_cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", target_cfg.get("rope_theta", 10000.0))),
        max_position_embeddings=target_cfg.get("max_position_embeddings", 8192),
        draft_vocab_size=draft_vocab_size)


# ---- metrics ------------------------------------------------------------------------------
def save_plots(metrics: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    held = [m for m in metrics if "heldout_tau" in m]
    metrics = [m for m in metrics if "loss" in m]  # held-out records may stand alone
    if not metrics:
        return
    steps = [m["step"] for m in metrics]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot(steps, [m["loss"] for m in metrics], label="loss")
    ax[0].set_xlabel("step"), ax[0].set_ylabel("weighted CE"), ax[0].set_title("training loss")
    tw = ax[0].twinx()
    tw.plot(steps, [m["tau"] for m in metrics], color="tab:orange", label="τ, training batches")
    if held:
        tw.plot([m["step"] for m in held], [m["heldout_tau"] for m in held], color="tab:green", marker="o",
                label="τ, held-out")
    tw.set_ylabel("estimated acceptance length (greedy chain)")
    tw.legend(loc="center right")
    ax[1].plot(steps, [m["lr"] for m in metrics])
    ax[1].set_xlabel("step"), ax[1].set_title("learning rate")
    fig.tight_layout()
    with atomic_path(out / "loss.png") as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    acc = torch.tensor([m["accuracy"] for m in metrics])  # [logs, B-1]
    for i in sorted({0, 1, 3, 7, acc.shape[1] - 1} & set(range(acc.shape[1]))):
        ax[0].plot(steps, acc[:, i], label=f"position {i + 1}")
    ax[0].set_xlabel("step"), ax[0].set_ylabel("top-1 accuracy"), ax[0].legend(), ax[0].set_title("accuracy by depth")
    ax[1].plot(range(1, acc.shape[1] + 1), acc[-1], marker="o")
    ax[1].set_xlabel("block position"), ax[1].set_ylim(0, 1), ax[1].set_title(f"accuracy at step {steps[-1]}")
    fig.tight_layout()
    with atomic_path(out / "accuracy.png") as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)


# ---- the loop -----------------------------------------------------------------------------
def _sequences_for_step(step: int, n: int, per_rank: int, rank: int, world: int, seed: int) -> list[int]:
    """Epoch-wise shuffled order, a pure function of the step: resuming needs no sampler state."""
    per_step = per_rank * world
    first = step * per_step + rank * per_rank
    out = []
    for g in range(first, first + per_rank):
        epoch, i = divmod(g, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perm[i]))
    return out


def train_drafter(data_dir: str | Path, out_dir: str | Path, embed_weight: torch.Tensor,
                  lm_head_weight: torch.Tensor, drafter_config: DFlashConfig | None = None,
                  train_config: TrainConfig | None = None, init_from: str | Path | None = None,
                  resume: bool = True, progress: bool = True, heldout_dir: str | Path | None = None) -> dict:
    """Train (or resume) a drafter; writes out_dir/{checkpoint/, drafter/, metrics.json, *.png}.

    drafter_config: shape of a new drafter (ignored with init_from or when resuming).
    init_from: an existing drafter directory to fine-tune.
    heldout_dir: feature shards never trained on; their block τ is logged at every checkpoint (`heldout_tau`).
    Returns a summary dict (the trained `drafter`, `final` metrics, `sequences_seen` by this rank).
    """
    tc = train_config or TrainConfig()
    if not (math.isfinite(tc.soft_target_weight) and tc.soft_target_weight >= 0):
        raise ValueError(f"soft_target_weight must be a finite number >= 0, got {tc.soft_target_weight}")
    out = Path(out_dir)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    main = rank == 0

    data = FeatureDataset(data_dir)
    data.check_token_ids(embed_weight.shape[0])  # before anything indexes the embedding with them
    heldout = FeatureDataset(heldout_dir) if heldout_dir is not None and main else None
    if heldout is not None:
        heldout.check_token_ids(embed_weight.shape[0])
    ckpt = out / "checkpoint"
    drafter, state = _starting_point(out, data, embed_weight, drafter_config, tc, init_from, resume, main)
    cfg = drafter.config
    if data.target_layer_ids != cfg.target_layer_ids or data.feature_dim != cfg.context_dim:
        raise ValueError(f"data has target_layer_ids {data.target_layer_ids} (width {data.feature_dim}); the drafter "
                         f"expects {cfg.target_layer_ids} (width {cfg.context_dim})")
    if embed_weight.shape[0] != cfg.vocab_size:
        raise InputError(f"the target's embedding has {embed_weight.shape[0]} rows but the drafter's vocabulary is "
                         f"{cfg.vocab_size}: train against the target the drafter was made for")
    drafter.train()
    use_bf16 = _use_bf16(tc.bf16)
    # frozen, sliced to the loss's vocabulary once, in the dtype its matmuls run in
    ranked = load_rank(loss_vocab_ranking(init_from, tc.loss_vocab)) if tc.loss_vocab else None
    head = loss_head(lm_head_weight, drafter, torch.bfloat16 if use_bf16 else torch.float32, ranked, tc.loss_vocab)
    embed = embed_weight.detach()
    model = BlockForward(drafter, embed)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    opt = make_optimizer(drafter, tc)
    if resume and (ckpt / "optimizer.safetensors").exists() and state["step"] > 0:
        try:
            load_optimizer(opt, drafter, ckpt / "optimizer.safetensors")
        except (SafetensorError, ValueError) as e:
            raise InputError(f"{ckpt / 'optimizer.safetensors'}: unreadable optimizer state, perhaps truncated ({e}); "
                             f"{_START_OVER.format(ckpt=ckpt)}") from None

    metrics: list[dict] = state["metrics"]
    window = {"loss": 0.0, "n": 0, "correct": 0, "valid": 0, "tau": 0.0, "blocks": 0, "t": 0.0}
    seen: list[int] = []
    window_steps = 0
    if heldout is not None:  # built once: the same anchors at every checkpoint
        heldout = heldout_batches(heldout, cfg, tc)
    if heldout is not None and state["step"] == 0:  # the starting point of the held-out curve (the init's τ)
        metrics.append({"step": 0, **heldout_metrics(BlockForward(drafter, embed), heldout, drafter, head, tc, use_bf16)})
    bar = tqdm(range(state["step"], tc.steps), initial=state["step"], total=tc.steps,
               disable=not (main and progress), desc="drafter", dynamic_ncols=True)
    for step in bar:
        if tc.stop_at is not None and step >= tc.stop_at:
            break
        t0 = time.perf_counter()
        idx = _sequences_for_step(step, len(data), tc.seqs_per_step, rank, world, tc.seed)
        seen += idx
        gen = torch.Generator().manual_seed(tc.seed * 7919 + step * 131 + rank)
        batch = build_batch([data[i] for i in idx], cfg, tc.blocks_per_seq, gen, tc.loss_decay_gamma, tc.max_context)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        opt.zero_grad(set_to_none=True)
        if batch is None:  # no usable anchor: a zero-loss dummy block keeps DDP ranks in step
            loss, correct = model(*_dummy_inputs(cfg)).sum() * 0.0, None
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
                hidden = model(batch["context_features"].float(), batch["context_positions"], batch["anchor_tokens"],
                               batch["block_positions"], batch["attn_mask"])
            loss, correct = block_loss(hidden, batch, head, tc.ce_chunk_rows, tc.soft_target_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), tc.grad_clip)
        opt.step()
        window["t"] += time.perf_counter() - t0
        window_steps += 1
        if correct is not None:
            window["loss"] += float(loss.detach())
            window["n"] += 1
            for k, v in block_tally(correct, batch["labels"]).items():
                window[k] += v
        done = step + 1
        if done % tc.log_every == 0 or done in (tc.steps, tc.stop_at):
            if world > 1:  # log the mean over all ranks, not rank 0's share
                window = _all_reduce_window(window, cfg.block_size - 1)
            if window["n"]:
                acc = (window["correct"] / window["valid"].clamp(min=1)).tolist()
                rec = {"step": done, "loss": window["loss"] / window["n"], "accuracy": acc,
                       "tau": window["tau"] / window["blocks"], "lr": lr_at(step, tc),
                       "sec_per_step": window["t"] / max(1, window_steps)}
                metrics.append(rec)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", tau=f"{rec['tau']:.2f}", acc1=f"{acc[0]:.2f}")
            window = {"loss": 0.0, "n": 0, "correct": 0, "valid": 0, "tau": 0.0, "blocks": 0, "t": 0.0}
            window_steps = 0
        if main and heldout is not None and (done % tc.checkpoint_every == 0 or done in (tc.steps, tc.stop_at)):
            rec = heldout_metrics(BlockForward(drafter, embed), heldout, drafter, head, tc, use_bf16)
            if metrics and metrics[-1]["step"] == done:
                metrics[-1].update(rec)
            else:
                metrics.append({"step": done, **rec})
            bar.write(f"step {done}: held-out tau {rec['heldout_tau']:.3f}")
        if main and (done % tc.checkpoint_every == 0 or done in (tc.steps, tc.stop_at)):
            _write_checkpoint(out, drafter, opt, {"step": done, "metrics": metrics, "train_config": asdict(tc),
                                                  "world_size": world})
    bar.close()
    if main:
        save_drafter(drafter, out / "drafter")
    if dist.is_initialized():
        dist.barrier()
    return {"drafter": drafter, "steps": tc.steps, "rank": rank, "world_size": world, "sequences_seen": seen,
            "final": next((m for m in reversed(metrics) if "loss" in m), None)}


_START_OVER = "delete {ckpt} or pass --no-resume to start training over"


def _starting_point(out: Path, data: FeatureDataset, embed_weight: torch.Tensor, drafter_config: DFlashConfig | None,
                    tc: TrainConfig, init_from, resume: bool, main: bool) -> tuple[DFlashDrafter, dict]:
    """(drafter, trainer state) to start from: the checkpoint to resume, else the --init-from drafter, else a new
    one (its mask vector at the mean token embedding, its draft vocabulary the data's most frequent tokens)."""
    ckpt = out / "checkpoint"
    if resume and main and not ckpt.exists() and (out / "checkpoint.old" / "trainer_state.json").exists():
        (out / "checkpoint.old").rename(ckpt)  # killed between _write_checkpoint's two renames: the old one is whole
    if resume and (ckpt / "trainer_state.json").exists():
        return _load_resume_state(ckpt)
    state = {"step": 0, "metrics": []}
    if init_from is not None:
        return load_drafter(init_from, dtype=torch.float32), state
    if drafter_config is None:
        raise ValueError("train_drafter needs drafter_config, init_from or a checkpoint to resume")
    torch.manual_seed(tc.seed)
    drafter = DFlashDrafter(drafter_config).float()
    with torch.no_grad():
        if drafter_config.mask_token_id is None:
            drafter.mask_embedding.copy_(embed_weight.float().mean(0))
        if drafter_config.draft_vocab_size:
            counts = data.token_counts(drafter_config.vocab_size)
            drafter.set_draft_vocab(counts.argsort(descending=True, stable=True)[:drafter_config.draft_vocab_size])
    return drafter, state


def _load_resume_state(ckpt: Path):
    """(drafter, trainer state) of the checkpoint to resume, or an InputError naming the broken file."""
    state_file = ckpt / "trainer_state.json"
    try:
        state = json.loads(state_file.read_bytes().decode("utf-8"))
        if not (isinstance(state, dict) and isinstance(state.get("step"), int) and state["step"] >= 0
                and isinstance(state.get("metrics"), list)):
            raise ValueError("it needs a step >= 0 and a list of metrics")
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError too
        raise InputError(f"{state_file}: unusable trainer state, perhaps truncated ({e}); "
                         f"{_START_OVER.format(ckpt=ckpt)}") from None
    try:
        drafter = load_drafter(ckpt, dtype=torch.float32)
    except (SafetensorError, ValueError, KeyError) as e:
        raise InputError(f"{ckpt}: the drafter of the checkpoint cannot be loaded ({e}); "
                         f"{_START_OVER.format(ckpt=ckpt)}") from None
    return drafter, state


def _use_bf16(setting: str) -> bool:
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"bf16 must be auto, on or off, got {setting!r}")
    if setting == "auto":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return setting == "on"


def _all_reduce_window(w: dict, depth: int) -> dict:
    flat = torch.cat([torch.tensor([w["loss"], w["n"], w["tau"], w["blocks"], w["t"]], dtype=torch.float64),
                      torch.as_tensor(w["correct"], dtype=torch.float64).expand(depth),
                      torch.as_tensor(w["valid"], dtype=torch.float64).expand(depth)])
    dist.all_reduce(flat)
    world = dist.get_world_size()
    return {"loss": float(flat[0]), "n": int(flat[1]), "tau": float(flat[2]), "blocks": int(flat[3]),
            "t": float(flat[4]) / world, "correct": flat[5:5 + depth], "valid": flat[5 + depth:]}


def _dummy_inputs(cfg: DFlashConfig):
    """A one-block forward with no context, for a rank that drew no usable anchor under DDP."""
    B = cfg.block_size
    return (torch.zeros(1, 0, cfg.context_dim), torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
            torch.arange(1, B + 1)[None], torch.ones(1, B, B, dtype=torch.bool))


def _write_checkpoint(out: Path, drafter, opt, state: dict) -> None:
    """Write to a temporary directory, then swap it in: a crash never leaves a half-written checkpoint."""
    tmp, final = out / "checkpoint.tmp", out / "checkpoint"
    shutil.rmtree(tmp, ignore_errors=True)
    save_drafter(drafter, tmp)
    save_optimizer(opt, drafter, tmp / "optimizer.safetensors")
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1) + "\n")
    old = out / "checkpoint.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    atomic_write_text(out / "metrics.json", json.dumps(state["metrics"], indent=1) + "\n")
    save_plots(state["metrics"], out)


def check_arguments(a) -> None:
    """The options of `train drafter`, checked before the data or the target is read: a zero step count or
    layer count would save an untrained or empty drafter, a zero interval fails at the first modulo."""
    from drafttree.validate import (MAX_BLOCK_SIZE, check_finite, check_int, check_model_cache, check_model_dir,
                                    check_threads, check_writable)

    def opt(name: str) -> str:
        return "--" + name.replace("_", "-")

    for name, why in (("steps", "0 steps would save an untrained drafter"), ("layers", "a drafter needs at least one layer"),
                      ("seqs_per_step", "sequences per step"), ("blocks_per_seq", "anchors per sequence"),
                      ("log_every", "steps between log lines"), ("checkpoint_every", "steps between checkpoints"),
                      ("ce_chunk_rows", "rows per loss chunk")):
        value = getattr(a, name)
        if not isinstance(value, int) or value < 1:
            raise InputError(f"{opt(name)} must be an integer >= 1 ({why}), got {value}")
    for name in ("max_context", "stop_at"):
        if getattr(a, name) is not None:
            check_int(opt(name), getattr(a, name), minimum=1)
    check_int("--block-size", a.block_size, 2, MAX_BLOCK_SIZE)
    check_int("--warmup-steps", a.warmup_steps, minimum=0)
    check_int("--draft-vocab", a.draft_vocab, minimum=0)
    check_int("--loss-vocab", a.loss_vocab, minimum=0)
    if a.loss_vocab:
        loss_vocab_ranking(a.init_from, a.loss_vocab)
    check_int("--threads", a.threads, minimum=0)
    if a.threads:
        check_threads(a.threads)
    for name, positive, high in (("lr", True, None), ("min_lr_ratio", False, 1.0), ("weight_decay", False, None),
                                 ("grad_clip", True, None), ("loss_decay_gamma", True, None)):
        value = check_finite(opt(name), getattr(a, name))
        if value < 0 or (positive and value == 0) or (high is not None and value > high):
            bounds = ("> 0" if positive else ">= 0") + (f" and <= {high:g}" if high is not None else "")
            raise InputError(f"{opt(name)} must be {bounds}, got {value}")
    if a.bf16 not in ("auto", "on", "off"):
        raise InputError(f"--bf16 must be auto, on or off, got {a.bf16!r}")
    if a.heldout and not Path(a.heldout).is_dir():
        raise InputError(f"--heldout {a.heldout} is not a directory: give feature shards never trained on (made like "
                         "--data's, `drafttree train data`), or leave --heldout out")
    check_writable(a.out, "--out")
    check_model_dir(a.target)
    check_model_cache(a.target)
    if a.init_from:
        from drafttree.drafter.checkpoint import load_drafter_config
        from drafttree.validate import check_safetensors

        load_drafter_config(a.init_from)
        for f in sorted(Path(a.init_from).glob("*.safetensors")):
            check_safetensors(f, "the --init-from drafter's weights", "copy the drafter again")


def main(argv=None):
    p = argparse.ArgumentParser(description="Train a DFlash drafter on precomputed target features.")
    p.add_argument("--data", required=True, help="directory of feature shards (drafttree.training.data)")
    p.add_argument("--out", required=True, help="output directory (checkpoint/, drafter/, metrics.json, plots)")
    p.add_argument("--target", help="target: Hugging Face directory (config.json + safetensors) or an embedded model name; "
                   "only its embedding, LM head and shape are read")
    p.add_argument("--init-from", help="existing drafter directory to fine-tune")
    p.add_argument("--layers", type=int, default=2, help="draft layers (new drafter)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--draft-vocab", type=int, default=0, help="reduced head: the N most frequent response tokens (0: full)")
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch default)")
    p.add_argument("--heldout", help="directory of feature shards never trained on: block τ logged at every checkpoint")
    for f in TrainConfig.__dataclass_fields__.values():
        if f.name == "betas":
            continue
        kind = {"float": float, "str": str}.get(str(f.type), int)
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    a = p.parse_args(argv)
    if not a.target:
        p.error("--target is required (the embedding and LM head come from the target)")
    check_arguments(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    data = FeatureDataset(a.data)  # a missing or broken shard fails now, not after the target is converted
    if a.heldout:
        FeatureDataset(a.heldout)
    embed, head, _, target_cfg = load_target_head(a.target)
    tc = TrainConfig(**{k: getattr(a, k) for k in TrainConfig.__dataclass_fields__ if k != "betas"})
    dcfg = drafter_config_from_target(target_cfg, data.target_layer_ids, a.layers, a.block_size, a.draft_vocab or None)
    summary = train_drafter(a.data, a.out, embed, head, dcfg, tc, init_from=a.init_from, resume=not a.no_resume,
                            heldout_dir=a.heldout)
    if summary["rank"] == 0 and summary["final"]:
        print(json.dumps({k: summary["final"][k] for k in ("step", "loss", "tau")}))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
