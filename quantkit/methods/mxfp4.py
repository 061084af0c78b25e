"""MXFP4 weights (W4A16) through llm-compressor's MXFP4A16 preset, saved as compressed-tensors
`mxfp4-pack-quantized`.

MXFP4 (OCP microscaling): FP4 E2M1 values in groups of 32, each group with a power-of-two E8M0 scale
(one byte), no global scale: 4.25 bits per weight. Weight-only; needs no data. vLLM serves it with its
W4A16 MXFP4 scheme through the Marlin FP4 kernel (Turing 7.5 and newer); the activations stay 16-bit.
compressed-tensors 0.19 also has a W4A4 MXFP4 preset, which vLLM runs by emulation only (dequantizing
to 16-bit) on NVIDIA GPUs: not offered.

On a mixture-of-experts checkpoint of a family with an expert layout row (Qwen3-MoE, DeepSeek-V3) it runs
model-free, by checkpoint names (quantkit.engines.llmcompressor.model_free_moe), a slab of rows at a time.

Kernel shape rules, checked before any work (naming the layer): every quantized layer's input width a
multiple of the group of 32; Marlin's tiles (output width a multiple of 64, input of 128) are shown per
layer by `quantkit inspect`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from quantkit.engines.llmcompressor import layer_resume, llmc
from quantkit.formats import compressed_tensors
from quantkit.methods import AutoRung, Layers, MethodSpec, OnRanks, QuantizeJob, QuantizeResult, Resume, Sizes, fixed_gate, nvfp4

GROUP = 32  # one E8M0 scale per 32 weights
PRESETS = {"a16": "MXFP4A16"}
# power-of-two scales round more coarsely than NVFP4's fp8 ones: the gate of a 4-bit weight-only method
DEFAULT_GATE = {"max_ppl_increase": 0.12, "max_kld": 0.12, "min_top1": 0.78}


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scheme: Literal["a16"] = "a16"
    kv_cache: llmc.KvCache = None  # fp8: calibrated per-layer FP8 k/v scales (llmc.kv_cache_scheme)
    rotate: llmc.Rotate = "none"  # rotate before quantizing: hadamard | spinquant (llmc.rotation_modifiers)


def needs_calibration(options: Options) -> bool:
    """Only a KV-cache scheme's k/v scales."""
    return options.kv_cache is not None


def precision(role: str, options: Options, name: str, shape: list[int]) -> str | None:
    if role not in nvfp4.QUANTIZED_ROLES:
        return None
    return f"mxfp4 W/g{GROUP} e8m0 scales A16{llmc.kv_suffix(options)}"


def check(info, options: Options, calibration) -> None:
    if nvfp4.moe_model_free(info, options):
        nvfp4.check_moe_model_free(info, options, "mxfp4")
        return
    nvfp4.check_dense(info, "mxfp4")
    llmc.check_rotation(info, options.rotate, "mxfp4")


def shape_problems(info, options: Options, ignore: list[str]) -> dict[str, str]:
    return nvfp4.group_width_problems(info, ignore, GROUP)


def quantize(job: QuantizeJob) -> QuantizeResult:
    if nvfp4.moe_model_free(job.info, job.options):
        from quantkit.engines.llmcompressor import model_free_moe

        scheme = model_free_moe.preset_scheme(PRESETS[job.options.scheme])
        return QuantizeResult(job.out_dir, {"preset": PRESETS[job.options.scheme],
                                            **model_free_moe.quantize(job, scheme)})
    return nvfp4.quantize_preset(job, PRESETS[job.options.scheme], needs_calibration(job.options))


def working_set(info, options: Options) -> int:
    """The model-free MoE path's slab (an MXFP4 scale belongs to one row); 0 on the oneshot path."""
    if not nvfp4.moe_model_free(info, options):
        return 0
    from quantkit.engines.llmcompressor import model_free_moe
    from quantkit.methods import ignore_patterns

    return model_free_moe.working_set_bytes(info, ignore_patterns(info, []), whole=False)


def stored_bits(options: Options) -> float:
    """4-bit values and an 8-bit E8M0 scale per group of 32."""
    return 4 + 8 / GROUP


AUTO_RUNGS = (AutoRung("mxfp4 W4A16"),)  # --method auto (quantkit.run.auto)

METHOD = MethodSpec(
    name="mxfp4", format=compressed_tensors.FORMAT, label="compressed-tensors (mxfp4-pack-quantized)",
    scheme=lambda options: "mxfp4", engine=llmc.ENGINE, options=Options, quantize=quantize, precision=precision,
    default_gate=fixed_gate(DEFAULT_GATE), check=check, needs_calibration=needs_calibration,
    needs_model=nvfp4.needs_model, support=nvfp4.fp4_support,
    layers=Layers(shape_problems=shape_problems, quantizes_fused_experts=llmc.quantizes_fused_experts),
    sizes=Sizes(stored_bits=stored_bits, working_set=working_set),
    resume=Resume(**layer_resume.resume_fields(calibrates=needs_calibration)),
    ranks=OnRanks(),
    auto=AUTO_RUNGS,
)
