"""Helpers shared by tests."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Small calibration for speed. The micro model is barely trained, so its next-token
# distributions are flat and top-1 flips on near-ties even when KLD is ~5e-4: loosen only
# top-1 (a later --min-top1 on the same command line wins).
FAST_CALIB = ("--num-samples", "4", "--seq-len", "64", "--eval-windows", "4", "--min-top1", "0.8")


def leftovers(parent, name: str) -> list[str]:
    """Anything at or beside OUT that a failed run could have left (OUT itself or staging dirs)."""
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))


@contextlib.contextmanager
def sleeping_child():
    """The pid of a live process (a sleeping child), killed and reaped on exit."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def subprocess_env(**extra: str) -> dict:
    """Environment for `python -m quantkit` subprocesses: this checkout's quantkit first."""
    pythonpath = os.pathsep.join(p for p in (str(REPO), extra.pop("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": pythonpath, **extra}


def sharpen(src: Path, dst: Path, channels: int = 4, factor: float = 16.0, logit_scale: float = 8.0) -> Path:
    """A copy of a Llama checkpoint that quantization visibly hurts, in float32: the final norm scaled by
    `logit_scale` (peaked next-token distributions), and `channels` input channels of every attention
    block carrying `factor` x activations against 1/factor weight columns (function preserving, as
    scripts/train_reference_model.py does)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = {k: v.float() for k, v in load_file(src / "model.safetensors").items()}
    state["model.norm.weight"] *= logit_scale
    config = json.loads((src / "config.json").read_text())
    hidden = config["hidden_size"]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        picked = torch.randperm(hidden, generator=torch.Generator().manual_seed(layer))[:channels]
        state[prefix + "input_layernorm.weight"][picked] *= factor
        for proj in ("q_proj", "k_proj", "v_proj"):
            state[f"{prefix}self_attn.{proj}.weight"][:, picked] /= factor
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    return dst
