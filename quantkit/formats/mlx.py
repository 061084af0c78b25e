"""MLX: an mlx-lm directory (affine-quantized safetensors and a config.json with a `quantization` block),
written by quantkit's own writer (quantkit.mlx), served by mlx-lm on Apple silicon and on a CPU.

The gate dequantizes each weight exactly as mlx.core.dequantize does, into the model's transformers
architecture, and computes in the dtype its scales are stored in (quantkit.eval.scorers.mlx_reading).
"""

from __future__ import annotations

from pathlib import Path

from quantkit.formats import Format, Runtime

KIND = "mlx"
MLX_SOURCE = "mlx docs: Metal on Apple silicon, and a CPU backend on Linux (the mlx-cpu package)"
RUNTIMES = (
    Runtime("mlx-lm: Metal", ("apple",), 0.0, MLX_SOURCE),
    Runtime("mlx-lm: CPU", ("cpu",), 0.0, MLX_SOURCE),
)


def detect(path: Path) -> bool:
    from quantkit.eval.artifacts import read_json
    from quantkit.mlx.checkpoint import is_mlx_dir

    config = path / "config.json"
    return path.is_dir() and config.is_file() and is_mlx_dir(read_json(config))


def reading(path: Path, base_dir: Path | None, trust_remote_code: bool):
    from quantkit.eval.scorers import mlx_reading

    return mlx_reading(path)


def load(path: Path, base_dir: Path | None, device: str, trust_remote_code: bool):
    from quantkit.eval.scorers import load_mlx

    return load_mlx(path, device)


def runtimes(scheme: str) -> tuple[Runtime, ...]:
    return RUNTIMES


def serve_command(path: str) -> str:
    return f'mlx_lm.generate --model {path} --prompt "Hello" (or: mlx_lm.server --model {path})'


def streams(config: dict, keeps_lm_head: bool, trust_remote_code: bool) -> bool:
    return True  # read by quantkit's own loader, whatever the model


FORMAT = Format(
    kind=KIND, detect=detect, reading=reading, load=load, library="mlx", engines=("mlx",), runtimes=runtimes,
    serve_command=serve_command, streams=streams,
)
