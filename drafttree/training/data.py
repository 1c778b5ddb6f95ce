"""Precomputed drafter training data: safetensors shards of (token ids, target context features, loss mask).

Shard format (`features-00000.safetensors`, any number per directory), sequences concatenated:
  input_ids  int32   [N]         token ids of all sequences
  loss_mask  uint8   [N]         1 on response tokens (the ones a drafter should learn to predict)
  features   float*  [N, k*H]    target hidden states after layers `target_layer_ids`, concatenated in
                                 that order (HF `hidden_states[id + 1]`), usually bf16
  offsets    int64   [S + 1]     sequence i is rows offsets[i]:offsets[i+1]
  topk_ids        int32   [N, k]      optional: the target's top-k tokens for each row's token (its
                                 distribution one row earlier; the soft targets of self-distillation)
  topk_logprobs   float16 [N, k]      optional: their log-probabilities (-inf: none, e.g. prompt rows)
header metadata (strings): format="drafttree-dflash-features", version="1",
  target_layer_ids (JSON list), feature_dim, plus anything the writer adds (e.g. target name).
Shards are read lazily through safetensors slices (memory-mapped; nothing is unpickled).

Anchor-label shards (`anchors-00000.safetensors`, drafttree.training.anchor_labels) carry their own
labels beside the same tensors (loss_mask marks the reply tokens there):
  anchors         int32   [M]        anchor positions within their sequence, sorted
  anchor_offsets  int64   [S + 1]    sequence i's anchors are rows anchor_offsets[i]:anchor_offsets[i+1]
  labels          int32   [M, D]     the target's greedy block after each anchor (D = B-1; -1 after a stop)
  topk_ids        int32   [M, D, k]  optional: the target's top-k tokens at each label position
  topk_logprobs   float16 [M, D, k]  optional: their log-probabilities (-inf: none)
header metadata adds labels="anchor-blocks", label_depth=D, top_k=k.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterable, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..validate import InputError

FORMAT = "drafttree-dflash-features"
STALE_PARTIAL_S = 600  # a shard is written in seconds: an older `.partial` was left by a killed writer


class Reply(NamedTuple):
    """One decoded training sequence: tokens fed to the target (prompt + reply but its last token), their
    features [T, k*H], the prompt length, and optionally the target's top-k at each row [T, k] (-inf: none)."""
    tokens: torch.Tensor
    features: torch.Tensor
    prompt_len: int
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None


class ShardError(InputError):
    """A feature shard that cannot be used; the message names the file and what to do."""


def _regenerate(path: Path) -> str:
    return (f"delete {path} (the other shards stay usable) or regenerate the data with "
            f"`drafttree train data --out {path.parent}`")


def write_feature_shard(path: str | Path, sequences: Iterable, target_layer_ids: list[int],
                        dtype: torch.dtype = torch.bfloat16, metadata: dict | None = None,
                        extra: dict | None = None) -> int:
    """Write one shard. `sequences` yields (input_ids [T], features [T, k*H], loss_mask [T]) or dicts
    with those keys; `extra` tensors are stored beside them. Returns the number of sequences written."""
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
               "offsets": torch.tensor(offsets, dtype=torch.int64), **(extra or {})}
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
        self.buffer, self.topk, self.buffered_tokens, self.shards = [], [], 0, 0
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for partial in self.out_dir.glob("features-*.safetensors.partial"):  # left by a killed writer
            try:
                if time.time() - partial.stat().st_mtime > STALE_PARTIAL_S:
                    partial.unlink()
            except FileNotFoundError:
                pass
        self.shards = len(list(self.out_dir.glob("features-*.safetensors")))  # append to an existing directory

    def add(self, input_ids, features, loss_mask, topk_ids=None, topk_logprobs=None) -> None:
        """topk_ids / topk_logprobs [T, k]: the target's top-k at each row (Reply's fields), or None; a shard
        stores them only when every sequence in it has them."""
        self.buffer.append((input_ids.detach().cpu(), features.detach().cpu().to(self.dtype), loss_mask.detach().cpu()))
        self.topk.append(None if topk_ids is None else (topk_ids, topk_logprobs))
        self.buffered_tokens += len(input_ids)
        if self.buffered_tokens >= self.tokens_per_shard:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            path = self.out_dir / f"features-{self.shards:05d}.safetensors"
            extra = None
            if all(t is not None for t in self.topk):
                extra = {"topk_ids": torch.cat([i for i, _ in self.topk]).to(torch.int32),
                         "topk_logprobs": torch.cat([lp for _, lp in self.topk]).to(torch.float16)}
            write_feature_shard(path, self.buffer, self.target_layer_ids, self.dtype, self.metadata, extra)
            self.shards += 1
            self.buffer, self.topk, self.buffered_tokens = [], [], 0

    def close(self) -> None:
        self.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


ANCHOR_LABELS = "anchor-blocks"


def write_anchor_shard(path: str | Path, records: list, target_layer_ids: list[int], label_depth: int,
                       dtype: torch.dtype = torch.bfloat16, metadata: dict | None = None) -> int:
    """Write one anchor-label shard. `records`: (AnchorBlocks, reply_mask [L]) pairs (anchor_labels)."""
    if not records:
        raise ValueError("no sequences to write")
    ks = {0 if r.topk_ids is None else r.topk_ids.shape[-1] for r, _ in records}
    if len(ks) != 1:
        raise ValueError(f"records have different top-k widths {sorted(ks)}")
    k = ks.pop()
    offsets = [0]
    for r, _ in records:
        if r.labels.shape != (r.anchors.numel(), label_depth):
            raise ValueError(f"labels {tuple(r.labels.shape)} for {r.anchors.numel()} anchors, depth {label_depth}")
        offsets.append(offsets[-1] + r.anchors.numel())
    extra = {"anchors": torch.cat([r.anchors for r, _ in records]).to(torch.int32),
             "anchor_offsets": torch.tensor(offsets, dtype=torch.int64),
             "labels": torch.cat([r.labels for r, _ in records]).to(torch.int32)}
    if k:
        extra["topk_ids"] = torch.cat([r.topk_ids for r, _ in records]).to(torch.int32)
        extra["topk_logprobs"] = torch.cat([r.topk_logprobs for r, _ in records]).to(torch.float16)
    meta = {"labels": ANCHOR_LABELS, "label_depth": label_depth, "top_k": k, **(metadata or {})}
    return write_feature_shard(path, [(r.input_ids, r.features, m) for r, m in records], target_layer_ids, dtype,
                               meta, extra)


class AnchorShardWriter:
    """Buffers anchor-label records and writes `anchors-NNNNN.safetensors` shards on `flush`."""

    def __init__(self, out_dir: str | Path, target_layer_ids: list[int], label_depth: int,
                 dtype: torch.dtype = torch.bfloat16, metadata: dict | None = None):
        self.out_dir = Path(out_dir)
        self.target_layer_ids, self.label_depth, self.dtype, self.metadata = target_layer_ids, label_depth, dtype, metadata
        self.buffer, self.buffered_tokens = [], 0
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.shards = len(list(self.out_dir.glob("anchors-*.safetensors")))  # append to an existing directory

    def add(self, record, reply_mask) -> None:
        record.features = record.features.detach().cpu().to(self.dtype)
        self.buffer.append((record, torch.as_tensor(reply_mask).cpu()))
        self.buffered_tokens += record.input_ids.numel()

    def flush(self) -> None:
        if self.buffer:
            path = self.out_dir / f"anchors-{self.shards:05d}.safetensors"
            write_anchor_shard(path, self.buffer, self.target_layer_ids, self.label_depth, self.dtype, self.metadata)
            self.shards += 1
            self.buffer, self.buffered_tokens = [], 0


def _anchor_ranges(f: Path, off: list) -> list:
    """Per sequence of an anchor-label shard its rows of `anchors`/`labels` (None for a plain shard)."""
    with safe_open(str(f), framework="pt") as sf:  # its header was read already: the file opens
        if "anchor_offsets" not in sf.keys():
            return [None] * (len(off) - 1)
        aoff = sf.get_tensor("anchor_offsets").tolist()
        anchors = sf.get_tensor("anchors").long() if "anchors" in sf.keys() else torch.zeros(0, dtype=torch.long)
        shapes = {k: tuple(sf.get_slice(k).get_shape()) for k in sf.keys() if k in ("labels", "topk_ids", "topk_logprobs")}
    m = anchors.numel()
    ok = len(aoff) == len(off) and aoff[0] == 0 and aoff[-1] == m and all(b >= a for a, b in zip(aoff, aoff[1:]))
    ok = ok and len(shapes.get("labels", ())) == 2 and shapes["labels"][0] == m
    ok = ok and ("topk_ids" in shapes) == ("topk_logprobs" in shapes)
    if "topk_ids" in shapes:
        ok = ok and shapes["topk_ids"] == shapes["topk_logprobs"] and shapes["topk_ids"][:2] == shapes["labels"]
    if ok:
        length = torch.tensor([b - a for a, b in zip(off, off[1:])]).repeat_interleave(torch.tensor(aoff).diff())
        ok = bool(((anchors >= 0) & (anchors < length)).all())
    if not ok:
        raise ValueError(f"{f}: inconsistent anchor labels (anchor_offsets {aoff[:3]}...{aoff[-1:]}, {m} anchors, "
                         f"{shapes}): delete it or regenerate it with `drafttree train data --engine anchors`")
    return [(a, b) for a, b in zip(aoff, aoff[1:])]


class FeatureDataset:
    """All sequences of all shards in a directory (sorted by file name); items are dicts of
    input_ids (long [T]), features ([T, k*H], stored dtype) and loss_mask (bool [T])."""

    def __init__(self, data_dir: str | Path):
        data_dir = Path(data_dir)
        if not data_dir.is_dir():
            raise FileNotFoundError(f"--data {data_dir} is not a directory: make one with `drafttree train data --out "
                                    f"{data_dir}`")
        self.files = sorted(data_dir.glob("*.safetensors"))
        if not self.files:
            raise FileNotFoundError(f"no .safetensors feature shards in {data_dir}: make them with "
                                    f"`drafttree train data --out {data_dir}`")
        self.index: list[tuple[int, int, int]] = []  # (file, start, end)
        self.anchor_ranges: list[tuple[int, int] | None] = []  # rows of anchors/labels (anchor-label shards)
        self.target_layer_ids = self.feature_dim = None
        self._handles = {}
        for fi, f in enumerate(self.files):
            ids, dim, off = self._read_header(f)
            if self.target_layer_ids is None:
                self.target_layer_ids, self.feature_dim = ids, dim
            elif (ids, dim) != (self.target_layer_ids, self.feature_dim):
                raise ShardError(f"{f}: target_layer_ids/feature_dim {ids}/{dim} differ from "
                                 f"{self.target_layer_ids}/{self.feature_dim} of the other shards: keep one "
                                 "target and --layers per data directory")
            self.index += [(fi, off[i], off[i + 1]) for i in range(len(off) - 1)]
            self.anchor_ranges += _anchor_ranges(f, off)

    @staticmethod
    def _read_header(f: Path) -> tuple[list, int, list]:
        """(target_layer_ids, feature_dim, offsets) of one shard, its layout checked without reading the
        features: a truncated or foreign file fails here, naming itself, not as a traceback mid-training."""
        try:
            with safe_open(str(f), framework="pt") as sf:
                meta = sf.metadata() or {}
                if meta.get("format") != FORMAT:
                    raise ShardError(f"{f}: not a drafttree feature shard (format={meta.get('format')!r}): move it "
                                     "out of the data directory")
                ids, dim = json.loads(meta["target_layer_ids"]), int(meta["feature_dim"])
                shapes = {k: tuple(sf.get_slice(k).get_shape()) for k in ("input_ids", "loss_mask", "features", "offsets")}
                off = sf.get_tensor("offsets").tolist()
                per_row_topk = "anchor_offsets" not in sf.keys() and ("topk_ids" in sf.keys() or "topk_logprobs" in sf.keys())
                topk_shapes = [tuple(sf.get_slice(k).get_shape()) if k in sf.keys() else None
                               for k in ("topk_ids", "topk_logprobs")]
        except SafetensorError as e:
            raise ShardError(f"{f}: unreadable feature shard, perhaps truncated by a killed run ({e}); {_regenerate(f)}") \
                from None
        except (KeyError, ValueError, TypeError) as e:
            if isinstance(e, ShardError):
                raise
            raise ShardError(f"{f}: broken feature shard header ({type(e).__name__}: {e}); {_regenerate(f)}") from None
        n = shapes["input_ids"][0] if len(shapes["input_ids"]) == 1 else -1
        if (n < 0 or shapes["loss_mask"] != (n,) or shapes["features"] != (n, dim) or len(off) < 2 or off[0] != 0
                or off[-1] != n or any(b < a for a, b in zip(off, off[1:]))):
            raise ShardError(f"{f}: inconsistent feature shard (shapes {shapes}, feature_dim {dim}, offsets "
                             f"{off[:3]}...{off[-1:]}); {_regenerate(f)}")
        if per_row_topk and (topk_shapes[0] != topk_shapes[1] or len(topk_shapes[0]) != 2 or topk_shapes[0][0] != n):
            raise ShardError(f"{f}: inconsistent top-k tensors {topk_shapes} for {n} rows; {_regenerate(f)}")
        return ids, dim, off

    def check_token_ids(self, vocab_size: int) -> None:
        """Every token id of every shard lies in [0, vocab_size): ids from another model's tokenizer would
        otherwise index past the embedding in the middle of training."""
        for fi, f in enumerate(self.files):
            ids = self._handle(fi).get_tensor("input_ids")
            bad = torch.nonzero((ids < 0) | (ids >= vocab_size)).flatten()
            if bad.numel():
                row = int(bad[0])
                seq = next(i for i, (g, a, b) in enumerate(self.index) if g == fi and a <= row < b)
                raise ShardError(f"{f}: token id {int(ids[row])} (sequence {seq}) is outside the target's vocabulary "
                                 f"of {vocab_size}: this data was made with another model; regenerate it with "
                                 f"`drafttree train data --model TARGET` for the target you train against")

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
        item = {"input_ids": sf.get_slice("input_ids")[a:b].long(),
                "features": sf.get_slice("features")[a:b],
                "loss_mask": sf.get_slice("loss_mask")[a:b].bool()}
        if self.anchor_ranges[i] is not None:  # anchor-label shard: its anchors and the target's blocks
            lo, hi = self.anchor_ranges[i]
            item["anchors"] = sf.get_slice("anchors")[lo:hi].long()
            item["labels"] = sf.get_slice("labels")[lo:hi].long()
            if "topk_ids" in sf.keys():
                item["topk_ids"] = sf.get_slice("topk_ids")[lo:hi].long()
                item["topk_logprobs"] = sf.get_slice("topk_logprobs")[lo:hi].float()
        elif "topk_ids" in sf.keys():  # self-distillation shard with the target's top-k per row [T, k]
            item["topk_ids"] = sf.get_slice("topk_ids")[a:b].long()
            item["topk_logprobs"] = sf.get_slice("topk_logprobs")[a:b].float()
        return item

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each id occurs as a response (loss-masked) token: ranks the reduced draft vocabulary."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for fi in range(len(self.files)):
            sf = self._handle(fi)
            ids = sf.get_tensor("input_ids").long()
            mask = sf.get_tensor("loss_mask").bool()
            if "labels" in sf.keys():  # anchor-label shards: the target's own tokens are the labels
                labels = sf.get_tensor("labels").long()
                ids, mask = labels.flatten(), labels.flatten() >= 0
            counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
        return counts

    def __getstate__(self):  # handles are not picklable-safe across processes; reopen lazily
        d = dict(self.__dict__)
        d["_handles"] = {}
        return d
