"""GGUF: one llama.cpp file per model (`model-Q4_K_M.gguf`; a VLM's vision tower beside it as `mmproj-*.gguf`),
written by quantkit's own converter and kernels (quantkit.gguf), served by llama.cpp's llama-server or Ollama.

The gate dequantizes each tensor through gguf-py into the base model's transformers architecture and
computes in float32 (quantkit.eval.scorers.gguf_reading, a layer at a time); a VLM's language model is
loaded into the whole base (its towers are the base's: the .gguf lacks them).
"""

from __future__ import annotations

from pathlib import Path

from quantkit.errors import InputError
from quantkit.formats import Format, Runtime

KIND = "gguf"
LLAMACPP = "llama.cpp docs/build.md: CUDA, Metal and CPU backends (Ollama runs llama.cpp)"
RUNTIMES = (
    Runtime("llama.cpp / Ollama: CUDA", ("cuda",), 5.0, LLAMACPP),
    Runtime("llama.cpp / Ollama: Metal", ("apple",), 0.0, LLAMACPP),
    Runtime("llama.cpp / Ollama: CPU", ("cpu",), 0.0, LLAMACPP),
)


def detect(path: Path) -> bool:
    """A .gguf file, or a directory of them without config.json; its header read (a damaged one raises)."""
    from quantkit.gguf.loader import open_reader

    if not ((path.is_file() and path.suffix == ".gguf") or (
            path.is_dir() and not (path / "config.json").exists() and list(path.glob("*.gguf")))):
        return False
    open_reader(gguf_file(path))
    return True


def gguf_file(path: Path) -> Path:
    """The language model .gguf: the file itself, or the one .gguf of a directory that is not a
    multimodal projector (a VLM's output holds the language model and its `mmproj-*.gguf`)."""
    if path.is_file():
        return path
    files = [f for f in sorted(path.glob("*.gguf")) if not is_projector(f)]
    if len(files) != 1:
        raise InputError(f"{path} holds {len(files)} language-model .gguf files; pass the file itself",
                         hint="e.g. quantkit eval DIR/model-Q4_K_M.gguf --against BASE")
    return files[0]


def is_projector(path: Path) -> bool:
    """A llama.cpp multimodal projector (general.architecture "clip"), read from the header."""
    from quantkit.gguf.loader import open_reader

    field = open_reader(path).fields.get("general.architecture")
    return field is not None and field.contents() == "clip"


def needs_base(base_dir: Path | None) -> Path:
    if base_dir is None:
        raise InputError("evaluating a .gguf needs the base checkpoint", hint="pass --against BASE_DIR")
    return Path(base_dir)


def reading(path: Path, base_dir: Path | None, trust_remote_code: bool):
    """Dequantized a tensor at a time into the base's architecture; None for a VLM's (loaded into the whole base)."""
    from quantkit.eval.scorers import gguf_reading
    from quantkit.arch.vlm import is_vlm
    from quantkit.io.checkpoint import read_config

    if is_vlm(read_config(needs_base(base_dir))):
        return None
    return gguf_reading(gguf_file(path), base_dir)


def load(path: Path, base_dir: Path | None, device: str, trust_remote_code: bool):
    from quantkit.eval.artifacts import load_gguf_into_base

    return load_gguf_into_base(gguf_file(path), needs_base(base_dir), device, trust_remote_code)


def runtimes(scheme: str) -> tuple[Runtime, ...]:
    return RUNTIMES  # every ggml type runs on every llama.cpp backend


def hub_serve_command(repo: str, subfolder: str, files: list[str]) -> str:
    """llama-server fetching the language model's .gguf from the repo itself (--hf-repo, --hf-file)."""
    model = next((f for f in files if f.endswith(".gguf") and not f.startswith("mmproj")), "MODEL.gguf")
    return f"llama-server --hf-repo {repo} --hf-file {f'{subfolder}/{model}' if subfolder else model}"


def serve_command(path: str) -> str:
    """llama-server on the .gguf (a VLM: with its mmproj file), or Ollama on the Modelfile beside it."""
    folder = str(Path(path).parent) if path.endswith(".gguf") else path
    model = path if path.endswith(".gguf") else f"{path}/MODEL.gguf"
    return f"llama-server -m {model} (or: ollama create NAME -f {folder}/Modelfile && ollama run NAME)"


def streams(config: dict, keeps_lm_head: bool, trust_remote_code: bool) -> bool:
    return True  # read by quantkit's own loader, whatever the model


FORMAT = Format(
    kind=KIND, detect=detect, reading=reading, load=load, library="gguf", engines=("llama.cpp",),
    served_path=gguf_file, runtimes=runtimes, serve_command=serve_command, hub_serve_command=hub_serve_command,
    gate_dtype="float32", streams=streams,
)
