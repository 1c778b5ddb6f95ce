"""Preallocated KV cache with a committed length and scratch rows after it.

A forward writes the K/V of its new tokens at [length, length + T) without committing them;
`commit(rows)` keeps only the accepted rows (a root-to-node path of a tree, or a chain prefix)
by moving them to [length, length + A). Rejected rows are simply overwritten next time.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype):
        self.k = torch.zeros(num_layers, num_kv_heads, max_len, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = 0
        self.pending = 0  # rows written by the last forward, not yet committed

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def grow(self, max_len: int) -> None:
        """Room for at least `max_len` rows; the committed rows are kept."""
        if max_len <= self.max_len:
            return
        n, shape = self.length, (*self.k.shape[:2], max_len, self.k.shape[3])
        k, v = self.k.new_zeros(shape), self.v.new_zeros(shape)
        k[:, :, :n], v[:, :, :n] = self.k[:, :, :n], self.v[:, :, :n]
        self.k, self.v = k, v

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new k/v [kv_heads, T, d] after the committed rows; return all keys/values visible to them."""
        end = self.length + k.shape[1]
        self.k[layer, :, self.length:end] = k
        self.v[layer, :, self.length:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def commit(self, rows: torch.Tensor) -> None:
        rows = torch.as_tensor(rows, dtype=torch.long)
        a = rows.numel()
        if a and int(rows.max()) >= self.pending:
            raise ValueError(f"commit row {int(rows.max())} is beyond the {self.pending} rows of the last forward")
        if not torch.equal(rows, torch.arange(a)):  # a chain prefix is already in place
            src = self.length + rows
            self.k[:, :, self.length:self.length + a] = self.k[:, :, src]  # advanced indexing copies first
            self.v[:, :, self.length:self.length + a] = self.v[:, :, src]
        self.length += a
        self.pending = 0

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length
        self.pending = 0


def check_room(cache: KVCache, new_tokens: int) -> int:
    """The committed length, after checking that a forward of `new_tokens` fits in the cache."""
    if cache.length + new_tokens > cache.max_len:
        raise ValueError(f"{cache.length} cached + {new_tokens} new tokens exceed the state's room for "
                         f"{cache.max_len}; create it with new_state(max_len) large enough")
    return cache.length
