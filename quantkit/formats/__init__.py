"""Artifact formats: what an artifact on disk is, and everything that follows from that.

Each format module (compressed_tensors, bitsandbytes, gguf, mlx, transformers) ends with one declaration,

    FORMAT = Format(kind=..., detect=detect, reading=reading, load=load, engines=(...), ...)

and imports without torch (heavy imports happen inside its functions). Nothing outside quantkit.formats and
quantkit.methods names a format: the gate, the preflight, serve-check, the serving plan and the model card
ask the Format of an artifact (`detect(path)`) or of a method (`MethodSpec.format`). Who calls what:

  member          called by                                       for
  kind            reports, `quantkit eval`, serve-check            the format's name
  detect          detect (quantkit eval, serve-check)              which format an artifact on disk is in
  reading         quantkit.formats.gate.artifact_reading           the gate reading the artifact itself
  load            quantkit.formats.gate.load_artifact              the artifact loaded whole (VLMs, remote code)
  gate_dtype      run.preflight                                    the dtype the gate computes it in (bytes)
  streams         run.preflight                                    whether the gate reads it a layer at a time
  library         run.report.model_card                            the model card's library_name
  engines         serve.support, serve-check                       the serving engines that load it
  served_path     serve.check                                      the path an engine is started on
  runtimes        run.serving, `quantkit inspect`, model cards     runtimes and kernels that serve a scheme
  serve_command   run.serving, model cards                         the command line that serves it
  hub_serve_command  run.card                                     the command that serves it from its Hub repo
  serve_refusal   serve.support                                    why its engine cannot serve it on a device
  fuses_shards    run.pipeline                                     whether fused shards (q/k/v) must match
  keeps_base_tensors  run.preflight                                 tensors outside the layers stored as the base's

The registry: FORMATS (kind -> module, in detection order) and the formats other packages declare under
the entry-point group `quantkit.formats` (a name -> "module:FORMAT"), detected after the built-in ones and
before a plain transformers checkpoint, which takes any config.json without a quantization_config.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from quantkit.errors import InputError, InternalError, ModelError

if TYPE_CHECKING:
    from quantkit.eval.scorers import Reading

FORMATS: dict[str, str] = {  # detection order: the first whose detect() says yes
    "gguf": "quantkit.formats.gguf",
    "mlx": "quantkit.formats.mlx",
    "compressed-tensors": "quantkit.formats.compressed_tensors",
    "bitsandbytes": "quantkit.formats.bitsandbytes",
}
FALLBACK = ("transformers", "quantkit.formats.transformers")  # detected last: any checkpoint without quantization
ENTRY_POINTS = "quantkit.formats"


@dataclass(frozen=True)
class Runtime:
    """One way to serve an artifact: the runtime and its kernel, the device kinds it runs on
    ("cuda", "apple", "cpu"), the CUDA compute capabilities the kernel runs on, where that is stated, and the
    widths of a Linear ([out, in]) the kernel takes: multiples of out_multiple and in_multiple."""

    name: str
    kinds: tuple[str, ...]
    min_capability: float = 0.0
    source: str = ""
    out_multiple: int = 1
    in_multiple: int = 1
    max_capability: float = 0.0  # the newest compute capability the kernel runs on (0: no limit)
    cpu_flags: tuple[str, ...] = ()  # the x86 CPU features (/proc/cpuinfo flags) the kernel needs on a CPU
    # how it runs beside the other kernels of its engine: 0 the fast ones, 1 a slower path (bitsandbytes in
    # vLLM dequantizes per call); `--method auto` serves the faster of two artifacts of about equal size
    rank: int = 0
    # False: the kernel serves no mixture of experts whose routed experts are quantized (vLLM CPU 0.32 has no
    # fused-MoE kernel for them: quantkit.formats.compressed_tensors)
    quantized_experts: bool = True

    def serves(self, kind: str, capability: float = 0.0, flags: frozenset[str] | None = None) -> bool:
        """Whether the kernel runs on a device of this kind (and compute capability, or CPU flags where known)."""
        newest = self.max_capability or capability
        if kind not in self.kinds or (kind == "cuda" and not self.min_capability <= capability <= newest):
            return False
        return kind != "cpu" or not self.lacks(flags)

    def lacks(self, flags: frozenset[str] | None) -> tuple[str, ...]:
        """The CPU features the kernel needs that an x86 CPU with these flags lacks (none where they are unknown,
        or on a CPU that is not x86: no sse2 flag)."""
        if flags is None or "sse2" not in flags:
            return ()
        return tuple(flag for flag in self.cpu_flags if flag not in flags)

    def accepts(self, shape: list[int]) -> bool:
        """Whether the kernel takes a Linear of this [out, in] shape."""
        return shape[0] % self.out_multiple == 0 and shape[1] % self.in_multiple == 0


class Device(Protocol):
    """The device an engine would run on (quantkit.serve.support.Accelerator)."""

    kind: str  # "cpu", "cuda" or "apple"
    flags: frozenset[str]  # CPU feature flags


def vllm_serve(path: str) -> str:
    return f"vllm serve {path}"


def as_given(path: Path) -> Path:
    return path


def serves_anywhere(artifact: Path, device: Device) -> str | None:
    return None


def no_hub_command(repo: str, subfolder: str, files: list[str]) -> str | None:
    return None


def no_runtimes(scheme: str) -> tuple[Runtime, ...]:
    return ()


def never_streams(config: dict, keeps_lm_head: bool, trust_remote_code: bool) -> bool:
    return False


@dataclass(frozen=True)
class Format:
    """Everything about one artifact format. Required members first; the rest default as shown."""

    kind: str  # its name: "compressed-tensors", "gguf" (reports, `quantkit eval`, serve-check)
    # detect(path) -> whether the artifact at `path` is in this format; cheap (headers, config.json), and a
    # damaged artifact of the format raises here (ModelError naming the file), before any work
    detect: Callable[[Path], bool]
    # reading(path, base_dir, trust_remote_code) -> how quantkit reads it itself for the gate
    # (quantkit.eval.scorers.Reading: built on the meta device, weights a tensor at a time, streamed or resident),
    # or None: it is loaded whole (`load`)
    reading: Callable[[Path, Path | None, bool], Reading | None]
    # load(path, base_dir, device, trust_remote_code) -> the artifact loaded whole as a torch module whose
    # forward gives logits, strictly (a tensor missing or left over is an error)
    load: Callable[[Path, Path | None, str, bool], Any]
    library: str = "transformers"  # the model card's library_name
    # the serving engines that load it (quantkit.serve's registry names); the first serves it by default
    engines: tuple[str, ...] = ("vllm",)
    # served_path(artifact) -> the path an engine is started on (a .gguf inside an output directory)
    served_path: Callable[[Path], Path] = as_given
    # runtimes(scheme) -> the runtimes that serve a scheme of the format (MethodSpec.scheme), in order of
    # preference: the first that runs on a device serves there
    runtimes: Callable[[str], tuple[Runtime, ...]] = no_runtimes
    serve_command: Callable[[str], str] = vllm_serve  # serve_command(artifact path) -> a command line
    # hub_serve_command(repo, subfolder, files) -> the command that serves the artifact straight from its Hub repo
    # where the engine fetches it itself (llama.cpp: one .gguf of a repo); None: the repo read as a directory
    hub_serve_command: Callable[[str, str, list[str]], str | None] = no_hub_command
    # serve_refusal(artifact, device) -> why its engine cannot serve this artifact on this device, or None
    serve_refusal: Callable[[Path, Device], str | None] = serves_anywhere
    # Preflight: the dtype the gate computes the artifact in ("auto": as stored; "float32"), and
    # streams(config, keeps_lm_head, trust_remote_code) -> whether the gate reads an artifact of a model with
    # this config.json itself (a layer at a time, or resident), else loads it whole at its bits
    gate_dtype: str = "auto"
    streams: Callable[[dict, bool, bool], bool] = never_streams
    fuses_shards: bool = False  # its engine loads fused shards (q/k/v, gate/up) as one: they must match
    # the tensors outside the decoder layers (embeddings, head, final norm) stored as the base stores them: a
    # resident gate holds them once beside the base (quantkit.eval.resident.Shared; run.preflight's estimate)
    keeps_base_tensors: bool = False


def registered() -> dict[str, str]:
    """kind -> "module:attribute" of every format, in detection order: the built-in ones, those declared
    under the entry-point group `quantkit.formats`, then the plain transformers checkpoint."""
    from importlib.metadata import entry_points

    found = {kind: f"{module}:FORMAT" for kind, module in FORMATS.items()}
    for point in sorted(entry_points(group=ENTRY_POINTS), key=lambda p: p.name):
        found.setdefault(point.name, point.value)
    kind, module = FALLBACK
    return {**found, kind: f"{module}:FORMAT"}


def load_object(reference: str) -> Any:
    """The object a "module:attribute" reference names."""
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


def get_format(kind: str) -> Format:
    """The format of this name; InputError naming the known ones otherwise."""
    builtin = {**FORMATS, FALLBACK[0]: FALLBACK[1]}
    references = {kind: f"{builtin[kind]}:FORMAT"} if kind in builtin else registered()
    if kind not in references:
        raise InputError(f"unknown artifact format '{kind}'", hint="known formats: " + ", ".join(references))
    fmt = load_object(references[kind])
    if not isinstance(fmt, Format) or fmt.kind != kind:
        raise InternalError(f"{references[kind]} is not the Format '{kind}'")
    return fmt


def all_formats() -> list[Format]:
    return [get_format(kind) for kind in registered()]


def detect(path: Path) -> Format:
    """The format of the artifact at `path` (a .gguf file or an output directory): the first whose detect
    says yes. ModelError when it is neither a .gguf nor a checkpoint directory, InputError when its
    quantization is one no format reads."""
    path = Path(path)
    for fmt in all_formats():
        if fmt.detect(path):
            return fmt
    config = path / "config.json"
    if not config.is_file():
        raise ModelError(f"{path} is neither a .gguf file nor a checkpoint directory with config.json",
                         hint="give the output directory of quantkit quantize, or a .gguf file")
    from quantkit.io.checkpoint import quant_method, read_json

    raise InputError(f"{path}: quantization method '{quant_method(read_json(config))}' is not one quantkit can "
                     "evaluate", hint="quantkit reads " + ", ".join(registered()) + " artifacts; compare others "
                     "with their own tools")
