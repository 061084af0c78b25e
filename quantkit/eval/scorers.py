"""The Scorer of each thing the gate measures: the full-precision base and every artifact kind.

A .gguf, an mlx-lm directory, a full-precision text decoder and a compressed-tensors text decoder
(quantkit.eval.compressed.streams) are streamed layer by layer (quantkit.eval.stream); a
bitsandbytes checkpoint (restored by its engine's own modules), a VLM, custom model code and any
other compressed-tensors artifact load whole through transformers (quantkit.eval.artifacts).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from quantkit.eval.evaluate import (
    Baseline,
    LogitsFn,
    Metrics,
    ScoredChunk,
    Scorer,
    compare,
    model_logits_fn,
    model_scorer,
)
from quantkit.eval.stream import ACTIVATION_BYTES, stream_model, streamable, streamed_logits, streamed_scorer
from quantkit.io.checkpoint import SafetensorsWeights


def checkpoint_scorer(model_dir: Path, dtype: str = "auto", device: str = "cpu",
                      activation_bytes: int = ACTIVATION_BYTES, workdir: Path | None = None) -> Scorer:
    """A full-precision checkpoint streamed from its safetensors, in `dtype` ('auto': the stored
    dtype, as quantkit.engines.transformers.load_model and from_pretrained load it)."""
    from quantkit.engines.transformers import device_map, hf_config, torch_dtype
    from quantkit.io.checkpoint import check_model_dir

    info = check_model_dir(Path(model_dir))
    config = hf_config(model_dir)  # streamed only without trust_remote_code
    return streamed_scorer(config, SafetensorsWeights(model_dir), torch_dtype(dtype, info), device_map(device),
                           activation_bytes, workdir)


def gguf_scorer(path: Path, base_dir: Path, device: str = "cpu", activation_bytes: int = ACTIVATION_BYTES,
                workdir: Path | None = None) -> Scorer:
    """A .gguf in the base's architecture, dequantized a tensor at a time, computed in float32
    (as artifacts.load_gguf_into_base does)."""
    import torch

    from quantkit.engines.transformers import device_map, hf_config
    from quantkit.gguf.loader import GGUFTensors

    config = hf_config(base_dir)  # streamed only without trust_remote_code
    return streamed_scorer(config, GGUFTensors(path, config.to_dict()), torch.float32, device_map(device),
                           activation_bytes, workdir)


def mlx_scorer(path: Path, device: str = "cpu", activation_bytes: int = ACTIVATION_BYTES,
               workdir: Path | None = None) -> Scorer:
    """An mlx-lm directory in its transformers architecture, each quantized weight dequantized exactly as
    mlx.core.dequantize does, computed in the dtype its scales are stored in (as mlx-lm computes)."""
    import torch

    from quantkit.engines.transformers import device_map
    from quantkit.mlx.checkpoint import MLXWeights

    weights = MLXWeights(path)
    return streamed_scorer(weights.transformers_config(), weights, getattr(torch, weights.stored_dtype()), device_map(device),
                           activation_bytes, workdir)


def loaded_scorer(path: Path, base_dir: Path | None, device: str = "cpu", trust_remote_code: bool = False) -> Scorer:
    """The artifact loaded whole when scoring starts and dropped when it ends (evaluate.model_scorer)."""
    from quantkit.eval.artifacts import load_for_eval
    from quantkit.eval.evaluate import model_scorer

    def scorer(windows) -> Iterator[ScoredChunk]:
        yield from model_scorer(load_for_eval(path, base_dir, device, trust_remote_code))(windows)

    return scorer


def artifact_scorer(path: Path, base_dir: Path | None = None, device: str = "cpu",
                    trust_remote_code: bool = False, workdir: Path | None = None) -> Scorer:
    """A Scorer for any artifact quantkit evaluates: a .gguf, a full-precision text decoder and a
    compressed-tensors text decoder (quantkit.eval.compressed.streams) are streamed layer by layer; a
    bitsandbytes checkpoint (restored by its engine's own modules), a VLM, custom model code and
    any other compressed-tensors artifact load whole through transformers."""
    from quantkit.errors import InputError
    from quantkit.eval import compressed
    from quantkit.eval.artifacts import artifact_kind, gguf_file
    from quantkit.io.checkpoint import is_vlm, read_config

    kind = artifact_kind(path)
    if kind == "mlx":
        return mlx_scorer(path, device, workdir=workdir)
    if kind == "gguf":
        if base_dir is None:
            raise InputError("evaluating a .gguf needs the base checkpoint", hint="pass --against BASE_DIR")
        if is_vlm(read_config(Path(base_dir))):  # the language model goes into the whole base (its towers)
            return loaded_scorer(path, base_dir, device, trust_remote_code)
        return gguf_scorer(gguf_file(path), base_dir, device, workdir=workdir)
    if kind == "transformers" and streamable(read_config(path)) and not trust_remote_code:
        return checkpoint_scorer(path, "auto", device, workdir=workdir)
    if kind == "compressed-tensors" and not trust_remote_code and compressed.streams(path):
        return compressed.compressed_scorer(path, device, workdir=workdir)
    return loaded_scorer(path, base_dir, device, trust_remote_code)


def evaluate_artifact(artifact: Path, base_dir: Path, windows, baseline: Baseline, device: str = "cpu",
                      trust_remote_code: bool = False, workdir: Path | None = None) -> Metrics:
    """Read an artifact back from disk the way a user would and measure it against the baseline.

    The one measuring step shared by the pipeline's gate and `quantkit eval`: a .gguf, a
    full-precision text decoder and a compressed-tensors text decoder are streamed layer by layer,
    the rest loads through transformers (artifact_scorer).
    """
    return compare(artifact_scorer(artifact, base_dir, device, trust_remote_code, workdir), windows, baseline)


def base_scorer(info, dtype: str = "auto", device: str = "cpu", trust_remote_code: bool = False,
                workdir: Path | None = None) -> Scorer:
    """The full-precision base: streamed from its safetensors where the streamed forward applies
    (a text decoder), else loaded whole for the duration of the scoring (a VLM, remote code)."""
    if streamable(info.config) and not trust_remote_code:
        return checkpoint_scorer(info.path, dtype, device, workdir=workdir)

    def scorer(windows):
        from quantkit.engines.transformers import load_model

        yield from model_scorer(load_model(info, dtype, device, trust_remote_code))(windows)

    return scorer


# ------------------------------------------------------------------ logits functions (tasks, generation)


def artifact_logits(path: Path, base_dir: Path | None = None, device: str = "cpu", trust_remote_code: bool = False,
                    workdir: Path | None = None) -> LogitsFn:
    """The artifact's forward as a logits function, built the way artifact_scorer reads it (the same
    streamed or loaded model): for lm-eval's tasks and greedy generations (quantkit.eval.tasks)."""
    import torch

    from quantkit.engines.transformers import device_map, hf_config, torch_dtype
    from quantkit.errors import InputError
    from quantkit.eval import compressed
    from quantkit.eval.artifacts import artifact_kind, gguf_file, load_for_eval
    from quantkit.gguf.loader import GGUFTensors
    from quantkit.io.checkpoint import check_model_dir, is_vlm, read_config

    kind = artifact_kind(path)
    if kind == "gguf" and base_dir is None:
        raise InputError("evaluating a .gguf needs the base checkpoint", hint="pass --against BASE_DIR")
    if kind == "gguf" and not is_vlm(read_config(Path(base_dir))):
        config = hf_config(base_dir)
        streamed = stream_model(config, GGUFTensors(gguf_file(path), config.to_dict()), torch.float32,
                                device_map(device))
        return streamed_logits_fn(streamed, workdir)
    if kind == "transformers" and streamable(read_config(path)) and not trust_remote_code:
        config = hf_config(path)
        streamed = stream_model(config, SafetensorsWeights(path), torch_dtype("auto", check_model_dir(path)),
                                device_map(device))
        return streamed_logits_fn(streamed, workdir)
    if kind == "compressed-tensors" and not trust_remote_code and compressed.streams(path):
        config = hf_config(path)
        dtype = torch_dtype("auto", check_model_dir(path))
        return streamed_logits_fn(compressed.compressed_model(path, config, dtype, device_map(device)), workdir)
    return model_logits_fn(load_for_eval(path, base_dir, device, trust_remote_code))


def base_logits(info, dtype: str = "auto", device: str = "cpu", trust_remote_code: bool = False,
                workdir: Path | None = None) -> LogitsFn:
    """The full-precision base's forward as a logits function, built the way base_scorer reads it."""
    from quantkit.engines.transformers import device_map, hf_config, load_model, torch_dtype

    if streamable(info.config) and not trust_remote_code:
        streamed = stream_model(hf_config(info.path), SafetensorsWeights(info.path), torch_dtype(dtype, info),
                                device_map(device))
        return streamed_logits_fn(streamed, workdir)
    return model_logits_fn(load_model(info, dtype, device, trust_remote_code))


def streamed_logits_fn(streamed, workdir: Path | None) -> LogitsFn:
    return lambda ids: streamed_logits(streamed, ids, workdir)


# ------------------------------------------------------------------ the KV cache's own damage


def kv_cache_scheme(artifact: Path) -> dict | None:
    """The compressed-tensors kv_cache_scheme of an artifact's config.json, None without one."""
    import json

    config_file = Path(artifact) / "config.json"
    if not config_file.is_file():
        return None
    return (json.loads(config_file.read_text()).get("quantization_config") or {}).get("kv_cache_scheme")


def kv_attention_modules(model) -> list:
    """The attention modules whose keys and values compressed-tensors quantizes (they hold k_scale)."""
    return [module for module in model.modules() if hasattr(module, "k_scale") and hasattr(module, "v_scale")]


def kv_only_metrics(artifact: Path, windows, device: str = "cpu", trust_remote_code: bool = False) -> Metrics:
    """The KV-cache quantization's own damage: the artifact loaded whole through transformers, measured
    against itself with the KV quantization switched off (the same weights and activations). The keys
    and values are fake-quantized by compressed-tensors' own forward (QuantizedKVCache with the stored
    k_scale / v_scale), as vLLM's fp8 KV cache stores them."""
    from quantkit.errors import InternalError
    from quantkit.eval.artifacts import load_for_eval
    from quantkit.eval.evaluate import compute_baseline

    model = load_for_eval(artifact, None, device, trust_remote_code)
    attention = kv_attention_modules(model)
    if not attention:
        raise InternalError(f"{artifact}: a kv_cache_scheme but no attention module with k_scale/v_scale")
    for module in attention:
        module.quantization_enabled = False
    without = compute_baseline(model_scorer(model), windows)
    for module in attention:
        module.quantization_enabled = True
    return compare(model_scorer(model), windows, without)
