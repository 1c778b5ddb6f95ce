"""Checks of user input, run before any model is loaded: a bad value fails in a second with one clear
line instead of minutes later inside a forward pass (or never, as a silently wrong result).

Used by the command line (drafttree.apps.cli) and the Python API (SamplingParams, cost-model and drafter loading).
"""
from __future__ import annotations

import json
import math
import numbers
import os
import sys
from pathlib import Path


class InputError(ValueError):
    """A bad argument or input file; the CLI prints it as one line, without a traceback."""


_warned: set[str] = set()


def warn(message: str) -> None:
    """Once per message: the CLI checks a file before loading and the loader checks it again."""
    if message not in _warned:
        _warned.add(message)
        print(f"drafttree: warning: {message}", file=sys.stderr)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # True is an int to Python, not to us


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    if not _is_int(value):
        raise InputError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise InputError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InputError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_positive_int(name: str, value) -> int:
    return check_int(name, value, minimum=1)


def check_finite(name: str, value) -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise InputError(f"{name} must be a finite number, got {value!r}")


def check_token_ids(ids, vocab_size, what: str = "prompt"):
    """`ids` as a 1-D torch.LongTensor, or an InputError naming the problem: a list, tuple or tensor (torch or
    numpy) of integers (Python, numpy or 0-d torch), non-empty, each in [0, vocab_size). Floats and bools
    are refused rather than truncated or read as 0/1, which would silently decode a different prompt."""
    import torch

    vocab_size = check_positive_int("vocab_size", vocab_size)
    if isinstance(ids, (str, bytes)):
        raise InputError(f"{what} must be token ids, got text {ids[:40]!r}: encode it first (target.encode)")
    if not isinstance(ids, torch.Tensor):
        if hasattr(ids, "__array__") and hasattr(ids, "dtype"):  # a numpy array: checked as a tensor below
            try:
                ids = torch.from_numpy(ids)
            except TypeError:
                raise InputError(f"{what} token ids must be integers, got an array of dtype {ids.dtype}") from None
        elif isinstance(ids, (list, tuple)):
            values = []
            for i, x in enumerate(ids):
                if isinstance(x, torch.Tensor) and x.ndim == 0 and not x.dtype.is_floating_point \
                        and not x.dtype.is_complex and x.dtype != torch.bool:
                    x = int(x)
                elif isinstance(x, (list, tuple)) or (isinstance(x, torch.Tensor) and x.ndim > 0):
                    raise InputError(f"{what} token ids must be a flat (1-D) sequence, got a nested one at position {i}")
                elif not _is_int(x):
                    kind = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
                    raise InputError(f"{what} token ids must be integers, got {kind} {x!r} at position {i}")
                _check_token_range(int(x), i, vocab_size, what)  # here too: an id beyond int64 breaks torch.tensor
                values.append(int(x))
            ids = torch.tensor(values, dtype=torch.long)
        else:
            raise InputError(f"{what} token ids must be a list, tuple or tensor of integers, got {type(ids).__name__}")
    if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise InputError(f"{what} token ids must be integers, got a tensor of dtype {ids.dtype} "
                         "(convert with .long() only if the values are whole token ids)")
    if ids.ndim != 1:
        raise InputError(f"{what} token ids must be a 1-D sequence, got shape {tuple(ids.shape)}"
                         + (" (one prompt at a time: pass ids[0])" if ids.ndim == 2 and ids.shape[0] == 1 else ""))
    if ids.numel() == 0:
        raise InputError(f"{what} is empty: give at least one token id")
    ids = ids.detach().to(device="cpu", dtype=torch.long)
    bad = torch.nonzero((ids < 0) | (ids >= vocab_size)).flatten()
    if bad.numel():
        _check_token_range(int(ids[int(bad[0])]), int(bad[0]), vocab_size, what)
    return ids


def _check_token_range(token: int, i: int, vocab_size: int, what: str) -> None:
    if token < 0:
        raise InputError(f"{what} token id {token} at position {i} is negative: token ids are 0..{vocab_size - 1}")
    if token >= vocab_size:
        raise InputError(f"{what} token id {token} at position {i} is >= the vocabulary size {vocab_size} (ids are "
                         f"0..{vocab_size - 1}): were the ids made by another model's tokenizer?")


def check_sampling(temperature, top_p, top_k) -> None:
    """temperature >= 0 (0 = greedy), 0 < top_p <= 1, top_k >= 0 (0 = off); nan and inf are refused:
    nan compares false with everything, so it would slip through plain range checks."""
    if check_finite("temperature", temperature) < 0:
        raise InputError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < check_finite("top_p", top_p) <= 1.0:
        raise InputError(f"top_p must be in (0, 1], got {top_p}")
    check_int("top_k", top_k, minimum=0)


def check_text(name: str, text: str) -> str:
    """Text from the command line that is valid UTF-8: Python hands undecodable argv bytes over as lone
    surrogates, which a tokenizer either rejects with a traceback or turns into garbage tokens."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = text[e.start].encode("utf-8", "surrogateescape") if 0xDC80 <= ord(text[e.start]) <= 0xDCFF else b""
        what = f"byte 0x{raw.hex()}" if raw else f"character U+{ord(text[e.start]):04X}"
        raise InputError(f"{name} is not valid UTF-8 ({what} at character {e.start}): pass UTF-8 text "
                         "(is the terminal or the file it came from in another encoding?)") from None
    return text


def parse_layer_ids(text: str, option: str = "--layers") -> tuple[int, ...]:
    """Comma-separated distinct target layer ids >= 0, as the data generators take them."""
    try:
        layers = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InputError(f"{option} must be comma-separated target layer ids, got {text!r}") from None
    if not layers or min(layers) < 0 or len(set(layers)) != len(layers):
        raise InputError(f"{option} must be distinct target layer ids >= 0, got {text!r}")
    return layers


def check_threads(n) -> int | None:
    """None means all cores; more threads than cores only makes them wait for each other."""
    if n is None:
        return None
    check_int("threads", n, minimum=1)
    cores = os.cpu_count() or 1
    if n > cores:
        warn(f"{n} threads on {cores} CPU cores: threads will compete; {cores} or fewer is faster")
    return n


def read_json(path, what: str, rebuild: str | None = None):
    """JSON of `path`, or an InputError naming the file (and how to rebuild it) when it is not JSON."""
    path = Path(path)
    hint = f"; {rebuild}" if rebuild else ""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: {what} is not valid JSON ({e}){hint}") from None


def check_model_dir(name_or_path: str) -> None:
    """A checkpoint directory's config.json must at least be a JSON object (the loader's own error for a
    broken one is a transformers traceback); a file must be a GGUF file."""
    from .gguf_convert import EMBEDDED

    if name_or_path not in EMBEDDED and Path(name_or_path).is_file():  # a GGUF file: its magic, before any load
        from .model.gguf_model import check_gguf_magic

        check_gguf_magic(Path(name_or_path))
        return
    config = Path(name_or_path) / "config.json"
    if name_or_path in EMBEDDED or not config.is_file():
        return  # embedded, or not a directory: load_target's own message says what is expected
    if not isinstance(read_json(config, "the model config", "copy or download the checkpoint again"), dict):
        raise InputError(f"{config}: the model config must be a JSON object")
    for f in sorted(config.parent.glob("*.safetensors")):
        check_safetensors(f, "the model's weights", "copy or download the checkpoint again")


# ---- cost models ---------------------------------------------------------------------------------

MAX_MS = 1e5  # 100 s for one forward or one draft: no profile of a working machine says that


def check_cost_model(model) -> None:
    """A VerifyCostModel a CaDDTree policy can use. ConvexCost already refuses non-finite, decreasing or
    concave curves; here: the draft cost is finite and >= 0, every curve costs > 0 and rises with the
    tokens verified (a flat curve makes every tree look free, so trees would always grow to the cap),
    and nothing is absurdly large (a unit mix-up, seconds or µs for ms)."""
    for name in ("draft_ms", "draft_ms_per_context_token"):
        value = check_finite(name, getattr(model, name))
        if not 0 <= value <= MAX_MS:
            raise InputError(f"{name} must be in [0, {MAX_MS:g}] ms, got {value}")
    for ctx, curve in zip(model.context_lens, model.curves):
        v = curve.values
        if v[0] <= 0 or v[-1] > MAX_MS:
            raise InputError(f"verify curve at context {ctx}: costs must be in (0, {MAX_MS:g}] ms, got {v[0]}..{v[-1]}")
        if len(v) < 2 or v[-1] <= v[0]:
            raise InputError(f"verify curve at context {ctx} is flat ({v[0]} ms for every tree size): "
                             "it needs measurements at more than one token count")


# ---- drafter configs -----------------------------------------------------------------------------

MAX_BLOCK_SIZE = 64  # positions drafted per forward; beyond this the last ones are essentially never accepted
LARGE_BLOCK_SIZE = 32


def check_drafter_config(d: dict) -> None:
    """The fields of a DFlash drafter config.json that sizes and indices are built from."""
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if key not in d:
            raise InputError(f"drafter config lacks the key {key!r}: is this a DFlash drafter's config.json?")
        check_positive_int(f"drafter config {key}", d.get(key))
    dc = d.get("dflash_config") or {}
    block = d.get("block_size", dc.get("block_size"))
    if block is not None:
        check_int("drafter config block_size", block, 2, MAX_BLOCK_SIZE)
        if block > LARGE_BLOCK_SIZE:
            warn(f"drafter block_size {block} is large: each draft forward pays for {block - 1} positions")
    layers = dc.get("target_layer_ids", d.get("target_layer_ids"))
    if layers is not None:
        if not isinstance(layers, list):
            raise InputError(f"drafter config target_layer_ids must be a list of layer indices, got {layers!r}")
        for i in layers:
            check_int("drafter config target_layer_ids entry", i, minimum=0)
        if len(set(layers)) != len(layers):
            raise InputError(f"drafter config target_layer_ids has duplicates: {layers}")


# ---- output and cache paths ----------------------------------------------------------------------

MIN_FREE_BYTES = 1 << 20  # less than this free and even a results table may not fit


def _nearest_existing(path: Path) -> Path:
    p = path
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def check_writable(path, what: str, kind: str = "dir", need_bytes: int = MIN_FREE_BYTES, hint: str | None = None) -> Path:
    """That `path` can be written (as a directory, or as a file when kind="file") before any work is done for
    it: no part of it is a file where a directory must be, a file is not a directory, the nearest existing
    folder accepts a new file (tried for real: permission bits say nothing to root or on a read-only
    mount) and its disk has `need_bytes` free. Creates nothing (the trial file is removed at once)."""
    import tempfile

    path = Path(path).expanduser()
    fix = hint or f"choose another {what}"
    base = _nearest_existing(path.absolute())
    if base == path.absolute():
        if kind == "file" and base.is_dir():
            raise InputError(f"{what} {path} is a directory, not a file: give a file path" + (f" or {hint}" if hint else ""))
        if kind == "dir" and not base.is_dir():
            raise InputError(f"{what} {path} is a file, not a directory: {fix}")
        folder = base if kind == "dir" else base.parent
    else:
        if not base.is_dir():
            raise InputError(f"{what} {path}: {base} is a file, not a directory: {fix}")
        folder = base
    try:
        fd, probe = tempfile.mkstemp(prefix=".drafttree-write-check-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise InputError(f"{what} {path} is not writable: cannot create files in {folder} ({e.strerror}): {fix}") from None
    import shutil

    free = shutil.disk_usage(folder).free
    if free < need_bytes:
        raise InputError(f"{what} {path}: the disk holding {folder} is full ({free / 1e6:.1f} MB free, "
                         f"{need_bytes / 1e6:.0f} MB needed): free some space or {fix}")
    return path


CONVERTED_MODEL_BYTES = 600_000_000  # the embedded model converted to fp32 safetensors (517 MB) and its tokenizer
CACHE_HINT = "set DRAFTTREE_CACHE to a writable directory with room"


def check_model_cache(model) -> None:
    """An embedded model not converted yet needs a writable cache with room for the conversion (checked
    before, not after, the ~25 s it takes; a converted model is only read, so a read-only cache is fine)."""
    from .gguf_convert import EMBEDDED, cache_root

    if model in EMBEDDED and not (cache_root() / model / "model.safetensors").exists():
        check_writable(cache_root(), "the model cache", need_bytes=CONVERTED_MODEL_BYTES,
                       hint=f"{CACHE_HINT} ({model} is converted there on first use, about 600 MB)")


def check_safetensors(path, what: str, fix: str) -> None:
    """A safetensors file whose header reads and whose data the file covers (a truncated copy fails here, in
    a millisecond, instead of as a Rust error mid-load); reads no tensor."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except SafetensorError as e:
        raise InputError(f"{path}: {what} is unreadable, perhaps truncated ({e}): {fix}") from None
