"""Find, check and load a local Hugging Face checkpoint. Offline only; weights from safetensors.

`check_model_dir` is cheap (reads config.json and safetensors headers) and runs before any long
work, so a bad model fails in a second rather than after calibration.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from functools import cached_property
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
        header = read_safetensors_header(file)
        if "quantization_config" not in config:
            check_float_weights(file, header)
        tensors.update(header)
    architecture = (config.get("architectures") or ["unknown"])[0]
    return ModelInfo(path, config, files, architecture, config.get("model_type", "unknown"), tensors)


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def check_float_weights(file: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A full-precision checkpoint stores its weights and biases as floats; an integer or FP8
    weight means the file does not match what config.json describes."""
    for name, (dtype, _shape) in tensors.items():
        if name.endswith((".weight", ".bias")) and dtype not in FLOAT_DTYPES:
            raise ModelError(f"{file.name}: tensor {name} is stored as {dtype}, but config.json describes a "
                             "full-precision model (no quantization_config)",
                             hint="the checkpoint and its config.json do not belong together")


def check_loading_info(info: ModelInfo, loading: dict) -> None:
    """transformers re-initializes weights it did not find or whose shape disagrees with
    config.json; quantkit refuses to quantize such a model (naming the first few)."""
    mismatched = [f"{name} (checkpoint {list(ckpt)}, config.json {list(model)})"
                  for name, ckpt, model in loading.get("mismatched_keys") or []]
    missing = sorted(loading.get("missing_keys") or [])
    for problems, what in ((mismatched, "shapes disagree with config.json"),
                           (missing, "tensors are missing from the checkpoint")):
        if problems:
            more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
            raise ModelError(f"{info.path}: {len(problems)} {what}: {', '.join(problems[:3])}{more}",
                             hint="config.json and the safetensors files do not belong together, or a file is damaged")


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
    header, data_start = safetensors_layout(file)
    return _check_tensor_entries(file, header, file.stat().st_size - data_start)


def safetensors_layout(file: Path) -> tuple[dict, int]:
    """(raw header JSON, byte offset where the tensor data starts) of a safetensors file."""
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
    if not isinstance(header, dict):
        raise ModelError(f"{file.name} has a corrupt safetensors header (not a JSON object)")
    return header, 8 + header_len


def _check_tensor_entries(file: Path, header: dict, data_size: int) -> dict[str, tuple[str, list[int]]]:
    """Every entry well formed, sized as its dtype and shape say, and the entries tiling the data
    exactly (what the safetensors library itself insists on when loading)."""
    tensors = {}
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, stop = _tensor_entry(file, name, entry)
        count = 1
        for d in shape:
            count *= d
        if stop - begin != count * DTYPE_BYTES[dtype]:
            raise ModelError(f"{file.name}: tensor {name} has inconsistent size "
                             f"({dtype} {shape} needs {count * DTYPE_BYTES[dtype]} bytes, the header gives {stop - begin})")
        spans.append((begin, stop, name))
        tensors[name] = (dtype, shape)
    end = _check_tiling(file, sorted(spans))
    if end > data_size:
        raise ModelError(
            f"{file.name} is truncated: the header needs {end} data bytes, the file has {data_size}",
            hint="re-copy or re-download the checkpoint",
        )
    if end < data_size:
        raise ModelError(f"{file.name} is corrupt: {data_size - end} bytes follow the last tensor the header lists",
                         hint="re-copy or re-download the checkpoint")
    return tensors


def _tensor_entry(file: Path, name: str, entry) -> tuple[str, list[int], int, int]:
    """(dtype, shape, begin, stop) of one header entry; ModelError when malformed."""
    try:
        dtype, shape, (begin, stop) = entry["dtype"], list(entry["shape"]), entry["data_offsets"]
        ok = (dtype in DTYPE_BYTES and all(_natural(v) for v in (*shape, begin, stop)) and begin <= stop)
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise ModelError(f"{file.name}: tensor {name} has a malformed safetensors header entry: {entry!r}"[:300],
                         hint="the file is corrupt; re-copy or re-download the checkpoint")
    return dtype, shape, begin, stop


def _natural(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_tiling(file: Path, spans: list[tuple[int, int, str]]) -> int:
    """Tensors must follow each other without gaps or overlaps from offset 0; returns the end."""
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            raise ModelError(f"{file.name}: tensor {name} starts at byte {begin}, expected {end} "
                             "(overlapping or gapped data offsets)", hint="the file is corrupt")
        end = stop
    return end


def torch_dtype(name: str, info: ModelInfo | None = None):
    import torch

    if name == "auto":
        stored = info.config.get("torch_dtype") or info.config.get("dtype") if info else None
        name = stored if stored in ("bfloat16", "float16", "float32") else "bfloat16"
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


@dataclass(frozen=True)
class Offload:
    """What load_model puts on disk, and where: the vocabulary tables (embeddings, head) always, every
    decoder layer too with `layers` (--offload-dir). accelerate's offload reads them back from the
    checkpoint's own safetensors where transformers can (`folder` holds the rest). With the tables alone
    on disk, the decoder layers stay in RAM while llm-compressor onloads the embeddings only to compute
    the first layer's inputs and the head only to save it, so a large vocabulary's two biggest tensors
    are never resident beside a whole quantized decoder."""

    folder: Path
    layers: bool


def load_model(info: ModelInfo, dtype: str = "auto", device: str = "cpu", trust_remote_code: bool = False,
               offload: Offload | None = None):
    """Load the model offline from the checked directory, with the modules `offload` names on disk."""
    from transformers import AutoModelForCausalLM

    from quantkit.io.offline import offline

    auto_class = auto_model_class(info.config)
    try:
        with offline():
            model, loading = auto_class.from_pretrained(
                info.path,
                dtype=torch_dtype(dtype, info),
                trust_remote_code=trust_remote_code,
                use_safetensors=True,
                local_files_only=True,
                device_map=offload_device_map(info, device, offload.layers) if offload else device_map(device),
                offload_folder=offload.folder if offload else None,
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # reported by check_loading_info instead of a bare RuntimeError
            )
    except ValueError as exc:
        if needs_remote_code(exc):
            raise custom_code_error(info.path, info.architecture) from exc
        if auto_class is AutoModelForCausalLM and "Unrecognized configuration" in str(exc):
            raise ModelError(f"unsupported architecture {info.architecture} (model_type {info.model_type})") from exc
        raise
    check_loading_info(info, loading)
    model.eval()
    return model


def hf_config(path: Path, trust_remote_code: bool = False):
    """transformers' config object of a local checkpoint (config.json only, no hub lookup). Custom
    configuration code runs only with trust_remote_code; never an interactive prompt."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if needs_remote_code(exc):
            raise custom_code_error(Path(path), "custom configuration") from exc
        raise


def needs_remote_code(exc: Exception) -> bool:
    """transformers refused to run a checkpoint's custom code (trust_remote_code not given)."""
    return isinstance(exc, ValueError) and "trust_remote_code" in str(exc)


def custom_code_error(path: Path, architecture: str) -> ModelError:
    return ModelError(f"{path} needs custom code ({architecture})",
                      hint="pass --trust-remote-code if you trust the code in that directory")


LAYER_PREFIX = re.compile(r"^(.*\.layers\.\d+)\.")


def offload_device_map(info: ModelInfo, device: str, layers: bool = True) -> dict[str, str]:
    """A from_pretrained device_map with the embeddings, the head and (with `layers`) each decoder layer
    on "disk" and every other module on `device`: llm-compressor's sequential pipeline then onloads one
    layer at a time, and the embedding table only while the first subgraph runs."""
    mapping = {}
    for name in info.tensors:
        match = LAYER_PREFIX.match(name)
        module = match.group(1) if match else name.rsplit(".", 1)[0]
        on_disk = layers if match else is_offloaded_table(module)
        mapping[module] = "disk" if on_disk else device_map(device)
    mapping.setdefault("lm_head", "disk")  # tied: not in the checkpoint, still a module
    return mapping


def is_offloaded_table(module: str) -> bool:
    """The vocabulary-sized modules --offload-dir keeps on disk: the input embeddings and the head."""
    return module.endswith("embed_tokens") or module == "lm_head"


def is_vlm(config: dict) -> bool:
    """A vision-language model: a *ForConditionalGeneration architecture with a vision_config.

    The one rule for picking the Auto class, shared by loading the base (`load_model`) and
    loading an artifact back for evaluation (`quantkit.eval.artifacts.load_for_eval`).
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

    from quantkit.io.offline import offline

    try:
        with offline():
            return AutoTokenizer.from_pretrained(info.path, trust_remote_code=trust_remote_code,
                                                 local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - tokenizers/transformers raise many kinds on damaged files
        if needs_remote_code(exc):
            raise custom_code_error(info.path, info.architecture) from exc
        files = ", ".join(sorted(p.name for p in info.path.glob("tokenizer*"))) or "no tokenizer files"
        raise ModelError(f"{info.path} has no usable tokenizer ({files}): {type(exc).__name__}: {exc}".splitlines()[0],
                         hint="the tokenizer files are missing or damaged") from exc


def check_device(device: str) -> None:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ModelError("--device cuda was asked for but no CUDA device is available", hint="use --device cpu")


def drop_weights(model) -> None:
    """Free the weights of a model the engine is done with, whoever still refers to the object:
    llm-compressor's sequential pipeline leaves the model reachable from its traced code, which kept
    the whole base model resident through the gate and every later target. compressed-tensors'
    to_meta, module by module: it also empties the offload caches llm-compressor dispatches."""
    from compressed_tensors.offload import to_meta

    for module in model.modules() if model is not None else ():
        to_meta(module)
