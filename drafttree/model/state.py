"""Per-request decode state of a target model: modules hold weights only, this holds everything a
request has written (KV rows, Gated DeltaNet recurrent and conv state, what the last forward left for
its commit). Many states may live at once; each is created by `model.new_state(max_len)`."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv_cache import KVCache


@dataclass
class GDNLayerState:
    """One Gated DeltaNet layer's committed state and the stash of its last forward."""

    conv_ctx: torch.Tensor  # [K-1, conv_dim]: pre-conv inputs of the last K-1 committed tokens
    recurrent: torch.Tensor  # [Hv, dk, dv] fp32
    pending: object | None = None  # what the last forward leaves for commit (gdn_layer._Pending)
    deferred: torch.Tensor | None = None  # an accepted path whose fold waits for the next forward

    @property
    def nbytes(self) -> int:
        return self.conv_ctx.nbytes + self.recurrent.nbytes


@dataclass
class ModelState:
    """A request's state in one target model."""

    kv: KVCache  # attention layers' K/V (a hybrid's attention layers only)
    gdn: list[GDNLayerState] = field(default_factory=list)  # hybrid models: one per GDN layer
    last_tree_mask: torch.Tensor | None = None  # [T, T] ancestor mask of the last forward (None: a chain)

    @property
    def length(self) -> int:
        """Committed tokens."""
        return self.kv.length

    @property
    def max_len(self) -> int:
        return self.kv.max_len

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + sum(g.nbytes for g in self.gdn)
