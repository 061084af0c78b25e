"""A plain transformers checkpoint: full precision, no quantization_config (the source model itself, a merged
LoRA, or a method whose artifact keeps every weight 16-bit). Served by vLLM, and by mlx-lm (which converts it).

The gate reads a text decoder itself from its safetensors (quantkit.eval.scorers.checkpoint_reading) and
loads anything else whole through transformers.
"""

from __future__ import annotations

from pathlib import Path

from quantkit.formats import Format, Runtime

KIND = "transformers"
# vLLM needs compute capability 7.0 (its installation guide)
RUNTIMES = (
    Runtime("vLLM: 16-bit", ("cuda",), 7.0, "vLLM docs, getting_started/installation/gpu: compute capability 7.0+"),
    Runtime("llama.cpp / transformers: 16-bit", ("cpu", "apple"), 0.0, "runs anywhere torch or llama.cpp runs"),
)


def detect(path: Path) -> bool:
    """A checkpoint directory whose config.json has no quantization method."""
    from quantkit.eval.artifacts import read_json
    from quantkit.io.checkpoint import check_model_dir, quant_method

    config = path / "config.json"
    if not config.is_file() or quant_method(read_json(config)):
        return False
    check_model_dir(path)  # every safetensors header read: a damaged checkpoint fails here
    return True


def reading(path: Path, base_dir: Path | None, trust_remote_code: bool):
    from quantkit.eval.scorers import checkpoint_reading
    from quantkit.eval.stream import streamable
    from quantkit.io.checkpoint import read_config

    if trust_remote_code or not streamable(read_config(path)):
        return None
    return checkpoint_reading(path)


def load(path: Path, base_dir: Path | None, device: str, trust_remote_code: bool):
    from quantkit.eval.artifacts import load_checkpoint

    return load_checkpoint(path, device, trust_remote_code)


def runtimes(scheme: str) -> tuple[Runtime, ...]:
    return RUNTIMES


def streams(config: dict, keeps_lm_head: bool, trust_remote_code: bool) -> bool:
    from quantkit.eval.stream import streamable

    return streamable(config) and not trust_remote_code


FORMAT = Format(
    kind=KIND, detect=detect, reading=reading, load=load, engines=("vllm", "mlx"), runtimes=runtimes,
    streams=streams,
)
