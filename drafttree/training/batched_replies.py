"""Bulk self-distillation through transformers' batched `generate` (left padding, one KV cache row per
sequence), with the context features taken from the same decode.

The lean runtime is batch-1 and its packed mode (datagen.generate_packed) pays attention over every
sequence's rows, so it tops out near 200 reply tokens/s on 2 cores; a real batch of 32 reaches about
400. `output_hidden_states` hands back every layer's output at every step, so no second forward is
needed: the prompt rows come from the prefill step, each reply row from its own decode step — the way
features reach the drafter at inference. HF `hidden_states[i + 1]` is the output of decoder layer i.
"""
from __future__ import annotations

import torch
from transformers import LogitsProcessor

from ..sampling import SamplingParams
from .data import Reply


def _unpad_rows(step_states, layers, row, first, count):
    """[count, k*H] features of one sequence from one step's per-layer states [batch, T, H]."""
    return torch.cat([step_states[i + 1][row, first:first + count] for i in layers], dim=-1)


class TopKRecorder(LogitsProcessor):
    """Keeps the target's top-k log-probabilities at every decode step, unchanged scores passed on. It runs
    before generate's temperature and top-p warpers, so it records the target's own distribution."""

    def __init__(self, k: int):
        self.k, self.steps = k, []

    def __call__(self, input_ids, scores):
        lp, ids = torch.log_softmax(scores.float(), dim=-1).topk(self.k, dim=-1)
        self.steps.append((ids.to(torch.int32), lp.to(torch.float16)))
        return scores


@torch.inference_mode()
def generate_batch(hf_model, prompts: list[torch.Tensor], max_new_tokens: int, sampling: SamplingParams,
                   capture_layers: tuple[int, ...], stop_ids: set[int], pad_id: int, seed: int = 0,
                   top_k: int = 0) -> list[Reply]:
    """Replies to `prompts` (token id tensors) decoded together, one Reply each: tokens = prompt + reply (a
    stop token included, then cut), with the target's top-k at each reply row when top_k > 0."""
    last = hf_model.config.num_hidden_layers - 1
    if any(i >= last for i in capture_layers):
        raise ValueError(f"capture_layers {capture_layers}: transformers returns the last layer ({last}) after the final "
                         "norm, not its raw output; capture earlier layers or use the packed engine")
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - p.numel():] = p
        attn[b, width - p.numel():] = 1
    kwargs = dict(do_sample=False)
    if sampling.temperature > 0:
        torch.manual_seed(seed)
        kwargs = dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p or 1.0,
                      top_k=sampling.top_k or 0)
    recorder = TopKRecorder(top_k) if top_k else None
    out = hf_model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens, min_new_tokens=1,
                            eos_token_id=sorted(stop_ids), pad_token_id=pad_id, output_hidden_states=True,
                            return_dict_in_generate=True, logits_processor=[recorder] if recorder else None, **kwargs)
    replies = out.sequences[:, width:]
    if recorder:  # [batch, steps, k]: step s predicted reply token s, which sits at row prompt_len + s
        top_ids = torch.stack([i for i, _ in recorder.steps], 1)
        top_lps = torch.stack([lp for _, lp in recorder.steps], 1)
    states = out.hidden_states  # per step: tuple over layers+1 of [batch, T_step, H]
    results = []
    for b, p in enumerate(prompts):
        reply = replies[b].tolist()
        n = len(reply)
        for j, t in enumerate(reply):
            if t in stop_ids:
                n = j + 1
                break
        # rows fed to the target: the prompt and every reply token but the last (the last is only predicted)
        feats = [_unpad_rows(states[0], capture_layers, b, width - p.numel(), p.numel())]
        feats += [_unpad_rows(states[s], capture_layers, b, 0, 1) for s in range(1, n)]
        tokens = torch.cat([p, torch.tensor(reply[:n - 1], dtype=torch.long)])
        topk = (None, None)
        if recorder:  # prompt rows: no soft target
            topk = (torch.cat([torch.zeros(p.numel(), top_k, dtype=torch.int32), top_ids[b, :n - 1]]),
                    torch.cat([torch.full((p.numel(), top_k), float("-inf"), dtype=torch.float16), top_lps[b, :n - 1]]))
        results.append(Reply(tokens, torch.cat(feats), p.numel(), *topk))
    return results


def hf_model_for(target, dtype: torch.dtype = torch.bfloat16):
    """(transformers model, pad id) of a drafttree target: the same weights (an embedded model's converted
    checkpoint, or its directory), sdpa attention."""
    from transformers import AutoModelForCausalLM

    from ..gguf_convert import EMBEDDED, convert_embedded

    path = convert_embedded(target.name) if target.name in EMBEDDED else target.name
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
    pad = getattr(target.tokenizer, "pad_token_id", None)  # padding is masked: any id serves when none is named
    return hf, pad if pad is not None else (target.stop_token_ids or (0,))[0]
