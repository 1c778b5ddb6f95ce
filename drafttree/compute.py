"""The compute path of the linear layers, chosen from what this CPU can do.

Paths: `fp32` (the reference), `bf16` (only where the CPU has native bf16: AVX512_BF16 or AMX),
`int8` (int8 weights and per-row int8 activations, integer dot products: drafttree.ops.int8), `q4`
(4-bit Q4_1 weights, the GGUF's own blocks for a GGUF model, int8 activations: drafttree.ops.q4; the
LM head stays int8). The choice is explained in words (`drafttree info`) and can be overridden (`--compute`).
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import cache

import torch

PATHS = ("fp32", "bf16", "int8", "q4")
ACTIVATION_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32, "q4": torch.float32}
LEGACY_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "fp32": "fp32", "bf16": "bf16"}


@dataclass(frozen=True)
class CpuInfo:
    model: str
    arch: str
    flags: frozenset[str]
    restricted_to_avx2: bool  # ATEN_CPU_CAPABILITY=avx2 / ONEDNN_MAX_CPU_ISA=AVX2 / DRAFTTREE_ISA=avx2

    def has(self, flag: str) -> bool:
        if self.restricted_to_avx2 and (flag.startswith("avx512") or flag.startswith("amx")):
            return False
        return flag in self.flags

    @property
    def native_bf16(self) -> bool:
        return self.has("avx512_bf16") or self.has("amx_bf16")

    @property
    def int8_isa(self) -> str:
        """The int8 kernel's code path: AVX-512 VNNI, AVX2, or plain C++ elsewhere (e.g. aarch64)."""
        if self.has("avx512_vnni") and self.has("avx512bw"):
            return "avx512_vnni"
        return "avx2" if self.has("avx2") else "scalar"

    @property
    def isa_summary(self) -> str:
        shown = [f for f in ("avx2", "fma", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
                 if self.has(f)]
        note = " (restricted to AVX2 by the environment)" if self.restricted_to_avx2 else ""
        return (" ".join(shown) or self.arch) + note


def _restricted() -> bool:
    env = {k: os.environ.get(k, "").lower() for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DRAFTTREE_ISA")}
    return env["ATEN_CPU_CAPABILITY"] in ("avx2", "default") or env["ONEDNN_MAX_CPU_ISA"].startswith("avx2") \
        or env["DRAFTTREE_ISA"] == "avx2"


@cache
def cpu_info() -> CpuInfo:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return CpuInfo(model=model, arch=platform.machine(), flags=frozenset(flags), restricted_to_avx2=_restricted())


@dataclass(frozen=True)
class ComputeChoice:
    path: str  # one of PATHS
    isa: str | None  # the int8 kernel's code path, for `int8`
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return ACTIVATION_DTYPE[self.path]


def choose_compute(requested: str = "auto", cpu: CpuInfo | None = None) -> ComputeChoice:
    """The path to use: `requested` if it is not "auto" (checked to work here), else the fastest here."""
    from drafttree.ops.cpu_extension import kernel_error

    cpu = cpu or cpu_info()
    requested = LEGACY_DTYPES.get(requested, requested)
    if requested not in (*PATHS, "auto"):
        raise ValueError(f"unknown compute path {requested!r}: choose auto or one of {', '.join(PATHS)}")
    if requested == "fp32":
        return ComputeChoice("fp32", None, "requested: fp32, the reference path (4 bytes a weight)")
    if requested == "bf16":
        why = "native bf16 (AVX512_BF16/AMX)" if cpu.native_bf16 else "no native bf16 here: batched bf16 matmuls are slow"
        return ComputeChoice("bf16", None, f"requested: bf16 ({why})")
    err = kernel_error()
    if requested in ("int8", "q4"):
        if err is not None:
            raise RuntimeError(f"the {requested} kernels are unavailable here ({err}); use --compute fp32 or bf16")
        return ComputeChoice(requested, cpu.int8_isa, f"requested: {requested} ({cpu.int8_isa} kernels)")
    if err is None and cpu.int8_isa != "scalar":
        return ComputeChoice("q4", cpu.int8_isa, (
            f"auto: 4-bit Q4_1 weights with {cpu.int8_isa.replace('_', ' ').upper()} integer dot products stream "
            "0.6 bytes a weight (int8 1, bf16 2, fp32 4): the fastest decoding step measured on AVX2 and AVX-512 CPUs"))
    if cpu.native_bf16:
        return ComputeChoice("bf16", None, f"auto: native bf16 on this CPU; int8 kernel unavailable ({err or 'no SIMD'})")
    return ComputeChoice("fp32", None, f"auto: no fast int8 kernel ({err or 'no AVX2'}) and no native bf16")


def add_compute_argument(parser, default: str = "auto") -> None:
    """`--compute` for every command that loads a target (`--dtype float32|bfloat16`: the older spelling)."""
    parser.add_argument("--compute", default=default, choices=["auto", *PATHS],
                        help=f"compute path of the linear layers (default {default}: "
                             "the fastest on this CPU, see `drafttree info`)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="same as --compute fp32 / bf16")


def compute_of(args) -> str:
    """The compute path asked for on the command line (a --dtype wins: it is the more specific spelling)."""
    return LEGACY_DTYPES[args.dtype] if getattr(args, "dtype", None) else args.compute
