"""Load an artifact back from disk the way a user would, for evaluation: the loading steps each format
uses (quantkit.formats picks them): a transformers checkpoint through `from_pretrained` (with the
compressed-tensors transforms and per-module decompression), a .gguf dequantized through gguf-py into the
base model's transformers architecture, an mlx-lm directory dequantized into its own. The evaluator never
relies on an artifact still being in memory.
"""

from __future__ import annotations

import json
from pathlib import Path

from quantkit.errors import ArtifactReloadError, ModelError


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path} is not valid JSON: {exc}",
                         hint="the file is damaged: restore it from the checkpoint's source, or write the artifact "
                              "again") from exc


def load_pretrained(path: Path, device: str = "cpu", trust_remote_code: bool = False):
    """(model, loading info, config.json) of a checkpoint directory loaded through transformers'
    `from_pretrained` (the format's own steps and the strict check follow: quantkit.formats). Custom model
    code (an `auto_map` in config.json) runs only with trust_remote_code, as for the base."""
    from quantkit.engines.transformers import auto_model_class, custom_code_error, device_map, needs_remote_code
    from quantkit.io.offline import offline

    # Same rule as loading the base: a VLM artifact loads whole (towers included) through
    # AutoModelForImageTextToText; the evaluator feeds it text-only token windows.
    config = json.loads((path / "config.json").read_text())
    try:
        with offline():
            model, loading = auto_model_class(config).from_pretrained(
                path, local_files_only=True, device_map=device_map(device), trust_remote_code=trust_remote_code,
                output_loading_info=True)
    except ValueError as exc:
        if needs_remote_code(exc):
            raise custom_code_error(path, (config.get("architectures") or ["unknown"])[0]) from exc
        raise
    return model, loading, config


def load_checkpoint(path: Path, device: str = "cpu", trust_remote_code: bool = False):
    """A plain or bitsandbytes checkpoint loaded whole through transformers, strictly (check_strict_reload)."""
    model, loading, _config = load_pretrained(path, device, trust_remote_code)
    check_strict_reload(path, loading)
    return model.eval()


def online_transforms(config: dict):
    """The online part of a compressed-tensors artifact's transform config (compressed-tensors'
    TransformConfig: the rotations the loader applies at run time, such as a Hadamard rotation of a
    Linear's input); None when there is none. The weight parts are fused into the stored weights already."""
    from compressed_tensors.transform import TransformConfig

    raw = (config.get("quantization_config") or {}).get("transform_config") or {}
    groups = {}
    for name, scheme in TransformConfig.model_validate(raw).config_groups.items() if raw else ():
        online = [args for args in scheme.apply if args.is_online()]
        if online:
            groups[name] = scheme.model_copy(update={"apply": online})
    return TransformConfig(config_groups=groups) if groups else None


def apply_online_transforms(model, path: Path, config: dict, loading: dict) -> dict:
    """Attach the artifact's online transforms to the loaded model as vLLM's loader does (transformers 5 drops
    the transform config): compressed-tensors' apply_transform_config builds them, and their stored
    matrices are loaded into them. Returns `loading` without the transform tensors it read."""
    from compressed_tensors.transform import apply_transform_config

    from quantkit.io.checkpoint import SafetensorsWeights

    transforms = online_transforms(config)
    if transforms is None:
        return loading
    apply_transform_config(model, transforms)
    params = dict(model.named_parameters(remove_duplicate=False))
    stored = SafetensorsWeights(path)
    read = [name for name in loading.get("unexpected_keys") or [] if name in params]
    for name in read:
        params[name].data.copy_(stored.get(name))
    return {**loading, "unexpected_keys": [k for k in loading.get("unexpected_keys") or [] if k not in read]}


def decompress_per_module(model) -> None:
    """Keep a compressed-tensors model compressed in memory and decompress each quantized module
    only while it runs.

    transformers leaves the loaded weights compressed and decompresses the whole model on the first
    forward (a hook that calls compressed-tensors' decompress_model): the gate then held the whole
    model in 16 bits, more than the model it measures. This replaces that hook with one per module
    doing the same thing for one module (compressed-tensors' own decompress_module) before its
    forward, and putting the compressed tensors back after it, so memory holds the 4-8 bit model
    plus one 16-bit module. The numbers are the same: the same decompression, the same quantized
    forward wrapper on a module in the same DECOMPRESSED state."""
    from compressed_tensors.compressors.base import decompress_module
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils import is_module_quantized
    from compressed_tensors.utils.module import get_direct_state_dict, replace_direct_state_dict

    model.hf_quantizer.compressor.remove_decompression_hook(model)  # transformers' quantizer for this model
    compressed: dict[int, dict] = {}
    dtype = model.config.dtype  # compressed-tensors 0.19 decompresses NVFP4 to bfloat16 whatever the checkpoint's

    def decompress(module, _args):
        compressed[id(module)] = get_direct_state_dict(module)
        decompress_module(module)
        weight = getattr(module, "weight", None)  # an attention module quantized for its KV cache has none
        if weight is not None and weight.dtype != dtype:
            weight.data = weight.data.to(dtype)

    def recompress(module, _args, output):
        replace_direct_state_dict(module, compressed.pop(id(module)))
        module.quantization_status = QuantizationStatus.COMPRESSED
        return output

    for module in model.modules():
        if is_module_quantized(module):
            module.register_forward_pre_hook(decompress)
            module.register_forward_hook(recompress)


def decompressed_weight(module):
    """The weight one module's forward sees: a compressed-tensors module is decompressed (its own
    decompress_module) for the copy and left compressed; any other module's weight as it is."""
    from compressed_tensors.compressors.base import decompress_module
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils import is_module_quantized
    from compressed_tensors.utils.module import get_direct_state_dict, replace_direct_state_dict

    if not is_module_quantized(module) or module.quantization_status != QuantizationStatus.COMPRESSED:
        return module.weight.detach().clone()
    compressed = get_direct_state_dict(module)
    decompress_module(module)
    weight = module.weight.detach().clone()
    replace_direct_state_dict(module, compressed)
    module.quantization_status = QuantizationStatus.COMPRESSED
    return weight


def check_strict_reload(path: Path, loading: dict) -> None:
    """Every tensor of the artifact loads into the model transformers builds for it, and every
    parameter comes from the artifact: else a user's reload would run with weights filled at
    random (ArtifactReloadError, exit 3)."""
    problems = {what: sorted(str(k) for k in loading.get(key) or [])
                for key, what in (("missing_keys", "missing"), ("unexpected_keys", "unexpected"),
                                  ("mismatched_keys", "of the wrong shape"))}
    found = {what: names for what, names in problems.items() if names}
    if found:
        detail = "; ".join(f"{len(names)} {what} ({', '.join(names[:3])})" for what, names in found.items())
        raise ArtifactReloadError(f"the written artifact does not reload strictly in transformers: {detail}",
                                  hint="the method wrote tensors under names transformers does not expect; "
                                  "nothing was written")


def load_gguf_into_base(path: Path, base_dir: Path, device: str = "cpu", trust_remote_code: bool = False):
    """Dequantize every GGUF tensor (gguf-py) and load it into the base architecture; a VLM's
    language model goes into the whole base VLM (its towers are the base's: the .gguf lacks them)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.engines.transformers import device_map
    from quantkit.gguf.convert import reading_config
    from quantkit.gguf.loader import to_hf_state_dict
    from quantkit.arch.vlm import is_vlm

    config = AutoConfig.from_pretrained(base_dir, local_files_only=True,  # config.json only: no hub lookup
                                        trust_remote_code=trust_remote_code)
    state = to_hf_state_dict(path, reading_config(base_dir, config.to_dict()))
    if is_vlm(config.to_dict()):
        return vlm_with(base_dir, state, path, trust_remote_code).to(device_map(device)).eval()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing = set(model.state_dict()) - set(state)
    missing = {m for m in missing if "rotary_emb" not in m}
    if missing:
        raise ModelError(f"{path.name} lacks tensors for {sorted(missing)[:3]} (and {max(0, len(missing) - 3)} more)",
                         hint="the artifact is incomplete or for another model: write it again with quantkit quantize")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return materialize_buffers(model, config).to(device_map(device)).eval()


def vlm_with(base_dir: Path, state: dict, path: Path, trust_remote_code: bool = False):
    """The base VLM (float32) with the GGUF's language model loaded over it. Every GGUF tensor
    must land on a parameter, and every parameter the GGUF does not give must be a tower's."""
    import torch

    from quantkit.engines.transformers import auto_model_class
    from quantkit.io.checkpoint import check_model_dir

    info = check_model_dir(Path(base_dir))
    model = auto_model_class(info.config).from_pretrained(base_dir, local_files_only=True, dtype=torch.float32,
                                                          trust_remote_code=trust_remote_code)
    loading = model.load_state_dict(state, strict=False)
    missing = [m for m in loading.missing_keys if not info.towers.role(m) and "rotary_emb" not in m]
    if loading.unexpected_keys or missing:
        names = sorted(loading.unexpected_keys)[:3] + sorted(missing)[:3]
        raise ModelError(f"{path.name} does not match the language model of {base_dir}: "
                         f"{len(loading.unexpected_keys)} unexpected, {len(missing)} missing ({', '.join(names)})",
                         hint="pass --against the base this .gguf was converted from")
    model.tie_weights()
    return model


def rebuild_rotary(model) -> None:
    """Rotary modules whose frequencies are still on meta and that keep one buffer set per layer
    type (Gemma 3's sliding_attention_inv_freq / full_attention_inv_freq): built again on the CPU."""
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            meta = [b for b in child.buffers(recurse=False) if b.is_meta]
            if meta and type(child).__name__.endswith("RotaryEmbedding") and "inv_freq" not in dict(
                    child.named_buffers(recurse=False)):
                setattr(parent, child_name, type(child)(child.config))


def materialize_buffers(model, config):
    """Non-persistent buffers (rotary frequencies, embedding scales) stay on meta after a
    meta-device build; recompute them."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rebuild_rotary(model)
    for module in model.modules():
        if hasattr(module, "inv_freq") and getattr(module.inv_freq, "is_meta", False) and own_rotary(module):
            continue
        if hasattr(module, "inv_freq") and getattr(module.inv_freq, "is_meta", False):
            init = getattr(module, "rope_init_fn", None)
            if init is None:
                rope_type = getattr(module, "rope_type", "default")
                init = module.compute_default_rope_parameters if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]
            inv_freq, scaling = init(module.config, "cpu")
            module.register_buffer("inv_freq", inv_freq, persistent=False)
            module.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
            module.attention_scaling = scaling
        scale = getattr(module, "embed_scale", None)  # Gemma's scaled embedding (sqrt(hidden))
        if getattr(scale, "is_meta", False):
            module.register_buffer("embed_scale", torch.tensor(module.scalar_embed_scale), persistent=False)
    return model


def own_rotary(module) -> bool:
    """A rotary module of a dynamic RoPE with an NTK `alpha` (Hunyuan's: base = rope_theta * alpha ** (d / (d - 2))),
    which its class computes itself and transformers' ROPE_INIT_FUNCTIONS["dynamic"] does not: its buffers taken
    from a copy of the class built on the CPU. False for every other RoPE (the RoPE functions give them)."""
    import torch

    rope = getattr(module.config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "dynamic" or rope.get("alpha") is None:
        return False
    with torch.device("cpu"):
        fresh = type(module)(module.config)
    for name in ("inv_freq", "original_inv_freq"):
        module.register_buffer(name, getattr(fresh, name), persistent=False)
    module.attention_scaling = fresh.attention_scaling
    return True
