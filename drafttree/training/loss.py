"""Cross-entropy through a frozen LM head without materialising [N, V] logits for autograd.

The head matmul over the whole vocabulary dominates drafter training on CPU. Because the head is
frozen and the loss is the last op, d(ce)/d(hidden) = (softmax - onehot) @ W is known in the
forward pass: compute it chunk by chunk right there and keep only [N, H] for backward. Same FLOPs
as logits + F.cross_entropy, a fraction of the memory traffic.
"""
from __future__ import annotations

import torch


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows):
        n = hidden.shape[0]
        losses = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        preds = torch.zeros(n, dtype=torch.long, device=hidden.device)
        grad = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        w = weight  # the matmuls run in the head's dtype (bf16 is ~4x faster on CPUs with avx512_bf16)
        for s in range(0, n, chunk_rows):
            e = min(n, s + chunk_rows)
            t = targets[s:e]
            valid = t >= 0
            tc = t.clamp(min=0)
            logits = (hidden[s:e].to(w.dtype) @ w.t()).float()
            rows = torch.arange(e - s, device=hidden.device)
            target_logit = logits[rows, tc]
            mx, preds[s:e] = logits.max(dim=-1)  # the max doubles as the prediction
            p = logits.sub_(mx[:, None]).exp_()  # one exp, in place: both logsumexp and softmax use it
            total = p.sum(-1)
            losses[s:e] = (mx + total.log() - target_logit) * valid
            if grad is not None:
                p.div_(total[:, None])
                p[rows, tc] -= 1.0
                p.mul_(valid[:, None])
                grad[s:e] = (p.to(w.dtype) @ w).to(grad.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(preds)
        return losses, preds

    @staticmethod
    def backward(ctx, grad_losses, _grad_preds):
        (grad,) = ctx.saved_tensors
        return grad * grad_losses[:, None].to(grad.dtype), None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_rows: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy of `hidden @ weight.T` against `targets` (-1 = ignored row, loss 0) and
    the argmax predictions. hidden [N, H] may require grad; weight [V, H] is treated as frozen, and its
    dtype sets the matmul precision (softmax statistics are always fp32)."""
    if weight.requires_grad:
        raise ValueError("linear_cross_entropy treats the LM head as frozen; pass weight.detach()")
    return _LinearCrossEntropy.apply(hidden, weight, targets, chunk_rows)


class _LinearCrossEntropyKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, top_ids, top_logprobs, chunk_rows):
        n = hidden.shape[0]
        losses = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        kls = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        preds = torch.zeros(n, dtype=torch.long, device=hidden.device)
        need_grad = ctx.needs_input_grad[0]
        g_ce = torch.zeros_like(hidden) if need_grad else None
        g_kl = torch.zeros_like(hidden) if need_grad else None
        lp = top_logprobs.float()
        soft = torch.isfinite(lp).any(-1)  # rows with a target distribution
        tp = torch.softmax(torch.where(soft[:, None], lp, 0.0), -1) * soft[:, None]  # the top-k, renormalised
        log_tp = torch.where(tp > 0, tp.clamp(min=1e-30).log(), 0.0)
        w = weight
        for s in range(0, n, chunk_rows):
            e = min(n, s + chunk_rows)
            t = targets[s:e]
            valid = t >= 0
            tc = t.clamp(min=0)
            logits = (hidden[s:e].to(w.dtype) @ w.t()).float()
            rows = torch.arange(e - s, device=hidden.device)
            target_logit = logits[rows, tc]
            top_logit = logits.gather(1, top_ids[s:e])
            mx, preds[s:e] = logits.max(dim=-1)
            p = logits.sub_(mx[:, None]).exp_()
            total = p.sum(-1)
            lse = mx + total.log()
            losses[s:e] = (lse - target_logit) * valid
            kls[s:e] = (tp[s:e] * (log_tp[s:e] - (top_logit - lse[:, None]))).sum(-1)
            if need_grad:
                qw = (p.div_(total[:, None]).to(w.dtype) @ w).float()  # E_q[W], shared by both gradients
                g_ce[s:e] = ((qw - w[tc].float()) * valid[:, None]).to(g_ce.dtype)
                tw = (tp[s:e, :, None] * w[top_ids[s:e]].float()).sum(1)
                g_kl[s:e] = ((qw - tw) * soft[s:e, None]).to(g_kl.dtype)
        ctx.save_for_backward(g_ce, g_kl)
        ctx.mark_non_differentiable(preds)
        return losses, kls, preds

    @staticmethod
    def backward(ctx, grad_losses, grad_kls, _grad_preds):
        g_ce, g_kl = ctx.saved_tensors
        grad = g_ce * grad_losses[:, None].to(g_ce.dtype) + g_kl * grad_kls[:, None].to(g_kl.dtype)
        return grad, None, None, None, None, None


def linear_ce_kl(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, top_ids: torch.Tensor,
                 top_logprobs: torch.Tensor, chunk_rows: int = 128):
    """`linear_cross_entropy` plus, per row, the sparse KL(p || q) of the target's top-k distribution p
    (top_ids [N, k], top_logprobs [N, k]; renormalised over the k; -inf entries are absent, an all -inf
    row has no soft target and KL 0) to the drafter's full softmax q, from the same head matmul.
    Returns (ce [N], kl [N], predictions [N])."""
    if weight.requires_grad:
        raise ValueError("linear_ce_kl treats the LM head as frozen; pass weight.detach()")
    return _LinearCrossEntropyKL.apply(hidden, weight, targets, top_ids, top_logprobs, chunk_rows)
