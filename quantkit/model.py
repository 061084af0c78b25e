"""Find, check and load a local Hugging Face checkpoint. Offline only; weights from safetensors.

`check_model_dir` is cheap (reads config.json and safetensors headers) and runs before any long
work, so a bad model fails in a second rather than after calibration.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.errors import ModelError

MAX_HEADER_BYTES = 100 * 1024 * 1024
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


@dataclass
class ModelInfo:
    path: Path
    config: dict
    weight_files: list[Path]
    architecture: str
    model_type: str
    tensors: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # name -> (dtype, shape)

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


def resolve_model(spec: str) -> Path:
    """A local directory, or a hub id found in the local Hugging Face cache (never downloaded)."""
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelError(f"model path is not a directory: {path}")
        return path
    if _looks_like_hub_id(spec):
        cached = _from_hf_cache(spec)
        if cached is not None:
            return cached
        raise ModelError(
            f"'{spec}' is not a local directory and is not in the local Hugging Face cache",
            hint="quantkit never downloads; run `hf download "
            f"{spec}` on a connected machine, or pass a local directory",
        )
    raise ModelError(f"model directory not found: {path}")


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))


def _from_hf_cache(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        return None


def check_model_dir(path: Path) -> ModelInfo:
    """Read config.json and every safetensors header; raise ModelError on anything wrong."""
    config = read_config(path)
    files = weight_files(path)
    tensors: dict[str, tuple[str, list[int]]] = {}
    for file in files:
        tensors.update(read_safetensors_header(file))
    architecture = (config.get("architectures") or ["unknown"])[0]
    return ModelInfo(path, config, files, architecture, config.get("model_type", "unknown"), tensors)


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{path} has no config.json", hint="point at a Hugging Face checkpoint directory")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{config_file} is not valid JSON: {exc}") from exc
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
    raise ModelError(f"{path} has no *.safetensors weight files")


def read_safetensors_header(file: Path) -> dict[str, tuple[str, list[int]]]:
    """Parse and check one safetensors header: JSON valid, offsets consistent with the file size."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ModelError(f"{file.name} is truncated (no safetensors header)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise ModelError(f"{file.name} is corrupt or truncated (header length {header_len} > file size)")
        try:
            header = json.loads(fh.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelError(f"{file.name} has a corrupt safetensors header") from exc
    return _check_tensor_entries(file, header, size - 8 - header_len)


def _check_tensor_entries(file: Path, header: dict, data_size: int) -> dict[str, tuple[str, list[int]]]:
    tensors = {}
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, stop = entry["data_offsets"]
        count = 1
        for d in entry["shape"]:
            count *= d
        if stop - begin != count * DTYPE_BYTES.get(entry["dtype"], 0) and entry["dtype"] in DTYPE_BYTES:
            raise ModelError(f"{file.name}: tensor {name} has inconsistent size")
        end = max(end, stop)
        tensors[name] = (entry["dtype"], list(entry["shape"]))
    if end > data_size:
        raise ModelError(
            f"{file.name} is truncated: the header needs {end} data bytes, the file has {data_size}",
            hint="re-copy or re-download the checkpoint",
        )
    return tensors


def sha256_files(files: list[Path]) -> dict[str, str]:
    import hashlib

    digests = {}
    for file in files:
        h = hashlib.sha256()
        with open(file, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
        digests[file.name] = h.hexdigest()
    return digests


def torch_dtype(name: str, info: ModelInfo | None = None):
    import torch

    if name == "auto":
        stored = info.config.get("torch_dtype") or info.config.get("dtype") if info else None
        name = stored if stored in ("bfloat16", "float16", "float32") else "bfloat16"
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def load_model(info: ModelInfo, dtype: str = "auto", device: str = "cpu", trust_remote_code: bool = False,
               offload_folder: Path | None = None):
    """Load the model offline from the checked directory; with `offload_folder`, every decoder layer
    is offloaded to disk there (accelerate), so RAM holds the embeddings, head and norms only."""
    from transformers import AutoModelForCausalLM

    from quantkit.offline import offline

    auto_class = auto_model_class(info.config)
    try:
        with offline():
            model = auto_class.from_pretrained(
                info.path,
                dtype=torch_dtype(dtype, info),
                trust_remote_code=trust_remote_code,
                use_safetensors=True,
                local_files_only=True,
                device_map=offload_device_map(info, device) if offload_folder else device_map(device),
                offload_folder=offload_folder,
            )
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise ModelError(
                f"{info.path} needs custom code ({info.architecture})",
                hint="pass --trust-remote-code if you trust the code in that directory",
            ) from exc
        if auto_class is AutoModelForCausalLM and "Unrecognized configuration" in str(exc):
            raise ModelError(f"unsupported architecture {info.architecture} (model_type {info.model_type})") from exc
        raise
    model.eval()
    return model


LAYER_PREFIX = re.compile(r"^(.*\.layers\.\d+)\.")


def offload_device_map(info: ModelInfo, device: str) -> dict[str, str]:
    """A from_pretrained device_map with each decoder layer on "disk" and every other module on
    `device` (llm-compressor's sequential pipeline then onloads one layer at a time)."""
    mapping = {}
    for name in info.tensors:
        match = LAYER_PREFIX.match(name)
        if match:
            mapping[match.group(1)] = "disk"
        else:
            mapping[name.rsplit(".", 1)[0]] = device_map(device)
    mapping.setdefault("lm_head", device_map(device))  # tied: not in the checkpoint, still a module
    return mapping


def is_vlm(config: dict) -> bool:
    """A vision-language model: a *ForConditionalGeneration architecture with a vision_config.

    The one rule for picking the Auto class, shared by loading the base (`load_model`) and
    loading an artifact back for evaluation (`quantkit.artifacts.load_for_eval`).
    """
    architecture = (config.get("architectures") or [""])[0]
    return architecture.endswith("ForConditionalGeneration") and "vision_config" in config


def auto_model_class(config: dict):
    """AutoModelForImageTextToText for a VLM, else AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vlm(config) else AutoModelForCausalLM


def device_map(device: str):
    """--device to a from_pretrained device_map: auto = cuda when available, else cpu."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_tokenizer(info: ModelInfo, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    from quantkit.offline import offline

    try:
        with offline():
            return AutoTokenizer.from_pretrained(info.path, trust_remote_code=trust_remote_code,
                                                 local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelError(f"{info.path} has no usable tokenizer: {exc}".splitlines()[0]) from exc


def check_device(device: str) -> None:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ModelError("--device cuda was asked for but no CUDA device is available", hint="use --device cpu")
