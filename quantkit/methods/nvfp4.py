"""NVFP4 through llm-compressor's presets, saved as compressed-tensors `nvfp4-pack-quantized`.

NVFP4: FP4 E2M1 values in groups of 16, each group with an FP8 E4M3 scale, and one FP32 global scale
per tensor (compressed-tensors' `tensor_group` strategy); about 4.5 bits per weight with its scales.

w4a4 (default): llm-compressor's NVFP4 preset. Weights as above; input activations quantized to FP4
             at run time per group of 16 with a calibrated FP32 global scale per layer
             (`input_global_scale`, from the calibration windows). vLLM runs W4A4 on Blackwell
             (compute capability 10.0 / 12.0: CUTLASS / FlashInfer FP4 GEMM); on older GPUs it loads
             the artifact as weight-only NVFP4 through Marlin FP4 (the activations stay 16-bit there).
a16:         llm-compressor's NVFP4A16 preset: the weights only (no data needed); served by Marlin FP4
             on Turing (7.5) and newer. On a mixture-of-experts checkpoint of a family with an expert
             layout row (Qwen3-MoE, DeepSeek-V3) it runs model-free, by checkpoint names
             (quantkit.engines.llmcompressor.model_free_moe): an expert's gate and up share one global scale.

The gate measures what vLLM computes on Blackwell: transformers loads the artifact through
compressed-tensors, whose forward fake-quantizes each quantized layer's input with the stored global
scale, as the W4A4 kernels do.

Kernel shape rules, checked before any work (`shape_problems`: such a layer stays 16-bit, or is refused
with --strict-shapes): every quantized
layer's input width must be a multiple of the group of 16 (both kernels); the Marlin FP4 kernel also
needs the output width a multiple of 64 and the input width a multiple of 128, which `quantkit inspect`
shows per layer (a layer Marlin cannot take runs only where the W4A4 kernels do).

Also home of what the FP4 methods (nvfp4, mxfp4) share: the preset's modifier, the group-width check.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from quantkit.arch import moe
from quantkit.engines.llmcompressor import layer_resume, llmc
from quantkit.formats import compressed_tensors
from quantkit.methods import AutoRung, Layers, MethodSpec, OnRanks, QuantizeJob, QuantizeResult, Resume, Sizes
from quantkit.mixed import layers as intmix

GROUP = compressed_tensors.NVFP4_GROUP  # one FP8 scale per 16 weights (and per 16 activations for w4a4)
PRESETS = {"w4a4": "NVFP4", "a16": "NVFP4A16"}  # scheme -> llm-compressor / compressed-tensors preset
QUANTIZED_ROLES = ("decoder", "other")
# FP4 weights cost more than int4 with GPTQ's error feedback; W4A4 adds the activations' rounding.
GATES = {"a16": {"max_ppl_increase": 0.10, "max_kld": 0.10, "min_top1": 0.80},
         "w4a4": {"max_ppl_increase": 0.15, "max_kld": 0.15, "min_top1": 0.75}}


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scheme: Literal["w4a4", "a16"] = "w4a4"
    kv_cache: llmc.KvCache = None  # fp8: calibrated per-layer FP8 k/v scales (llmc.kv_cache_scheme)
    rotate: llmc.Rotate = "none"  # rotate before quantizing: hadamard | spinquant (llmc.rotation_modifiers)


def needs_calibration(options: Options) -> bool:
    """w4a4's activation global scales, and a KV-cache scheme's k/v scales."""
    return options.scheme == "w4a4" or options.kv_cache is not None


def precision(role: str, options: Options, name: str, shape: list[int]) -> str | None:
    if role not in QUANTIZED_ROLES:
        return None
    activations = "A/fp4 g16 (calibrated global scale)" if options.scheme == "w4a4" else "A16"
    return f"nvfp4 W/g{GROUP} fp8 scales + global {activations}{llmc.kv_suffix(options)}"


def default_gate(options: Options) -> dict[str, float]:
    return dict(GATES[options.scheme])


# ---------------------------------------------------------------- shared by the FP4 methods


def width_problem(name: str, shape: list[int], group: int) -> str | None:
    """Why a Linear ([out, in]) cannot be stored in groups of `group` along its input, None when it can."""
    return f"{name}: input width {shape[1]} is not a multiple of the group of {group}" if shape[1] % group else None


def group_width_problems(info, ignore: list[str], group: int) -> dict[str, str]:
    """Every Linear the target quantizes (the run's ignore list left out) whose input width the format's
    groups do not divide, with why."""
    found = {name: width_problem(name, list(shape), group)
             for name, shape in intmix.quantized_layers(info, ignore, QUANTIZED_ROLES).items()}
    return {name: f"{why} (vLLM's kernels need it)" for name, why in found.items() if why}


def check_dense(info, method: str) -> None:
    """An MoE family without an expert layout is refused before any work (quantkit.arch.moe.check_supported)."""
    moe.check_supported(info, method)


def preset_modifier(preset: str, ignore: list[str], kv_cache: str | None):
    """llm-compressor's QuantizationModifier with a preset scheme over every Linear, as its examples write it."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return QuantizationModifier(targets=["Linear"], scheme=preset, ignore=ignore,
                                kv_cache_scheme=llmc.kv_cache_scheme(kv_cache))


def quantize_preset(job: QuantizeJob, preset: str, calibrate: bool) -> QuantizeResult:
    """oneshot of the preset on the loaded model (calibrated when `calibrate`), saved compressed."""
    details = llmc.calibration_details(job) if calibrate else {}
    llmc.run_oneshot(job, preset_modifier(preset, llmc.decoder_ignore(job), job.options.kv_cache),
                     calibrate=calibrate)
    llmc.save_compressed(job)
    return QuantizeResult(job.out_dir, {"preset": preset, **details})


def fp4_support(family) -> str:
    if moe.expert_checkpoint(family.model_type) and not family.is_vlm:
        return "✅ weights only model-free; w4a4 on the loaded model"
    return family.decoder_support("✅")


def support(family) -> str:
    return family.expert_reload_refusal("NVFP4's global scales") or fp4_support(family)


# ---------------------------------------------------------------- nvfp4


def moe_model_free(info, options) -> bool:
    """A weight-only FP4 scheme on an MoE checkpoint with an expert layout row: quantized model-free, by
    checkpoint names (w4a4's activation scales need the loaded model)."""
    return (getattr(options, "scheme", "a16") == "a16" and bool(moe.expert_count(info.config))
            and moe.expert_checkpoint(info.model_type) is not None)


def check_moe_model_free(info, options, method: str) -> None:
    from quantkit.engines.llmcompressor import model_free_moe

    model_free_moe.check(info, method, {"--kv-cache": options.kv_cache is not None,
                                        "--rotate": options.rotate != "none"})


def needs_model(info, options) -> bool:
    return not moe_model_free(info, options)


def working_set(info, options) -> int:
    """The model-free MoE path's largest piece (an NVFP4 weight or fused set, whole: its global scale); 0 on
    the oneshot path."""
    if not moe_model_free(info, options):
        return 0
    from quantkit.engines.llmcompressor import model_free_moe
    from quantkit.methods import ignore_patterns

    return model_free_moe.working_set_bytes(info, ignore_patterns(info, []), whole=True)


def check(info, options: Options, calibration) -> None:
    if moe_model_free(info, options):
        check_moe_model_free(info, options, "nvfp4")
        return
    moe.check_vlm_expert_reload(info, "nvfp4", "NVFP4's global scales",
                                "use --method mxfp4 or fp8 for this VLM, or nvfp4 on its language model alone")
    check_dense(info, "nvfp4")
    llmc.check_rotation(info, options.rotate, "nvfp4")


def shape_problems(info, options: Options, ignore: list[str]) -> dict[str, str]:
    return group_width_problems(info, ignore, GROUP)


def quantize(job: QuantizeJob) -> QuantizeResult:
    if moe_model_free(job.info, job.options):
        from quantkit.engines.llmcompressor import model_free_moe

        scheme = model_free_moe.preset_scheme(PRESETS[job.options.scheme])
        return QuantizeResult(job.out_dir, {"preset": PRESETS[job.options.scheme],
                                            **model_free_moe.quantize(job, scheme)})
    return quantize_preset(job, PRESETS[job.options.scheme], needs_calibration(job.options))


def stored_bits(options: Options) -> float:
    """4-bit values and an 8-bit scale per group of 16 (the per-tensor global scale is negligible)."""
    return 4 + 8 / GROUP


def scheme(options: Options) -> str:
    """compressed-tensors' nvfp4 (W4A4) or nvfp4-a16 (weights only: Marlin FP4 on every GPU generation)."""
    return "nvfp4" if options.scheme == "w4a4" else "nvfp4-a16"


AUTO_RUNGS = (AutoRung("nvfp4 W4A4", (("scheme", "w4a4"),)), AutoRung("nvfp4 W4A16", (("scheme", "a16"),)))

METHOD = MethodSpec(
    name="nvfp4", format=compressed_tensors.FORMAT, label="compressed-tensors (nvfp4-pack-quantized)", scheme=scheme,
    engine=llmc.ENGINE, options=Options, quantize=quantize, precision=precision, default_gate=default_gate,
    check=check, needs_calibration=needs_calibration, needs_model=needs_model, support=support,
    layers=Layers(shape_problems=shape_problems, quantizes_fused_experts=llmc.quantizes_fused_experts),
    sizes=Sizes(stored_bits=stored_bits, working_set=working_set),
    resume=Resume(**layer_resume.resume_fields(calibrates=needs_calibration)),
    ranks=OnRanks(),
    auto=AUTO_RUNGS,
)
