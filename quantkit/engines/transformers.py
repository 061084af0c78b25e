"""transformers as quantkit's model engine: load a checked checkpoint offline (with the modules an
Offload names on disk), its config and tokenizer, dtypes and devices, and free a model's weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import ModelError
from quantkit.arch.vlm import is_vlm
from quantkit.io.checkpoint import LAYER_PREFIX, ModelInfo, is_offloaded_table


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
            raise ModelError(f"unsupported architecture {info.architecture} (model_type {info.model_type})",
                             hint="docs/models.md lists the architectures each method takes; --method gguf converts "
                                  "some transformers cannot load") from exc
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


def check_known(info: ModelInfo, trust_remote_code: bool = False) -> None:
    """transformers builds this model_type (its own classes, or with trust_remote_code the checkpoint's own
    code): else UnsupportedError (exit 2) before any work, naming the model_type and what to do."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if info.model_type in CONFIG_MAPPING_NAMES or (trust_remote_code and "auto_map" in info.config):
        return
    from quantkit.errors import UnsupportedError

    hint = ("the checkpoint ships its own modeling code (auto_map in config.json): pass --trust-remote-code if you "
            "trust it" if "auto_map" in info.config else
            "a newer transformers may know it, but llm-compressor 0.14 (quantkit's engine) allows transformers up "
            "to 5.17; a checkpoint that ships its own modeling code runs with --trust-remote-code")
    raise UnsupportedError(f"{info.path}: model_type '{info.model_type}' is not an architecture transformers "
                           f"{transformers.__version__} knows", hint=hint)


def needs_remote_code(exc: Exception) -> bool:
    """transformers refused to run a checkpoint's custom code (trust_remote_code not given)."""
    return isinstance(exc, ValueError) and "trust_remote_code" in str(exc)


def custom_code_error(path: Path, architecture: str) -> ModelError:
    return ModelError(f"{path} needs custom code ({architecture})",
                      hint="pass --trust-remote-code if you trust the code in that directory")


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


def tied_groups(model) -> list[list[str]]:
    """Parameter names grouped by the tensor they share (a group of one for an untied parameter)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return list(groups.values())
