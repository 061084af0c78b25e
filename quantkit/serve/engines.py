"""The serving engines: one protocol (Engine) and one registry (ENGINES).

ENGINES maps the name a user gives (`serve-check --engine NAME`, `quantize --serve-check NAME`, a recipe's
`gate.serve.engine`) to the module that implements the Engine protocol. The recipe's validation, the CLI's
help and the docs' engine tables read it; an engine is added by writing its module and adding it here.
A module is imported only when the engine is used, so reading the names costs nothing.

How serve-check drives an engine (quantkit.serve.check):
- find: `find()` locates the installed engine without downloading anything, or returns None (exit 2 then,
  naming `VARIABLE` and scripts/setup_engines.sh);
- start: `command()` with `environment()` runs in a process group of its own on a free port of 127.0.0.1
  (quantkit.serve.process), its output in a log;
- ready: GET `HEALTH` answers 200;
- ask: `version`, `tokenize` (the engine's own token ids for texts), `prompt_topk` (log-probs of every
  next-token prediction of token-id windows), `greedy` (continuations), `stream_request` /
  `stream_tokens` (the load test, quantkit.serve.load);
- stop: the whole process group, on every exit path (quantkit.serve.process.stop).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from quantkit.errors import InputError, UnsupportedError

if TYPE_CHECKING:
    from quantkit.serve.settings import Endpoint, ServeOptions
    from quantkit.serve.stats import TopK

# name -> the module implementing Engine. Which artifact formats each loads is the formats' to say
# (quantkit.formats: Format.engines, the first its default).
ENGINES: dict[str, str] = {
    "vllm": "quantkit.serve.vllm_server",
    "llama.cpp": "quantkit.serve.llama_server",
    "mlx": "quantkit.serve.mlx_server",
}
AUTO = "auto"  # the engine that serves the artifact's kind
DEFAULT_ENGINES_DIR = Path("~/.cache/quantkit/engines")


@dataclass(frozen=True)
class Installed:
    """An installed engine: its registry name and the executable quantkit runs (vLLM: the `vllm` script,
    llama.cpp: llama-server, mlx: a python that imports mlx_lm)."""

    name: str
    executable: Path
    found_in: str  # the variable, directory or "PATH" it was found through


@runtime_checkable
class Engine(Protocol):
    """What a serving engine module declares and answers (module docstring: how serve-check uses it)."""

    NAME: str  # its key in ENGINES
    LABEL: str  # how the docs and messages name it ("vLLM", "llama.cpp's llama-server")
    VARIABLE: str  # the environment variable that points at an installation
    VARIABLE_HELP: str  # what that variable names (docs/serving.md)
    STARTED_AS: str  # the command line, for the docs
    HEALTH: str  # the path that answers 200 once the server is ready
    STOPS_AT_EOS: bool  # greedy continuations end at EOS (no ignore_eos)
    NORMALIZED: bool  # its log-probs are a normalized log-softmax (else: KL scale-free, ppl unchecked)
    MAX_LOGPROBS: int | None  # the most candidates per position it returns (None: any k)
    # why the prompt log-probs it serves do not read a quantized KV cache it was started with ("": they do), so
    # serve-check --kv-cache refuses it
    PROMPT_KV_UNSEEN: str
    QUERIED: dict[str, str]  # what each measurement asks of it (recorded in the report)

    def find(self) -> Installed | None: ...

    def command(self, installed: Installed, model: Path, port: int, options: ServeOptions) -> list[str]: ...

    def environment(self, options: ServeOptions) -> dict[str, str]: ...

    def version(self, endpoint: Endpoint, installed: Installed) -> str: ...

    def tokenize(self, endpoint: Endpoint, installed: Installed, texts: list[str]) -> list[list[int]]: ...

    def prompt_topk(self, endpoint: Endpoint, windows: list[list[int]], k: int,
                    progress: Callable[[str], None]) -> TopK: ...

    def greedy(self, endpoint: Endpoint, prompts: list[list[int]], steps: int) -> list[list[int] | None]: ...

    def stream_request(self, endpoint: Endpoint, prompt: list[int], steps: int) -> tuple[str, dict]: ...

    def stream_tokens(self, event: dict) -> int: ...


def names() -> tuple[str, ...]:
    """Every engine's name, in the registry's order."""
    return tuple(ENGINES)


def choices() -> str:
    """'auto | vllm | llama.cpp | mlx': what --engine / --serve-check accept."""
    return " | ".join((AUTO, *ENGINES))


def check_name(name: str) -> str:
    if name not in ENGINES:
        raise InputError(f"unknown engine '{name}'", hint=f"use one of: {AUTO}, {', '.join(ENGINES)}")
    return name


def get_engine(name: str) -> Engine:
    """The engine's module (InputError, exit 2, for a name not in ENGINES)."""
    return importlib.import_module(ENGINES[check_name(name)])


def kinds_served(name: str) -> tuple[str, ...]:
    """The artifact formats an engine loads: those whose Format names it (quantkit.formats, Format.engines)."""
    from quantkit.formats import all_formats

    return tuple(f.kind for f in all_formats() if name in f.engines)


def engine_for(kind: str) -> str:
    """The engine that serves an artifact kind: the first its format names (quantkit.formats, Format.engines)."""
    from quantkit.formats import get_format

    engines = get_format(kind).engines
    if not engines:
        served = "; ".join(f"{get_engine(n).LABEL}: {', '.join(kinds_served(n))}" for n in ENGINES)
        raise InputError(f"no serving engine for a '{kind}' artifact", hint=f"serve-check serves {served}")
    return engines[0]


def find_engine(name: str) -> Installed:
    """The installed engine, or UnsupportedError (exit 2) saying how to install it."""
    engine = get_engine(name)
    found = engine.find()
    if found is None:
        raise UnsupportedError(
            f"{name} is not installed (looked in ${engine.VARIABLE}, {engines_dir()}/{name}, PATH)",
            hint=f"scripts/setup_engines.sh --only {name} (installs into $QUANTKIT_ENGINES), "
                 f"or set {engine.VARIABLE}")
    return found


# ------------------------------------------------------------------ finding an installation


def engines_dir() -> Path:
    """Where scripts/setup_engines.sh installs the engines: $QUANTKIT_ENGINES, else ~/.cache/quantkit/engines."""
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
