"""The C++ CPU kernels (ops/int8, ops/q4, ops/attention, ops/pointwise, ops/decoder, ops/gdn) as one torch extension, compiled once per machine
(`make setup` runs `python -m drafttree.ops.cpu_extension`) and cached beside the converted models."""
from __future__ import annotations

import functools
import hashlib
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
SOURCES = [HERE / "bindings.cpp", HERE / "int8" / "int8_linear.cpp", HERE / "attention" / "tree_attention.cpp",
           HERE / "pointwise" / "pointwise.cpp", HERE / "q4" / "q4_linear.cpp", HERE / "decoder" / "decoder_stack.cpp",
           HERE / "gdn" / "gdn_tree.cpp", HERE / "gdn" / "gdn_step.cpp"]
HEADERS = [HERE / "vec_math.h", HERE / "kernels.h"]
ISA_CODES = {"scalar": 0, "avx2": 1, "avx512_vnni": 2}  # the attention kernel reads 2 as plain AVX-512


@functools.cache
def build_name() -> str:
    """This build of the kernels: torch's version and the sources' hash (read once per process; the cost-model
    cache's file names carry it too)."""
    digest = hashlib.sha256(torch.__version__.encode())
    for src in SOURCES + HEADERS:
        digest.update(src.read_bytes())
    return f"cpu-{digest.hexdigest()[:12]}"


def build_dir() -> Path:
    from drafttree.gguf_convert import cache_root

    return cache_root() / "ext" / build_name()


@functools.cache
def extension():
    """The compiled module (compiled on first use, about a minute on 2 cores; then loaded from the cache)."""
    out = build_dir()
    stale_lock = out / "lock"  # torch's build lock; a build killed midway leaves it, and every later load waits on it forever
    if stale_lock.exists() and time.time() - stale_lock.stat().st_mtime > 1800:  # no build here takes half an hour
        print(f"drafttree: removing a stale build lock {stale_lock} (a build killed midway left it)", file=sys.stderr)
        stale_lock.unlink(missing_ok=True)
    if not any(out.glob("*.so")):
        print(f"drafttree: compiling the CPU kernels into {out} (once per machine, about a minute)", file=sys.stderr)
    return compile_kernels("drafttree_cpu", staged_sources(out), out)


def staged_sources(out: Path) -> list[Path]:
    """The sources copied into the build directory (same relative layout), compiled from there: torch rebuilds
    when its build file names other source paths, so two checkouts with the same sources (the build name is
    their hash) would otherwise recompile the shared cache for each other in turn."""
    from drafttree.atomic import atomic_path

    staged = []
    for src in SOURCES + HEADERS:
        dst = out / "src" / src.relative_to(HERE)
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(dst) as tmp:
                tmp.write_bytes(src.read_bytes())
        staged.append(dst)
    return staged[:len(SOURCES)]


def compile_kernels(name: str, sources, out: Path):
    """Compile (or load from `out`) the kernel sources as the module `name` (a second name lets a benchmark
    load another revision's kernels beside these: bench/kernel_ab.py)."""
    from torch.utils.cpp_extension import load

    out.mkdir(parents=True, exist_ok=True)
    # torch runs `ninja` from PATH; the pip-installed one sits beside this interpreter (venv not activated).
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    # -ffp-contract=off: no implicit fused multiply-adds, so the int8 epilogue rounds as the reference does.
    return load(name=name, sources=[str(s) for s in sources], build_directory=str(out), verbose=False,
                extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp", "-Wno-psabi"], extra_ldflags=["-fopenmp"])


def kernel_error() -> str | None:
    """Why the kernels cannot be used here (None when they build and load)."""
    try:
        extension()
    except Exception as e:  # no compiler or headers: callers fall back to another path
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: {lines[-1] if lines else ''}"
    return None


if __name__ == "__main__":
    err = kernel_error()
    print(f"drafttree CPU kernels: {'ready in ' + str(build_dir()) if err is None else 'unavailable (' + err + ')'}")
