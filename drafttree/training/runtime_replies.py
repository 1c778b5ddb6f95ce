"""Bulk self-distillation on drafttree's own runtime: many sequences decoded together, one batched forward a
step (`verify_many`: the linear layers and the LM head once over every sequence's row, attention per sequence
against its own cache), the captured layers' outputs and the target's top-k taken from those same forwards.

These are the replies of the model users run (the q4 or int8 target on its kernel path), and on those paths
rows are batch-invariant, so a greedy reply here is token for token the reply of `generate_ar`. Decoding is
continuous: when a sequence stops, the next prompt is prefilled into its place, so the batch stays full until
the prompts run out.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from ..model.verify_input import VerifyInput
from ..sampling import SamplingParams, next_token
from .data import Reply

ONE_ROW_MASK = torch.ones(1, 1, dtype=torch.bool)
NO_PARENT = torch.tensor([-1])


@dataclass
class _Decode:
    """One prompt's decode: what was fed (prompt + reply so far), its feature rows and top-k rows."""
    index: int
    prompt_len: int
    state: object
    tokens: list[int]
    logits: torch.Tensor  # [V]: the distribution of the next reply token
    features: list[torch.Tensor] = field(default_factory=list)
    top_ids: list[torch.Tensor] = field(default_factory=list)
    top_lps: list[torch.Tensor] = field(default_factory=list)
    reply: int = 0  # reply tokens chosen so far


def _start(model, index: int, prompt: torch.Tensor, max_new_tokens: int, capture_layers) -> _Decode:
    state = model.new_state(prompt.numel() + max_new_tokens)
    out = model.prefill(state, prompt, capture_layers=capture_layers)
    return _Decode(index, prompt.numel(), state, prompt.tolist(), out.logits[-1], [out.features])


def _finish(d: _Decode, top_k: int) -> Reply:
    """The Reply of a stopped decode: every fed token has its feature row; prompt rows carry no soft target."""
    d.state = None
    tokens = torch.tensor(d.tokens)
    if not top_k:
        return Reply(tokens, torch.cat(d.features), d.prompt_len)
    n = tokens.numel() - d.prompt_len  # reply rows fed: row prompt_len + s holds reply token s
    ids = torch.cat([torch.zeros(d.prompt_len, top_k, dtype=torch.int32), *d.top_ids[:n]])
    lps = torch.cat([torch.full((d.prompt_len, top_k), float("-inf"), dtype=torch.float16), *d.top_lps[:n]])
    return Reply(tokens, torch.cat(d.features), d.prompt_len, ids, lps)


@torch.inference_mode()
def generate_runtime(model, prompts: list[torch.Tensor], max_new_tokens: int, sampling: SamplingParams,
                     capture_layers: tuple[int, ...], stop_ids: set[int], generator: torch.Generator | None = None,
                     top_k: int = 0, width: int = 64, on_step=None) -> list[Reply]:
    """Replies to `prompts`, at most `width` decoding at once, in the prompts' order: tokens = prompt + reply
    but its last token (a stop token ends a reply and is only predicted), features [T, k*H] after
    `capture_layers`, and with top_k > 0 the target's top-k log-probabilities at each reply row.
    on_step(tokens) is called after each batched step with the number of reply tokens it chose."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    waiting = deque(enumerate(prompts))
    active: list[_Decode] = []
    replies: list[Reply | None] = [None] * len(prompts)
    while waiting or active:
        while waiting and len(active) < width:
            active.append(_start(model, *waiting.popleft(), max_new_tokens, capture_layers))
        logits = torch.stack([d.logits for d in active])
        if top_k:  # the target's own distribution, before any temperature or top-p
            lps, ids = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1)
            ids, lps = ids.to(torch.int32), lps.to(torch.float16)
        chosen = next_token(logits, sampling, generator).tolist()
        fed = []
        for i, (d, t) in enumerate(zip(active, chosen)):
            if top_k:
                d.top_ids.append(ids[i:i + 1])
                d.top_lps.append(lps[i:i + 1])
            d.reply += 1
            if t in stop_ids or d.reply == max_new_tokens:  # the last reply token is never fed
                replies[d.index] = _finish(d, top_k)
            else:
                d.tokens.append(t)
                fed.append(d)
        if on_step is not None:
            on_step(len(active))
        active = fed
        if not fed:
            continue
        batches = [VerifyInput(torch.tensor([d.tokens[-1]]), torch.tensor([d.state.length]), NO_PARENT, ONE_ROW_MASK)
                   for d in fed]
        outs = model.verify_many([d.state for d in fed], batches, [capture_layers] * len(fed))
        for d, out in zip(fed, outs):
            model.commit(d.state, torch.zeros(1, dtype=torch.long))
            d.features.append(out.features)
            d.logits = out.logits[-1]
    return replies
