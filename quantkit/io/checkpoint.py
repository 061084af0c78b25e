"""A checkpoint directory as quantkit reads it before loading anything: config.json and the
safetensors headers (`check_model_dir`, cheap, so a bad model fails in a second rather than after
calibration), the model's kind, and a model argument resolved to a directory (a Hub id fetched by
quantkit.io.hub).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from quantkit.errors import ModelError
from quantkit.io.hub import HubSource, fetch, parse_hub_id
from quantkit.io.safetensors import (
    DTYPE_BYTES,
    StoredTensor,
    read_safetensors_header,
    read_stored,
    read_stored_rows,
    safetensors_index,
)


@dataclass
class ModelInfo:
    path: Path
    config: dict
    weight_files: list[Path]
    architecture: str
    model_type: str
    tensors: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # name -> (dtype, shape)
    hub: HubSource | None = None  # the Hub id, revision, commit and files it was fetched from

    @property
    def num_parameters(self) -> int:
        total = 0
        for _dtype, shape in self.tensors.values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    @property
    def dtype(self) -> str:
        dtypes = [d for d, _ in self.tensors.values()]
        return max(set(dtypes), key=dtypes.count) if dtypes else "unknown"

    @cached_property
    def towers(self):
        """The VLM towers (quantkit.arch.vlm.Towers): the family's row, or those found by look."""
        from quantkit.arch.vlm import model_towers

        return model_towers(self.model_type, self.config, self.tensors)

    @property
    def is_quantized(self) -> bool:
        return "quantization_config" in self.config


GENERATIVE_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")


def check_generative(info: ModelInfo) -> None:
    """quantkit handles decoder LMs and VLMs; an encoder or classifier fails here, early."""
    if not info.architecture.endswith(GENERATIVE_SUFFIXES):
        from quantkit.errors import UnsupportedError

        raise UnsupportedError(
            f"unsupported architecture {info.architecture}: quantkit quantizes generative language models",
            hint="expected an architecture ending in " + ", ".join(GENERATIVE_SUFFIXES),
        )


# Sub-model types whose transformers classes import a package quantkit does not install
# (Gemma 3n's MobileNet vision tower is a timm model, built through TimmWrapperModel).
SUBMODEL_PACKAGES = {"timm_wrapper": "timm", "gemma3n_vision": "timm"}


def check_submodel_packages(info: ModelInfo) -> None:
    """A sub-model (vision/audio/text config) whose transformers class needs a package that is not
    installed fails here, before any work, instead of as an ImportError after it (exit 1)."""
    import importlib.util

    for key, sub in info.config.items():
        package = SUBMODEL_PACKAGES.get(sub.get("model_type", "")) if isinstance(sub, dict) else None
        if package and importlib.util.find_spec(package) is None:
            raise ModelError(
                f"{info.architecture}'s {key} is a {sub['model_type']} model, which transformers builds with "
                f"the `{package}` package, not installed",
                hint=f"pip install {package} (into the same environment as quantkit)")


def resolve_model(spec: str, offline: bool = False, trust_remote_code: bool = False) -> Path:
    """The checkpoint directory a model argument names (resolve_source)."""
    return resolve_source(spec, offline, trust_remote_code)[0]


def resolve_source(spec: str, offline: bool = False,
                   trust_remote_code: bool = False) -> tuple[Path, HubSource | None]:
    """A model argument: a local directory, or `org/name[@revision]` on the Hugging Face Hub, fetched into
    the hub library's cache (quantkit.io.hub.fetch; from the cache alone when offline) with where it came
    from. The one function every command resolves its model arguments with."""
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelError(f"model path is not a directory: {path}",
                             hint="give the checkpoint's directory, not a file in it (a .gguf goes to quantkit eval)")
        return path, None
    hub_id = parse_hub_id(spec)
    if hub_id is not None:
        return fetch(*hub_id, offline=offline, trust_remote_code=trust_remote_code)
    raise ModelError(f"model directory not found: {path}",
                     hint="give a local checkpoint directory (config.json and *.safetensors), or a Hub id "
                          "org/name[@revision]")


def check_model_dir(path: Path, hub: HubSource | None = None) -> ModelInfo:
    """Read config.json and every safetensors header; raise ModelError on anything wrong. HUB: where a
    model fetched from the Hub came from (resolve_source)."""
    config = read_config(path)
    files = weight_files(path)
    tensors: dict[str, tuple[str, list[int]]] = {}
    for file in files:
        header = read_safetensors_header(file)
        if "quantization_config" not in config:
            check_float_weights(file, header)
        tensors.update(header)
    architecture = (config.get("architectures") or ["unknown"])[0]
    return ModelInfo(path, config, files, architecture, config.get("model_type", "unknown"), tensors, hub)


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def check_float_weights(file: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A full-precision checkpoint stores its weights and biases as floats; an integer or FP8
    weight means the file does not match what config.json describes."""
    for name, (dtype, _shape) in tensors.items():
        if name.endswith((".weight", ".bias")) and dtype not in FLOAT_DTYPES:
            raise ModelError(f"{file.name}: tensor {name} is stored as {dtype}, but config.json describes a "
                             "full-precision model (no quantization_config)",
                             hint="the checkpoint and its config.json do not belong together")


def quant_method(config: dict) -> str:
    """config.json's quantization_config.quant_method ("compressed-tensors", "bitsandbytes"); "" without one."""
    return (config.get("quantization_config") or {}).get("quant_method") or ""


# quant_method -> (what such a checkpoint holds, the way to a checkpoint quantkit takes), where the 16-bit original
# is not what its publisher ships (openai's gpt-oss comes in MXFP4 only)
QUANTIZED_CHECKPOINTS = {
    "mxfp4": ("its experts stored in MXFP4 as *_blocks / *_scales tensors, as openai ships gpt-oss",
              "dequantize it to bf16 first (transformers: from_pretrained with quantization_config=Mxfp4Config("
              "dequantize=True), then save_pretrained) and quantize that; or convert it with llama.cpp's "
              "convert_hf_to_gguf.py, which copies the MXFP4 blocks into GGML MXFP4 tensors"),
}


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{path} has no config.json", hint="point at a Hugging Face checkpoint directory")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{config_file} is not valid JSON: {exc}",
                         hint="config.json is damaged: restore it from the checkpoint's source") from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelError(f"{config_file} has no model_type", hint="is this a transformers checkpoint?")
    return config


def weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if list(path.glob("*.bin")) or list(path.glob("*.pt")) or list(path.glob("*.pth")):
        raise ModelError(
            f"{path} holds only pickle weights (.bin/.pt); quantkit loads safetensors only",
            hint="convert it once with transformers: model.save_pretrained(dir, safe_serialization=True)",
        )
    raise ModelError(f"{path} has no *.safetensors weight files",
                     hint="give a Hugging Face checkpoint directory with its *.safetensors files")


LAYER_PREFIX = re.compile(r"^(.*\.layers\.\d+)\.")


def unit_bytes(info: ModelInfo) -> tuple[dict[str, int], dict[str, int]]:
    """Stored bytes per streamed unit: (every other module: embeddings, head, norms; each decoder
    layer), grouped by the same rule as quantkit.engines.transformers.offload_device_map."""
    import math

    others: dict[str, int] = {}
    layers: dict[str, int] = {}
    for name, (dtype, shape) in info.tensors.items():
        match = LAYER_PREFIX.match(name)
        units, unit = (layers, match.group(1)) if match else (others, name.rsplit(".", 1)[0])
        units[unit] = units.get(unit, 0) + math.prod(shape) * DTYPE_BYTES.get(dtype, 1)
    return others, layers


def is_offloaded_table(module: str) -> bool:
    """The vocabulary-sized modules --offload-dir keeps on disk: the input embeddings and the head."""
    return module.endswith("embed_tokens") or module == "lm_head"


class SafetensorsWeights:
    """The tensors of a checkpoint directory's *.safetensors files, read one at a time."""

    def __init__(self, model_dir: Path):
        from quantkit.io.checkpoint import weight_files

        self.index: dict[str, StoredTensor] = {}
        for file in weight_files(Path(model_dir)):
            self.index.update(safetensors_index(file))

    def keys(self) -> list[str]:
        return list(self.index)

    def get(self, name: str) -> "torch.Tensor":  # noqa: F821
        return read_stored(self.index[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return self.index[name].shape

    def rows(self, name: str, index) -> "torch.Tensor":  # noqa: F821
        return read_stored_rows(self.index[name], index)
