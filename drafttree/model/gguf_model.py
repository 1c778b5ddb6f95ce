"""A GGUF file of the llama, qwen2, qwen3 or gemma3 family straight into the dense runtime (`--model file.gguf`).

Config, tokenizer and chat template come from the file's metadata. The tensors are read through
GGUFReader's memory map and converted a few rows at a time into the types drafttree has kernels for,
so no weight matrix is ever held in fp32 in full (on the int8/q4 paths):

- On the q4 path, Q4_1 runs as stored; Q4_0 and Q4_K carry their 4-bit values over nibble for nibble into Q4_1
  blocks of 32 (Q4_0 exactly, Q4_K up to the fp16 rounding of each block's scale and offset). Q8_0, Q5_0 and Q5_1
  run as stored in 8-bit blocks of 32 (w = d·q + m, the same kernel: Q8_0's q + 128, Q5_0's q + 16); Q5_K, Q6_K,
  F16, BF16 and F32 are requantized into 8-bit blocks of 32 (ops.q4.quantize_q8_1). A fused matrix (q/k/v,
  gate/up) whose parts are not all 4-bit goes 8-bit as a whole, its 4-bit parts carried over exactly; as in
  llama.cpp, the activations are quantized per block of 32.
- On the int8 path every weight becomes int8 rows with a per-row scale (activations per row); the embedding and
  the LM head are int8 rows on both kernel paths.
- On the fp32 / bf16 paths every tensor is dequantized to that dtype (what those paths mean).

Every conversion is measured against gguf.quants.dequantize of the file's own tensor and reported as a
relative RMS error per tensor kind. Native K-quant kernels (running Q4_K/Q5_K/Q6_K as stored) are a later
slice of issue 37; until then K-quants are converted here, once, at load.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from drafttree.gguf_convert import unpermute_rope_rows
from drafttree.ops.int8.naive import quantize_rows
from drafttree.ops.q4.naive import dequantize_q4_1, quantize_q8_1, unpack_gguf_q4_1

from .config import ModelConfig
from .linear import Int8Linear, Int8TiedEmbedding, Q4Linear, Q8Linear, use_cpu_kernels
from .transformer import Transformer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
Q4_1_SOURCES = ("Q4_0", "Q4_1", "Q4_K")  # 4-bit values with a scale and an offset per 32 weights: Q4_1's shape
# more than 4 bits: 8-bit blocks on the q4 path (Q8_EXACT as stored), int8 rows on the int8 path
INT8_SOURCES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "F16", "BF16", "F32")
READABLE_TYPES = Q4_1_SOURCES + INT8_SOURCES
# 8-bit blocks carry these over exactly: (block bytes, offset added to the stored value); Q5_1 stores its own offset
Q8_EXACT = {"Q8_0": (34, 128), "Q5_0": (22, 16), "Q5_1": (24, None)}
CHUNK_WEIGHTS = 1 << 20  # weights converted at a time: 4 MB of fp32 (and its temporaries), whatever the model's size
REQUANTIZE_HINT = ("re-quantize it to one of these with llama.cpp (`llama-quantize in.gguf out.gguf Q4_K_M`), or "
                   "load the Hugging Face checkpoint directory instead")

# runtime linear (in layer i) <- the GGUF tensors (blk.i.*) concatenated along the output rows, as the runtime fuses them
FUSED_LINEARS = {"attn.qkv": ("attn_q", "attn_k", "attn_v"), "attn.o": ("attn_output",),
                 "mlp.gate_up": ("ffn_gate", "ffn_up"), "mlp.down": ("ffn_down",)}
LAYER_FLOATS = {"attn_norm.weight": "input_norm.weight", "ffn_norm.weight": "post_norm.weight",
                "attn_q_norm.weight": "attn.q_norm.weight", "attn_k_norm.weight": "attn.k_norm.weight",
                # gemma3's norms on the attention's and the MLP's outputs
                "post_attention_norm.weight": "attn_out_norm.weight", "post_ffw_norm.weight": "mlp_out_norm.weight"}
# gemma3 as llama.cpp (0.3.36) runs it; the file does not say: every 6th layer global, the others sliding-window
# with their own RoPE base (llama_hparams.set_swa_pattern(6), rope_freq_base_train_swa = 10000)
GEMMA3_SWA_PATTERN = 6
GEMMA3_ROPE_BASE_LOCAL = 10000.0


class GGUFError(ValueError):
    """A GGUF file drafttree cannot run, with what is wrong and what to do."""


# ---- metadata ------------------------------------------------------------------------------------------------

def open_gguf(path: str | Path):
    """GGUFReader over `path` (a memory map: nothing is read until used)."""
    path = Path(path)
    check_gguf_magic(path)
    try:
        return _reader_class()(str(path))
    except (ValueError, IndexError, OSError) as e:  # a truncated file fails while the tensor table is read
        raise GGUFError(f"cannot read {path} as GGUF ({e}): is the file complete? copy or download it again") from e


def _reader_class():
    """gguf.GGUFReader over a plain-ndarray view of its memory map. The reader slices its map once per metadata
    value; on a np.memmap each slice runs memmap's Python __array_finalize__, which made reading Gemma 3's 262 k
    vocabulary strings take ~20 s of a 25 s load. The same bytes, the same mapping (the view keeps it alive)."""
    import gguf
    import numpy as np

    class PlainViewReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, mapped):
            self._map = getattr(mapped, "_mmap", None)  # np.memmap's mmap.mmap: for drop_pages
            self._data = mapped.view(np.ndarray) if isinstance(mapped, np.memmap) else mapped

        def drop_pages(self, offset: int, n_bytes: int) -> None:
            """The file's bytes [offset, offset + n_bytes) leave the process's resident set (they stay in the page
            cache; a later read maps them again)."""
            import mmap

            if self._map is not None and hasattr(self._map, "madvise"):
                start = offset // mmap.PAGESIZE * mmap.PAGESIZE
                self._map.madvise(mmap.MADV_DONTNEED, start, offset + n_bytes - start)

    return PlainViewReader


def check_gguf_magic(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (it does not start with 'GGUF'): --model takes an embedded "
                            "model name, a Hugging Face checkpoint directory or a .gguf file")


def _value(reader, key: str, path: Path, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is not None:
            return default
        raise GGUFError(f"{path.name}: the GGUF metadata lacks {key!r}, which drafttree needs to build the model; the "
                        "file is incomplete or was written by an old converter: convert the model again with "
                        "llama.cpp's convert_hf_to_gguf.py")
    return f.contents()


def _scalar(reader, key: str, path: Path, kind=int, default=None):
    v = _value(reader, key, path, default)
    if isinstance(v, list):  # e.g. a per-layer head count: a layout the runtime does not have
        raise GGUFError(f"{path.name}: {key} is per layer ({v[:4]}...); drafttree runs models whose layers all have "
                        "the same shape")
    return kind(v)


def architecture(reader, path: Path) -> str:
    arch = str(_value(reader, "general.architecture", path))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path.name}: GGUF architecture {arch!r} is not supported: drafttree runs "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)} GGUF files; use a GGUF of one of these families or a "
                        "Hugging Face checkpoint directory of a supported family")
    return arch


def read_config(reader, path: Path) -> ModelConfig:
    """The runtime's config from the GGUF metadata (keys as llama.cpp's converter writes them)."""
    arch = architecture(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path.name}: no token_embd.weight tensor; the file is incomplete: copy or convert it again")
    scaling = str(_value(reader, f"{arch}.rope.scaling.type", path, default="none"))
    if scaling not in ("none", "") or "rope_freqs.weight" in tensors:
        raise GGUFError(f"{path.name}: RoPE scaling ({scaling if scaling != 'none' else 'rope_freqs.weight'}) is not "
                        "supported: drafttree runs plain RoPE only (no llama 3.1+ / YaRN scaling yet)")
    hidden = _scalar(reader, f"{arch}.embedding_length", path)
    heads = _scalar(reader, f"{arch}.attention.head_count", path)
    head_dim = _scalar(reader, f"{arch}.attention.key_length", path, default=hidden // heads)
    rotary = _scalar(reader, f"{arch}.rope.dimension_count", path, default=head_dim)
    if rotary != head_dim:
        raise GGUFError(f"{path.name}: RoPE over {rotary} of {head_dim} head dimensions (partial rotary) is not supported")
    qkv_bias = "blk.0.attn_q.bias" in tensors
    layers = _scalar(reader, f"{arch}.block_count", path)
    gemma = _gemma3_fields(reader, path, layers, hidden, heads, head_dim) if arch == "gemma3" else {}
    return ModelConfig(
        model_type=arch,
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # ne = [hidden, vocab]: the rows are the vocabulary
        hidden_size=hidden,
        intermediate_size=_scalar(reader, f"{arch}.feed_forward_length", path),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_scalar(reader, f"{arch}.attention.head_count_kv", path, default=heads),
        head_dim=head_dim,
        rms_norm_eps=_scalar(reader, f"{arch}.attention.layer_norm_rms_epsilon", path, float),
        rope_theta=_scalar(reader, f"{arch}.rope.freq_base", path, float, default=10000.0),  # llama.cpp's default
        max_position_embeddings=_scalar(reader, f"{arch}.context_length", path),
        tie_word_embeddings="output.weight" not in tensors,
        # qwen2: q/k/v have biases, the output projection has none (given zeros: the runtime's o has a bias
        # exactly when q/k/v have one)
        attention_bias=qkv_bias,
        qk_norm=arch in ("qwen3", "gemma3"),
        **gemma,
    )


def _gemma3_fields(reader, path: Path, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    """What gemma3 adds to the llama shape, as llama.cpp reads it. The norms need nothing: llama.cpp's converter
    stores Gemma's (1 + w) RMSNorm weights with the 1 already added."""
    softcap = _scalar(reader, "gemma3.final_logit_softcapping", path, float, default=0.0)
    if softcap:
        raise GGUFError(f"{path.name}: final logit softcapping ({softcap}) is not supported (Gemma 3 has none; "
                        "this file's model is another variant): use a gemma3 GGUF without it")
    window = _scalar(reader, "gemma3.attention.sliding_window", path, default=0)
    return dict(
        sliding_window=window,
        # without a window llama.cpp runs every layer global (LLAMA_SWA_TYPE_NONE)
        sliding_layers=tuple(i % GEMMA3_SWA_PATTERN < GEMMA3_SWA_PATTERN - 1 for i in range(layers)) if window else (),
        rope_theta_local=GEMMA3_ROPE_BASE_LOCAL,
        # llama.cpp: (hidden / heads) ** -0.5 for the 27 B model (62 layers, query_pre_attn_scalar = 168), else
        # head_dim ** -0.5
        attention_scale=(hidden / heads) ** -0.5 if layers == 62 else head_dim**-0.5,
        embed_scale=hidden**0.5,
        mlp_activation="gelu_tanh",
        sandwich_norms=True,
    )


# ---- conversion, a few rows at a time ----------------------------------------------------------------------

@dataclass
class ConversionReport:
    """Relative RMS error of every converted tensor against gguf.quants.dequantize of the file's own bytes,
    summed per (tensor kind, file type, runtime type)."""

    rows: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)  # -> [Σ err², Σ ref², tensors]

    def add(self, kind: str, file_type: str, runtime_type: str, err_sq: float, ref_sq: float, tensors: int = 0) -> None:
        r = self.rows.setdefault((kind, file_type, runtime_type), [0.0, 0.0, 0])
        r[0] += err_sq
        r[1] += ref_sq
        r[2] += tensors

    def relative_rms(self, kind: str) -> float:
        """Over every tensor of this kind (whatever its types)."""
        err = sum(r[0] for k, r in self.rows.items() if k[0] == kind)
        ref = sum(r[1] for k, r in self.rows.items() if k[0] == kind)
        return (err / ref) ** 0.5 if ref > 0 else 0.0

    def lines(self) -> list[str]:
        out = []
        for (kind, src, dst), (err, ref, n) in sorted(self.rows.items()):
            how = "as stored" if src == dst else f"-> {dst}"
            rel = (err / ref) ** 0.5 if ref > 0 else 0.0
            out.append(f"  {kind:<12} {n:>3} x {src:<5} {how:<12} relative RMS error {rel:.2e}")
        return out


def _chunks(n_rows: int, n_cols: int):
    step = max(1, CHUNK_WEIGHTS // max(1, n_cols))
    for a in range(0, n_rows, step):
        yield a, min(n_rows, a + step)


def release_freed_memory() -> None:
    """Give freed heap memory back to the system once a file is converted (glibc keeps it otherwise: after Gemma 3
    270M's load the process held ~625 MB of conversion temporaries and metadata it no longer used). A no-op where
    there is no glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _dequantized(raw: np.ndarray, qtype) -> torch.Tensor:
    from gguf.quants import dequantize

    w = np.asarray(dequantize(raw, qtype), dtype=np.float32)
    if not (w.flags.writeable and w.flags.c_contiguous):  # F32 comes back as a view of the read-only map
        w = np.array(w, dtype=np.float32, order="C")
    return torch.from_numpy(w)


def _sq(x: torch.Tensor) -> float:
    """Σ x² (fp32 norm, summed in float64 across chunks): for the relative RMS errors."""
    return float(torch.linalg.vector_norm(x.float())) ** 2


def _q8_exact(raw: np.ndarray, w: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of Q8_0 / Q5_0 / Q5_1 bytes and their dequantized values -> 8-bit blocks with the file's own d (of
    either sign) and m: w = d·(q - offset) is d·q' + m with q' = q + offset, m = -offset·d (exact in fp16); Q5_1
    stores its m."""
    block_bytes, offset = Q8_EXACT[type_name]
    blocks = raw.reshape(raw.shape[0], -1, block_bytes)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
    if offset is None:
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
    else:
        m = (-offset * d.float()).half()
        if not torch.isfinite(m).all():
            raise GGUFError(f"a {type_name} block scale times {offset} exceeds the fp16 range of 8-bit blocks")
    step, low = d.float().repeat_interleave(32, 1), m.float().repeat_interleave(32, 1)
    q = torch.where(step != 0, (w - low) / step, torch.zeros_like(w))  # d may be negative (Q5_0's often is)
    return q.round().clamp(0, 255).to(torch.uint8), d, m


def _q4_1_from(raw: np.ndarray, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of Q4_0 / Q4_1 / Q4_K bytes -> (q uint8 [n, K], d fp16 [n, K/32], m fp16 [n, K/32]) with w = d·q + m."""
    from gguf.quants import Q4_K

    raw = np.asarray(raw, dtype=np.uint8)
    n = raw.shape[0]
    if type_name == "Q4_1":
        return unpack_gguf_q4_1(raw)
    if type_name == "Q4_0":  # 18-byte blocks: fp16 d, 16 bytes of nibbles; w = d·(q - 8), so m = -8·d (exact in fp16)
        blocks = raw.reshape(n, -1, 18)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        qs = blocks[..., 2:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, -1)
        return torch.from_numpy(q), torch.from_numpy(d.copy()), torch.from_numpy((d * np.float16(-8)).astype(np.float16))
    # Q4_K: 144-byte super-blocks of 256 = 8 sub-blocks of 32; fp16 d and dmin, 12 bytes of 6-bit scales and mins,
    # 128 bytes of nibbles (32 bytes per pair of sub-blocks: the low nibbles one, the high nibbles the next);
    # w = d·sc·q - dmin·mn
    blocks = raw.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
    q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(n, -1)
    with np.errstate(over="ignore"):
        block_d = (d * sc).astype(np.float16).reshape(n, -1)
        block_m = (-(dmin * mn)).astype(np.float16).reshape(n, -1)
    if not (np.isfinite(block_d).all() and np.isfinite(block_m).all()):
        raise GGUFError("a Q4_K block scale exceeds the fp16 range of Q4_1")
    return torch.from_numpy(q), torch.from_numpy(block_d), torch.from_numpy(block_m)


@dataclass
class FileTensor:
    """A GGUF tensor as rows of its raw bytes (a view of the memory map), its rows reordered where llama.cpp
    permuted them (llama's q/k: interleaved-RoPE pairs -> rotate-half halves)."""

    name: str
    type_name: str
    qtype: object
    raw: np.ndarray  # [rows, bytes per row] (F32/F16: [rows, cols] of that dtype)
    n_rows: int
    n_cols: int
    row_order: np.ndarray | None = None

    def rows(self, a: int, b: int) -> np.ndarray:
        if self.row_order is None:
            return self.raw[a:b]
        return self.raw[self.row_order[a:b]]


class GGUFModelReader:
    """Turns the tensors of one GGUF file into runtime modules for one compute path, recording the error."""

    def __init__(self, reader, path: Path, cfg: ModelConfig, compute: str, isa: str | None):
        self.reader, self.path, self.cfg, self.compute, self.isa = reader, path, cfg, compute, isa
        self.tensors = {t.name: t for t in reader.tensors}
        self.used: set[str] = set()
        self.report = ConversionReport()
        self.float_dtype = torch.bfloat16 if compute == "bf16" else torch.float32

    def has(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> FileTensor:
        t = self.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.path.name}: the file lacks the tensor {name!r} that a {self.cfg.model_type} model with "
                            f"{self.cfg.num_layers} layers needs; the file is incomplete: copy or convert it again")
        self.used.add(name)
        type_name = t.tensor_type.name
        if type_name not in READABLE_TYPES:
            raise GGUFError(f"{self.path.name}: tensor {name} is {type_name}, a type drafttree cannot read yet (it reads "
                            f"{', '.join(READABLE_TYPES)}): {REQUANTIZE_HINT}")
        n_cols = int(t.shape[0])
        n_rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        raw = np.asarray(t.data).reshape(n_rows, -1)
        ft = FileTensor(name, type_name, t.tensor_type, raw, n_rows, n_cols)
        kind = name.split(".")[-2]
        if self.cfg.model_type == "llama" and kind in ("attn_q", "attn_k"):
            heads = self.cfg.num_heads if kind == "attn_q" else self.cfg.num_kv_heads
            ft.row_order = unpermute_rope_rows(np.arange(n_rows)[:, None], heads)[:, 0]
        return ft

    def chunks(self, t: FileTensor):
        """Row ranges of `t` a few at a time; once they are all read, the tensor's file pages leave the resident set
        (without this, loading holds the whole file mapped on top of what it converts the file into)."""
        yield from _chunks(t.n_rows, t.n_cols)
        drop = getattr(self.reader, "drop_pages", None)  # open_gguf's reader (a plain GGUFReader has none)
        if drop is not None:
            raw = self.tensors[t.name]
            drop(int(raw.data_offset), int(raw.n_bytes))

    @staticmethod
    def kind(name: str) -> str:
        """attn_q, ffn_down, token_embd, ...: what the report groups by."""
        return name.split(".")[-2]

    # -- one tensor into one runtime form

    def floats(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor dequantized (norms, biases; every weight on the float paths), [rows, cols] or [cols]."""
        t = self.tensor(name)
        dtype = dtype or self.float_dtype
        out = torch.empty(t.n_rows, t.n_cols, dtype=dtype)
        err = ref = 0.0
        for a, b in self.chunks(t):
            w = _dequantized(t.rows(a, b), t.qtype)
            out[a:b] = w.to(dtype)
            err += _sq(out[a:b].float().sub_(w)) if dtype != torch.float32 else 0.0
            ref += _sq(w)
        if len(self.tensors[name].shape) > 1:  # weight matrices only: norms and biases are not worth a report line
            self.report.add(self.kind(name), t.type_name, {torch.float32: "F32", torch.bfloat16: "BF16"}[dtype], err, ref, 1)
        return out if len(self.tensors[name].shape) > 1 else out[0]

    def int8_rows(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.tensor(name)
        q = torch.empty(t.n_rows, t.n_cols, dtype=torch.int8)
        scale = torch.empty(t.n_rows)
        err = ref = 0.0
        for a, b in self.chunks(t):
            w = _dequantized(t.rows(a, b), t.qtype)
            q[a:b], scale[a:b] = quantize_rows(w)
            err += _sq(q[a:b].float().mul_(scale[a:b, None]).sub_(w))
            ref += _sq(w)
        self.report.add(self.kind(name), t.type_name, "int8", err, ref, 1)
        return q, scale

    def q4_1_blocks(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = self.tensor(name)
        parts, err, ref = [], 0.0, 0.0
        for a, b in self.chunks(t):
            raw = t.rows(a, b)
            try:
                q, d, m = _q4_1_from(raw, t.type_name)
            except GGUFError as e:
                raise GGUFError(f"{self.path.name}: tensor {name}: {e}") from None
            w = _dequantized(raw, t.qtype)
            err += _sq(dequantize_q4_1(q, d, m).sub_(w))
            ref += _sq(w)
            parts.append((q, d, m))
        self.report.add(self.kind(name), t.type_name, "Q4_1", err, ref, 1)
        return tuple(torch.cat(col) for col in zip(*parts))

    def q8_blocks(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """8-bit blocks of 32 (q uint8 [n, K], d, m fp16 [n, K/32]): Q8_0 / Q5_0 / Q5_1 and the 4-bit types exactly
        (their own d and m, q read back from the dequantized values), the others quantized per block."""
        t = self.tensor(name)
        parts, err, ref = [], 0.0, 0.0
        for a, b in self.chunks(t):
            raw = t.rows(a, b)
            w = _dequantized(raw, t.qtype)
            try:
                if t.type_name in Q4_1_SOURCES:
                    q, d, m = _q4_1_from(raw, t.type_name)
                elif t.type_name in Q8_EXACT:
                    q, d, m = _q8_exact(np.asarray(raw, dtype=np.uint8), w, t.type_name)
                else:
                    q, d, m = quantize_q8_1(w)
            except GGUFError as e:
                raise GGUFError(f"{self.path.name}: tensor {name}: {e}") from None
            err += _sq(dequantize_q4_1(q, d, m).sub_(w))
            ref += _sq(w)
            parts.append((q, d, m))
        self.report.add(self.kind(name), t.type_name, "8-bit blocks", err, ref, 1)
        return tuple(torch.cat(col) for col in zip(*parts))

    # -- runtime modules

    def linear(self, names: list[str], bias_names: list[str] | None) -> nn.Module:
        """One runtime linear from GGUF tensors concatenated along the output rows."""
        bias = torch.cat([self.floats(n, torch.float32) for n in bias_names]) if bias_names else None
        if self.compute in ("fp32", "bf16"):
            w = torch.cat([self.floats(n) for n in names])
            layer = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta", dtype=self.float_dtype)
            layer.weight = nn.Parameter(w, requires_grad=False)
            if bias is not None:
                layer.bias = nn.Parameter(bias.to(self.float_dtype), requires_grad=False)
            return layer
        types = [self.tensors[n].tensor_type.name if n in self.tensors else None for n in names]
        if self.compute == "q4" and all(t in Q4_1_SOURCES for t in types):
            q, d, m = (torch.cat(col) for col in zip(*[self.q4_1_blocks(n) for n in names]))
            return Q4Linear(q, d, m, bias, self.isa)
        if self.compute == "q4":  # a fused matrix with any part of more than 4 bits: 8-bit blocks as a whole
            q, d, m = (torch.cat(col) for col in zip(*[self.q8_blocks(n) for n in names]))
            return Q8Linear(q, d, m, bias, self.isa)
        q, scale = (torch.cat(col) for col in zip(*[self.int8_rows(n) for n in names]))
        return Int8Linear.from_int8(q, scale, bias, self.isa)

    def unused(self) -> list[str]:
        return sorted(set(self.tensors) - self.used)


def build_gguf_model(path: str | Path, compute: str = "fp32", isa: str | None = None, quiet: bool = False,
                     reader=None) -> tuple[Transformer, ConversionReport]:
    """The runtime model of a llama/qwen2/qwen3/gemma3 GGUF file on a compute path ("fp32", "bf16", "int8", "q4"),
    and the measured conversion error (printed to stderr unless `quiet`)."""
    path = Path(path)
    reader = reader if reader is not None else open_gguf(path)
    cfg = read_config(reader, path)
    if compute not in ("fp32", "bf16", "int8", "q4"):
        raise ValueError(f"unknown compute path {compute!r}")
    if compute in ("int8", "q4") and isa is None:
        raise ValueError(f"the {compute} path needs the kernels' isa")
    files = GGUFModelReader(reader, path, cfg, compute, isa)
    with torch.device("meta"):
        model = Transformer(cfg)
    floats: dict[str, torch.Tensor] = {"norm.weight": files.floats("output_norm.weight", torch.float32)}
    for i, layer in enumerate(model.layers):
        for runtime, parts in FUSED_LINEARS.items():
            names = [f"blk.{i}.{p}.weight" for p in parts]
            bias_names = [f"blk.{i}.{p}.bias" for p in parts]
            has_bias = [files.has(n) for n in bias_names]
            if any(has_bias) and not all(has_bias):
                raise GGUFError(f"{path.name}: layer {i} has biases for only some of {', '.join(parts)}")
            bias = bias_names if all(has_bias) else None
            owner, attr = runtime.split(".")
            module = getattr(layer, owner)
            new = files.linear(names, bias)
            if runtime == "attn.o" and cfg.attention_bias and new.bias is None:  # qwen2: see read_config
                zeros = torch.zeros(cfg.hidden_size, dtype=files.float_dtype if compute in ("fp32", "bf16") else torch.float32)
                new.bias = nn.Parameter(zeros, requires_grad=False) if isinstance(new, nn.Linear) else zeros
            setattr(module, attr, new)
        for file_name, runtime in LAYER_FLOATS.items():
            if runtime.startswith("attn.") and not cfg.qk_norm:
                continue  # q/k norms: qwen3 only (a llama file that has them fails as having unused tensors)
            if runtime.endswith("_out_norm.weight") and not cfg.sandwich_norms:
                continue  # gemma3 only
            floats[f"layers.{i}.{runtime}"] = files.floats(f"blk.{i}.{file_name}", torch.float32)
    _set_embedding_and_head(model, files, cfg, compute, isa)
    unused = files.unused()
    if unused:
        raise GGUFError(f"{path.name}: {len(unused)} tensors that a {cfg.model_type} model does not use, e.g. {unused[:3]}: "
                        "the file's architecture metadata does not match its tensors")
    model.load_state_dict({k: v.to(files.float_dtype) for k, v in floats.items()}, strict=False, assign=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise GGUFError(f"{path.name}: no tensor for {left[:3]} in the file")
    model.init_rope()
    model.eval()
    if compute in ("int8", "q4"):
        use_cpu_kernels(model, isa)
    if not quiet:
        print(f"drafttree: {path.name} ({cfg.model_type}, {cfg.num_layers} layers, hidden {cfg.hidden_size}) on the "
              f"{compute} path; each tensor kind against the file's own values (gguf.quants.dequantize); "
              "K-quants are converted at load (native K-quant kernels: a later slice):", file=sys.stderr)
        print("\n".join(files.report.lines()), file=sys.stderr)
    return model, files.report


def _set_embedding_and_head(model: Transformer, files: GGUFModelReader, cfg: ModelConfig, compute: str, isa) -> None:
    if compute in ("fp32", "bf16"):
        model.embed_tokens = nn.Embedding.from_pretrained(files.floats("token_embd.weight"), freeze=True)
        if not cfg.tie_word_embeddings:
            head = files.floats("output.weight")
            model.lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False, device="meta", dtype=head.dtype)
            model.lm_head.weight = nn.Parameter(head, requires_grad=False)
        return
    # Kernel paths: int8 rows for the head (a reduced draft vocabulary slices them) and the embedding; a tied
    # embedding is the head's own rows, an untied one its own int8 rows, looked up the same way. (8-bit blocks for
    # Gemma 3 270M's Q8_0 head: top-1 on llama.cpp's greedy replies 99.4 -> 99.6 %, on human text 94.7 -> 96.9 %, for
    # a head 1.35x slower at one row: not taken; docs/gguf.)
    embedding = Int8Linear.from_int8(*files.int8_rows("token_embd.weight"), None, isa)
    model.embed_tokens = Int8TiedEmbedding(embedding)
    model.lm_head = embedding if cfg.tie_word_embeddings else Int8Linear.from_int8(*files.int8_rows("output.weight"),
                                                                                    None, isa)


# ---- tokenizer ---------------------------------------------------------------------------------------------

def gguf_tokenizer(path: str | Path, reader=None):
    """The tokenizer and chat template from the file's metadata (transformers builds them, about 10 s for a
    50 k vocabulary, so the result is kept in the cache, keyed by the metadata it is built from), or None when
    the file carries no tokenizer (then only token ids can be decoded)."""
    import os
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    from drafttree.gguf_convert import cache_root

    path = Path(path)
    reader = reader if reader is not None else open_gguf(path)
    if "tokenizer.ggml.tokens" not in reader.fields:
        print(f"drafttree: {path.name} has no tokenizer in its metadata: pass token ids, not text", file=sys.stderr)
        return None
    cached = cache_root() / "gguf-tokenizers" / _tokenizer_key(reader)
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise GGUFError(f"{path.name}: cannot build the tokenizer from the GGUF metadata ({e}); the tokenizer.ggml.* "
                        "fields are incomplete: convert the model again with llama.cpp's convert_hf_to_gguf.py") from e
    try:  # into a temporary sibling renamed at the end: a reader never sees half a tokenizer
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cached.name}-", dir=cached.parent))
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError:  # a read-only or full cache only costs the rebuild next time
        shutil.rmtree(locals().get("tmp", cached.parent / ".none"), ignore_errors=True)
    return tokenizer


def _tokenizer_key(reader) -> str:
    """A hash of what transformers builds the tokenizer from (the tokenizer.* fields, the architecture that picks
    its converter, transformers' version): files that share a tokenizer share one cache entry."""
    import hashlib

    import transformers

    h = hashlib.sha256(f"{transformers.__version__}|{reader.fields['general.architecture'].contents()}".encode())
    for name in sorted(k for k in reader.fields if k.startswith("tokenizer.")):
        f = reader.fields[name]
        size = sum(part.nbytes for part in f.parts)  # a field's parts lie one after another in the file
        h.update(name.encode())
        h.update(memoryview(reader.data[f.offset:f.offset + size]))
    return h.hexdigest()[:16]
