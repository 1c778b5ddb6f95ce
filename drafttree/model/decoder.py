"""What the dense and the hybrid targets share: embedding, LM head, per-request state, and the three
calls the engine makes (prefill, verify, commit) on top of each model's own `forward`."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layers import KernelAttention
from .state import ModelState
from .verify_input import VerifyInput


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [R, V] fp32 for the requested rows
    features: torch.Tensor | None  # [T, k*H]: hidden states after the captured layers, concatenated
    hidden: torch.Tensor | None = None  # [T, H]: after the last layer, before the final norm (`row_logits`)


class CausalLM(KernelAttention, nn.Module):
    """Subclasses define `embed_tokens`, `norm`, `lm_head` (None when tied), `_new_state(max_len)`,
    `forward(state, tokens, positions, tree_mask, capture_layers, logits_rows, parents)` and `commit`."""

    config: object

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # the compute dtype (int8 paths keep float norms)

    def new_state(self, max_len: int) -> ModelState:
        """A request's state with room for `max_len` tokens (prompt + generated + one tree's scratch rows)."""
        if max_len > self.config.max_position_embeddings:
            raise ValueError(f"{max_len} tokens exceed the model's context of {self.config.max_position_embeddings}")
        return self._new_state(max_len)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on final-normed hidden states; fp32 logits."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def row_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final hidden states (`ForwardOutput.hidden` rows): the forward's own logits, and on the
        batch-invariant kernel paths (row-wise norm and head) the same bits for rows computed after it."""
        return self.logits(self.norm(hidden))

    def _output(self, x: torch.Tensor, captured: dict[int, torch.Tensor], capture_layers: tuple[int, ...],
                logits_rows: torch.Tensor | None) -> ForwardOutput:
        features = None
        if capture_layers:
            if len(captured) != len(capture_layers):
                raise ValueError(f"capture_layers {capture_layers} must be distinct indices below {len(self.layers)}")
            features = torch.cat([captured[i] for i in capture_layers], dim=-1)  # in the caller's order
        logits = None
        if logits_rows is None or logits_rows.numel():
            logits = self.row_logits(x if logits_rows is None else x[logits_rows])
        return ForwardOutput(logits=logits, features=features, hidden=x)

    def prefill(self, state: ModelState, tokens: torch.Tensor, capture_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """Run and commit a whole prompt; logits of the last token only."""
        out = self.forward(state, tokens, capture_layers=capture_layers, logits_rows=torch.tensor([tokens.shape[0] - 1]))
        self.commit(state, torch.arange(tokens.shape[0]))
        return out

    def verify(self, state: ModelState, batch: VerifyInput, capture_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """One forward over a draft tree; nothing is committed until `commit(state, path)`."""
        return self.forward(state, batch.tokens, batch.positions, batch.mask, capture_layers, batch.logits_rows,
                            parents=batch.parents)

    def verify_many(self, states: list[ModelState], batches: list[VerifyInput],
                    capture_layers: list[tuple[int, ...]]) -> list[ForwardOutput]:
        """`verify` for several requests; models that can batch them into one forward override this."""
        return [self.verify(s, b, c) for s, b, c in zip(states, batches, capture_layers)]
