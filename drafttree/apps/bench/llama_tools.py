"""llama.cpp's own command-line tools (`llama-speculative-simple`: its `--spec-type` speculative decoders, `ngram-mod`
among them), built once from the llama.cpp tree vendored in the pinned llama-cpp-python sdist and cached like the
kernels: the peers `drafttree bench-peers` runs beside drafttree that llama-cpp-python's Python API does not expose.

The sdist comes from the package registry (`pip download`); cmake and a C++ compiler build the one target (about
ten minutes on two cores, once per machine)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ...gguf_convert import cache_root

LLAMA_CPP_PYTHON = "0.3.36"  # the pinned peer (pyproject's `peers` extra)
TOOL = "llama-speculative-simple"


def tool_dir() -> Path:
    return cache_root() / f"llama.cpp-{LLAMA_CPP_PYTHON}"


def tool_path(name: str = TOOL) -> Path:
    return tool_dir() / _build_name() / "bin" / name


def _build_name() -> str:
    return "build-no-amx" if ggml_cpu_flags() != NATIVE else "build"


NATIVE = ["-DGGML_NATIVE=ON"]
# This CPU's extensions less AMX: on an Emerald Rapids (GCC 12) ggml's AMX matmul, which -march=native switches on,
# dies with SIGILL (`tilezero`) as soon as a batch of ~16 rows reaches it — a prompt, a verify — in llama-cpp-python
# and in llama-speculative-simple alike. AVX-512 VNNI / BF16 stay on. Also the CMAKE_ARGS for llama-cpp-python:
# `CMAKE_ARGS="$(python -m drafttree.apps.bench.llama_tools)" pip install --force-reinstall llama-cpp-python==...`.
NO_AMX = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
          "-DGGML_AVX_VNNI=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON",
          "-DGGML_AVX512_BF16=ON"]


def ggml_cpu_flags() -> list[str]:
    """ggml's CPU build flags for this machine: native, except on AMX CPUs (NO_AMX)."""
    from ...compute import cpu_info

    return NO_AMX if cpu_info().has("amx_int8") else NATIVE


def _fetch_source(tmp: str, out) -> Path:
    """The pinned sdist from the package registry, unpacked into `tmp`: its vendored llama.cpp tree."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", tmp,
                    f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True, stdout=out, stderr=subprocess.STDOUT)
    sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp, filter="data")
    return next(Path(tmp).glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"


def _keep_converter(source: Path) -> Path:
    """llama.cpp's `convert_hf_to_gguf.py` with what it imports (`conversion/`, `gguf-py/`), kept in the cache."""
    keep = tool_dir() / "convert"
    partial = tool_dir() / "convert.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    shutil.copy2(source / "convert_hf_to_gguf.py", partial)
    for folder in ("conversion", "gguf-py"):
        shutil.copytree(source / folder, partial / folder)
    shutil.rmtree(keep, ignore_errors=True)
    partial.rename(keep)  # complete or absent
    return keep


def converter_script() -> Path:
    """The pinned sdist's `convert_hf_to_gguf.py`, fetched once (a build keeps it too)."""
    script = tool_dir() / "convert" / "convert_hf_to_gguf.py"
    if not script.exists():
        tool_dir().mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=tool_dir()) as tmp, open(tool_dir() / "convert.log", "w") as out:
            _keep_converter(_fetch_source(tmp, out))
    return script


def build_tool(name: str = TOOL, jobs: int = 2) -> Path:
    """The tool's binary (`llama-speculative-simple`, `llama-server`, ...), built now unless it is cached.

    The vendored source is kept in the cache and all tools build in one tree beside it (ggml once); a tool is taken
    as built only when its binary exists, which the linker writes last, so a failed build leaves the tools already
    built and its log, nothing that passes for a tool."""
    binary = tool_path(name)
    if binary.exists():
        return binary
    for program in ("cmake", "c++"):
        if shutil.which(program) is None:
            raise RuntimeError(f"building llama.cpp's {name} needs {program} on PATH (Debian: apt install cmake g++)")
    root = tool_dir()
    root.mkdir(parents=True, exist_ok=True)
    log = root / f"build-{name}.log"
    print(f"drafttree: building llama.cpp's {name} from llama-cpp-python {LLAMA_CPP_PYTHON}'s sdist into {root} "
          f"(once, about ten minutes; log: {log})", file=sys.stderr)
    build = root / _build_name()
    with open(log, "w") as out:
        source = _kept_source(root, out)
        if _configured_source(build) != source:  # a tree from an older layout, configured from a deleted source
            shutil.rmtree(build, ignore_errors=True)
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", *ggml_cpu_flags(),
                        "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
                        "-DBUILD_SHARED_LIBS=OFF"], check=True, stdout=out, stderr=subprocess.STDOUT)
        subprocess.run(["cmake", "--build", str(build), "--target", name, f"-j{jobs}"], check=True, stdout=out,
                       stderr=subprocess.STDOUT)
    if not binary.exists():
        raise RuntimeError(f"llama.cpp's build finished without {binary}; see {log}")
    return binary


def _kept_source(root: Path, out) -> Path:
    """The sdist's llama.cpp tree, unpacked once into the cache (complete or absent); the converter kept beside it."""
    source = root / "source"
    if not source.is_dir():
        partial = root / "source.partial"
        shutil.rmtree(partial, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            unpacked = _fetch_source(tmp, out)
            _keep_converter(unpacked)
            shutil.copytree(unpacked, partial)
        partial.rename(source)
    return source


def _configured_source(build: Path) -> Path | None:
    cache = build / "CMakeCache.txt"
    if not cache.exists():
        return None
    for line in cache.read_text(errors="replace").splitlines():
        if line.startswith("CMAKE_HOME_DIRECTORY:"):
            return Path(line.split("=", 1)[1])
    return None


@dataclass(frozen=True)
class SpeculativeRun:
    tokens: int  # decoded tokens
    seconds: float  # the decode loop's own clock (the prompt's forward and model loading excluded)
    forwards: int  # target forwards in that loop (one per verified draft, or per token without one)


_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_PREDICTED = re.compile(r"\bn_predict\s*=\s*(\d+)")
_ACCEPTED = re.compile(r"\bn_accept\s*=\s*(\d+)")
_TARGET_RUNS = re.compile(r"target:.*?\beval time =\s*[\d.]+ ms /\s*(\d+) runs", re.S)


def parse_speculative_log(text: str) -> SpeculativeRun:
    """The figures `llama-speculative-simple` prints at its end (its log). Each forward after the prompt's
    emits its accepted draft tokens and one more, so forwards = n_predict - 1 - n_accept; the target's
    "eval ... runs" counts only its one-token forwards (a verified draft is a batch, timed as prompt eval), so it
    is used only where the log has no acceptance line."""
    decoded, predicted, accepted = _DECODED.search(text), _PREDICTED.search(text), _ACCEPTED.search(text)
    runs = _TARGET_RUNS.search(text)
    if decoded is None or (runs is None and (predicted is None or accepted is None)):
        tail = "\n".join(text.strip().splitlines()[-15:])
        raise ValueError(f"llama-speculative-simple printed no decode summary; its last lines:\n{tail}")
    if predicted is not None and accepted is not None:
        forwards = int(predicted.group(1)) - 1 - int(accepted.group(1))
    else:
        forwards = int(runs.group(1))
    return SpeculativeRun(int(decoded.group(1)), float(decoded.group(2)), forwards)


def run_speculative(binary: Path, gguf: Path, prompt: str, max_new: int, threads: int, spec_args: list[str]
                    ) -> SpeculativeRun:
    """One greedy generation of `prompt` (text, special tokens spelled out) with llama.cpp's speculative loop."""
    # its loop stops once it has decoded more than -n tokens: -n max_new - 1 decodes max_new
    cmd = [str(binary), "-m", str(gguf), "-p", prompt, "-n", str(max(0, max_new - 1)), "--temp", "0", "--top-k", "1",
           "-t", str(threads), "-tb", str(threads), "-c", "4096", "--seed", "0", *spec_args]
    done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"{binary.name} exited with {done.returncode}: {done.stderr.strip()[-2000:]}")
    return parse_speculative_log(done.stdout + done.stderr)


if __name__ == "__main__":
    print(" ".join(ggml_cpu_flags()))  # CMAKE_ARGS for building llama-cpp-python the way the tool is built
