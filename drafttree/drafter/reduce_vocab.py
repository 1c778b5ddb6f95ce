"""Give a trained drafter a reduced draft vocabulary after training: its head scores only the N most
frequent reply tokens of the training data (rows of the target's head, nothing retrained).

The drafter's LM head over SmolLM2's 49,152 tokens is about 40 % of a draft step on CPU; a token
outside the reduced set can still be produced — by the target, as the bonus token — it just cannot
be drafted. Kept only where τ barely moves and the draft step gets cheaper (measure both).

A reduced head from training shards: `python -m drafttree.training.draft_vocab`; the shipped drafter's ranking
(narrowed at load time): `python -m drafttree.training.text_vocab --rank-out`.
"""
from __future__ import annotations

import dataclasses

import torch

from .model import DFlashDrafter


def with_draft_vocab(drafter: DFlashDrafter, token_counts: torch.Tensor, size: int) -> tuple[DFlashDrafter, float]:
    """A copy of `drafter` whose head covers the `size` most counted ids; returns it and the share of
    counted tokens those ids cover."""
    if not 0 < size <= drafter.config.vocab_size:
        raise ValueError(f"--size must be in 1..{drafter.config.vocab_size}, got {size}")
    cfg = dataclasses.replace(drafter.config, draft_vocab_size=size)
    out = DFlashDrafter(cfg).to(drafter.fc.weight.dtype)
    state = {k: v for k, v in drafter.state_dict().items() if k != "draft_vocab"}
    missing, unexpected = out.load_state_dict(state, strict=False)
    if unexpected or set(missing) != {"draft_vocab"}:
        raise ValueError(f"drafter tensors do not line up: missing {missing}, unexpected {unexpected}")
    top = token_counts.argsort(descending=True, stable=True)[:size]
    out.set_draft_vocab(top)
    coverage = float(token_counts[top].sum()) / max(1, int(token_counts.sum()))
    return out.eval(), coverage


RANK_FILE = "draft_vocab_rank.safetensors"


def save_rank(ranked_ids: torch.Tensor, path) -> None:
    """The draft vocabulary's ids, most frequent first (text_vocab --rank-out), as one safetensors tensor."""
    from safetensors.torch import save_file

    save_file({"ids": ranked_ids.to(torch.int64).contiguous()}, str(path))


def load_rank(path) -> torch.Tensor:
    from safetensors.torch import load_file

    ids = load_file(str(path)).get("ids")
    if ids is None or ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError(f"{path}: expected one int64 tensor `ids` (a ranked draft vocabulary); rewrite it with "
                         "`python -m drafttree.training.text_vocab --rank-out`")
    return ids


def narrow_draft_vocab(drafter: DFlashDrafter, ranked_ids: torch.Tensor, size: int) -> DFlashDrafter:
    """Keep the `size` highest-ranked ids of the drafter's draft vocabulary (in place; returns the drafter): a
    smaller head read per drafted row, for tokens it rarely drafts right anyway. `ranked_ids` must be a ranking of
    exactly the drafter's draft vocabulary."""
    ids = top_ranked_ids(drafter, ranked_ids, size)
    if size < drafter.config.draft_vocab_size:
        drafter.config = dataclasses.replace(drafter.config, draft_vocab_size=size)
        drafter.draft_vocab = ids.to(drafter.draft_vocab.device)
        drafter._head_cache = None
    return drafter


def top_ranked_ids(drafter: DFlashDrafter, ranked_ids: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` highest-ranked ids of the drafter's draft vocabulary, ascending (as a draft vocabulary is kept);
    `ranked_ids` must rank exactly its ids. The drafter is left as it is."""
    current = drafter.config.draft_vocab_size
    if not current:
        raise ValueError("the drafter scores the whole vocabulary: it has no draft vocabulary to narrow")
    if not 0 < size <= current:
        raise ValueError(f"a narrower draft vocabulary needs 1..{current} ids, got {size}")
    if ranked_ids.numel() != current or not torch.equal(ranked_ids.sort().values, drafter.draft_vocab.sort().values):
        raise ValueError("the ranking does not list the drafter's draft vocabulary: rank it again for this drafter "
                         "(`python -m drafttree.training.text_vocab --rank-out`)")
    return ranked_ids[:size].sort().values
