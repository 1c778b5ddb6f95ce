"""Precomputed drafter training data: safetensors shards of (token ids, target context features, loss mask).

Shard format (`features-00000.safetensors`, any number per directory), sequences concatenated:
  input_ids  int32   [N]         token ids of all sequences
  loss_mask  uint8   [N]         1 on response tokens (the ones a drafter should learn to predict)
  features   float*  [N, k*H]    target hidden states after layers `target_layer_ids`, concatenated in
                                 that order (HF `hidden_states[id + 1]`), usually bf16
  offsets    int64   [S + 1]     sequence i is rows offsets[i]:offsets[i+1]
header metadata (strings): format="drafttree-dflash-features", version="1",
  target_layer_ids (JSON list), feature_dim, plus anything the writer adds (e.g. target name).
Shards are read lazily through safetensors slices (memory-mapped; nothing is unpickled).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "drafttree-dflash-features"


def write_feature_shard(path: str | Path, sequences: Iterable, target_layer_ids: list[int],
                        dtype: torch.dtype = torch.bfloat16, metadata: dict | None = None) -> int:
    """Write one shard. `sequences` yields (input_ids [T], features [T, k*H], loss_mask [T]) or dicts
    with those keys. Returns the number of sequences written."""
    ids, feats, masks, offsets = [], [], [], [0]
    for seq in sequences:
        if isinstance(seq, dict):
            seq = (seq["input_ids"], seq["features"], seq["loss_mask"])
        i, f, m = (torch.as_tensor(x) for x in seq)
        if not (i.dim() == 1 and f.dim() == 2 and i.shape == m.shape and f.shape[0] == i.shape[0]):
            raise ValueError(f"bad sequence shapes: input_ids {tuple(i.shape)}, features {tuple(f.shape)}, loss_mask {tuple(m.shape)}")
        ids.append(i.to(torch.int32))
        feats.append(f.to(dtype))
        masks.append(m.to(torch.uint8))
        offsets.append(offsets[-1] + i.shape[0])
    if not ids:
        raise ValueError("no sequences to write")
    dims = {f.shape[1] for f in feats}
    if len(dims) != 1:
        raise ValueError(f"sequences have different feature widths {sorted(dims)}")
    meta = {"format": FORMAT, "version": "1", "target_layer_ids": json.dumps([int(x) for x in target_layer_ids]),
            "feature_dim": str(dims.pop())}
    meta.update({k: str(v) for k, v in (metadata or {}).items()})
    tensors = {"input_ids": torch.cat(ids), "loss_mask": torch.cat(masks), "features": torch.cat(feats).contiguous(),
               "offsets": torch.tensor(offsets, dtype=torch.int64)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")  # renamed only when complete: a killed writer leaves no shard
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)
    return len(ids)


class FeatureShardWriter:
    """Buffers sequences and writes `features-NNNNN.safetensors` shards of about `tokens_per_shard` tokens."""

    def __init__(self, out_dir: str | Path, target_layer_ids: list[int], tokens_per_shard: int = 200_000,
                 dtype: torch.dtype = torch.bfloat16, metadata: dict | None = None):
        self.out_dir = Path(out_dir)
        self.target_layer_ids, self.tokens_per_shard, self.dtype, self.metadata = target_layer_ids, tokens_per_shard, dtype, metadata
        self.buffer, self.buffered_tokens, self.shards = [], 0, 0
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.shards = len(list(self.out_dir.glob("features-*.safetensors")))  # append to an existing directory

    def add(self, input_ids, features, loss_mask) -> None:
        self.buffer.append((input_ids.detach().cpu(), features.detach().cpu().to(self.dtype), loss_mask.detach().cpu()))
        self.buffered_tokens += len(input_ids)
        if self.buffered_tokens >= self.tokens_per_shard:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            path = self.out_dir / f"features-{self.shards:05d}.safetensors"
            write_feature_shard(path, self.buffer, self.target_layer_ids, self.dtype, self.metadata)
            self.shards += 1
            self.buffer, self.buffered_tokens = [], 0

    def close(self) -> None:
        self.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class FeatureDataset:
    """All sequences of all shards in a directory (sorted by file name); items are dicts of
    input_ids (long [T]), features ([T, k*H], stored dtype) and loss_mask (bool [T])."""

    def __init__(self, data_dir: str | Path):
        self.files = sorted(Path(data_dir).glob("*.safetensors"))
        if not self.files:
            raise FileNotFoundError(f"no .safetensors feature shards in {data_dir}")
        self.index: list[tuple[int, int, int]] = []  # (file, start, end)
        self.target_layer_ids = self.feature_dim = None
        self._handles = {}
        for fi, f in enumerate(self.files):
            with safe_open(str(f), framework="pt") as sf:
                meta = sf.metadata() or {}
                if meta.get("format") != FORMAT:
                    raise ValueError(f"{f}: not a drafttree feature shard (format={meta.get('format')!r})")
                ids, dim = json.loads(meta["target_layer_ids"]), int(meta["feature_dim"])
                if self.target_layer_ids is None:
                    self.target_layer_ids, self.feature_dim = ids, dim
                elif (ids, dim) != (self.target_layer_ids, self.feature_dim):
                    raise ValueError(f"{f}: target_layer_ids/feature_dim {ids}/{dim} differ from "
                                     f"{self.target_layer_ids}/{self.feature_dim} of the other shards")
                off = sf.get_tensor("offsets").tolist()
            self.index += [(fi, off[i], off[i + 1]) for i in range(len(off) - 1)]

    def __len__(self) -> int:
        return len(self.index)

    def _handle(self, fi: int):
        """Open shards are kept (reads are memory-mapped slices), at most 64 at a time: a directory may
        hold thousands of small shards and each open one holds a file descriptor."""
        h = self._handles.pop(fi, None) or safe_open(str(self.files[fi]), framework="pt")
        self._handles[fi] = h  # most recently used last
        if len(self._handles) > 64:
            self._handles.pop(next(iter(self._handles)))
        return h

    def __getitem__(self, i: int) -> dict:
        fi, a, b = self.index[i]
        sf = self._handle(fi)
        return {"input_ids": sf.get_slice("input_ids")[a:b].long(),
                "features": sf.get_slice("features")[a:b],
                "loss_mask": sf.get_slice("loss_mask")[a:b].bool()}

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each id occurs as a response (loss-masked) token: ranks the reduced draft vocabulary."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for fi in range(len(self.files)):
            sf = self._handle(fi)
            ids = sf.get_tensor("input_ids").long()
            mask = sf.get_tensor("loss_mask").bool()
            counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
        return counts

    def __getstate__(self):  # handles are not picklable-safe across processes; reopen lazily
        d = dict(self.__dict__)
        d["_handles"] = {}
        return d
