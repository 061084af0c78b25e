"""Which artifacts each engine serves on this machine, decided from config.json before any server starts.

The device: an NVIDIA GPU when `nvidia-smi` lists one (its compute capability), Apple silicon, else the
CPU. Whether an engine loads an artifact's format at all is the format's `engines`; whether it runs it on
this device is the format's `serve_refusal` (quantkit.formats: vLLM's CPU build and the compressed-tensors
schemes it refuses, bitsandbytes on NVIDIA GPUs only), from the rules measured or documented there; anything
they do not foresee is caught when the server fails to start and reported with the engine's own reason
(quantkit.serve.process).
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.errors import UnsupportedError
from quantkit.formats.compressed_tensors import quantization_config  # noqa: F401  (quantkit.serve.vllm_server)


@dataclass(frozen=True)
class Accelerator:
    kind: str  # "cpu", "cuda" or "apple"
    name: str
    capability: float = 0.0  # CUDA compute capability
    flags: frozenset[str] = field(default=frozenset(), repr=False)  # CPU feature flags (/proc/cpuinfo)

    def describe(self) -> str:
        if self.kind == "cuda":
            return f"{self.name} (CUDA, compute capability {self.capability:g})"
        return f"{self.name} ({self.kind})"


def cuda_gpu() -> Accelerator | None:
    """The first GPU `nvidia-smi` lists, None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line for line in result.stdout.splitlines() if "," in line]
    if result.returncode != 0 or not lines:
        return None
    name, capability = (part.strip() for part in lines[0].rsplit(",", 1))
    return Accelerator("cuda", name, float(capability))


def cpuinfo(key: str) -> str:
    """The first value of `key` in /proc/cpuinfo ("" where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[-1].strip() for line in lines if line.split(":")[0].strip() == key), "")


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo; none where it has none)."""
    return frozenset(cpuinfo("flags").split())


def accelerator() -> Accelerator:
    """The device the engines run on here."""
    gpu = cuda_gpu()
    if gpu is not None:
        return gpu
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return Accelerator("apple", "Apple silicon")
    name = cpuinfo("model name") or f"{platform.machine()} CPU"
    return Accelerator("cpu", name, flags=cpu_flags())


def refusal(engine: str, artifact: Path, kind: str, device: Accelerator) -> str | None:
    """Why the engine cannot serve this artifact (of format `kind`) on this device, or None."""
    from quantkit.formats import get_format
    from quantkit.serve.engines import get_engine, kinds_served

    fmt = get_format(kind)
    if engine not in fmt.engines:
        return f"{get_engine(engine).LABEL} serves {', '.join(kinds_served(engine))} artifacts; this artifact is {kind}"
    return fmt.serve_refusal(Path(artifact), device)


def check_servable(engine: str, artifact: Path, kind: str, device: Accelerator) -> None:
    """UnsupportedError (exit 2) when the engine cannot serve this artifact on this device."""
    reason = refusal(engine, artifact, kind, device)
    if reason:
        raise UnsupportedError(reason, hint=f"quantkit eval {artifact} (quantkit's own reading), or serve-check "
                                            "on a machine whose device serves this format")
