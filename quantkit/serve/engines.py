"""Where each serving engine is installed, found without downloading anything.

scripts/setup_engines.sh installs them under $QUANTKIT_ENGINES (default ~/.cache/quantkit/engines):
vllm/ and mlx/ are virtual environments, llama.cpp/ a build. Each engine is looked up in this order:

- vLLM: $QUANTKIT_VLLM (a `vllm` executable), $QUANTKIT_ENGINES/vllm/bin/vllm, `vllm` on PATH.
- llama.cpp: `llama-server` in $QUANTKIT_LLAMA_CPP (a bin directory), $QUANTKIT_ENGINES/llama.cpp/bin,
  the repository's third_party/llama.cpp/bin, PATH (quantkit.eval.llamacpp.find_binary).
- mlx-lm: $QUANTKIT_MLX_PYTHON (a python with mlx_lm), $QUANTKIT_ENGINES/mlx/bin/python, else this
  interpreter when it can import mlx_lm.

An engine that is not found raises UnsupportedError (exit 2) naming the engine, its variable and the
setup script.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import InputError, UnsupportedError

ENGINES = ("vllm", "llama.cpp", "mlx")
VARIABLES = {"vllm": "QUANTKIT_VLLM", "llama.cpp": "QUANTKIT_LLAMA_CPP", "mlx": "QUANTKIT_MLX_PYTHON"}
DEFAULT_ENGINES_DIR = Path("~/.cache/quantkit/engines")
# Which engine serves each artifact kind (quantkit.eval.artifacts.artifact_kind).
ENGINE_FOR_KIND = {"compressed-tensors": "vllm", "bitsandbytes": "vllm", "transformers": "vllm",
                   "gguf": "llama.cpp", "mlx": "mlx"}


@dataclass(frozen=True)
class Engine:
    """An installed engine: its name and the executable quantkit runs (vLLM: the `vllm` script,
    llama.cpp: llama-server, mlx: a python that imports mlx_lm)."""

    name: str
    executable: Path
    found_in: str  # the variable, directory or "PATH" it was found through


def engines_dir() -> Path:
    return Path(os.environ.get("QUANTKIT_ENGINES") or DEFAULT_ENGINES_DIR).expanduser()


def executable(path: Path | str | None) -> Path | None:
    """The path when it names an executable file."""
    if not path:
        return None
    path = Path(path).expanduser()
    return path if path.is_file() and os.access(path, os.X_OK) else None


def first_found(candidates: list[tuple[str, Path | str | None]]) -> tuple[str, Path] | None:
    """The first (where, path) whose path is an executable file."""
    for where, path in candidates:
        found = executable(path)
        if found is not None:
            return where, found
    return None


def find_vllm() -> Engine | None:
    found = first_found([("QUANTKIT_VLLM", os.environ.get("QUANTKIT_VLLM")),
                         ("QUANTKIT_ENGINES", engines_dir() / "vllm" / "bin" / "vllm"),
                         ("PATH", shutil.which("vllm"))])
    return Engine("vllm", found[1], found[0]) if found else None


def find_llama_server() -> Engine | None:
    from quantkit.eval.llamacpp import find_binary

    found = find_binary("llama-server")
    return Engine("llama.cpp", found, str(found.parent)) if found else None


def imports_mlx_lm() -> bool:
    """Whether this interpreter can import mlx_lm (found, not imported)."""
    return importlib.util.find_spec("mlx_lm") is not None


def find_mlx() -> Engine | None:
    found = first_found([("QUANTKIT_MLX_PYTHON", os.environ.get("QUANTKIT_MLX_PYTHON")),
                         ("QUANTKIT_ENGINES", engines_dir() / "mlx" / "bin" / "python")])
    if found:
        return Engine("mlx", found[1], found[0])
    if imports_mlx_lm():
        return Engine("mlx", Path(sys.executable), "this python")
    return None


FINDERS = {"vllm": find_vllm, "llama.cpp": find_llama_server, "mlx": find_mlx}


def engine_for(kind: str) -> str:
    """The engine that serves an artifact kind."""
    if kind not in ENGINE_FOR_KIND:
        raise InputError(f"no serving engine for a '{kind}' artifact",
                         hint="serve-check serves compressed-tensors and bitsandbytes (vLLM), .gguf (llama-server) "
                              "and mlx-lm directories")
    return ENGINE_FOR_KIND[kind]


def check_name(name: str) -> str:
    if name not in ENGINES:
        raise InputError(f"unknown engine '{name}'", hint=f"use one of: auto, {', '.join(ENGINES)}")
    return name


def find_engine(name: str) -> Engine:
    """The installed engine, or UnsupportedError (exit 2) saying how to install it."""
    found = FINDERS[check_name(name)]()
    if found is None:
        raise UnsupportedError(
            f"{name} is not installed (looked in ${VARIABLES[name]}, {engines_dir()}/{name}, PATH)",
            hint=f"scripts/setup_engines.sh --only {name} (installs into $QUANTKIT_ENGINES), "
                 f"or set {VARIABLES[name]}")
    return found


def script_python(path: Path) -> Path | None:
    """The interpreter named by a Python script's `#!` line (a console-script wrapper), if any."""
    try:
        with open(path, "rb") as fh:
            first = fh.readline(512).decode("utf-8", "replace").strip()
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    words = first[2:].split()
    return executable(words[0]) if words and "python" in Path(words[0]).name else None
