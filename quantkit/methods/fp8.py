"""FP8 E4M3 through llm-compressor, saved as compressed-tensors `float-quantized`.

fp8-dynamic: per-channel weight scales, dynamic per-token activation scales; needs no data.
fp8-static:  per-channel weight scales, one static activation scale per tensor from calibration.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from quantkit.methods import MethodSpec, QuantizeJob, QuantizeResult, fixed_gate, llmc, moe

# FP8 E4M3 is near-lossless on trained models: hold it to a tight gate.
DEFAULT_GATE = {"max_ppl_increase": 0.02, "max_kld": 0.01, "min_top1": 0.95}


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scheme: Literal["fp8-dynamic", "fp8-static"] = "fp8-dynamic"
    quantize_lm_head: bool = False


def needs_calibration(options: Options) -> bool:
    return options.scheme == "fp8-static"


def precision(role: str, options: Options, name: str, shape: list[int]) -> str | None:
    if role in ("decoder", "other") or (role == "lm_head" and options.quantize_lm_head):
        return "fp8-e4m3 W/channel A/token" if options.scheme == "fp8-dynamic" else "fp8-e4m3 W/channel A/static"
    return None


def scheme_config(options: Options) -> dict:
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    if options.scheme == "fp8-static":
        activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                       "strategy": "tensor", "observer": "minmax"}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "channel"}
    return {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}}


def check(info, options: Options, calibration) -> None:
    moe.check_supported(info, "fp8")
    moe.check_expert_storage(info, "fp8", "fp8-static stores a static activation scale per expert"
                             if options.scheme == "fp8-static" else None, hint="use scheme fp8-dynamic")


def keeps_lm_head(options: Options) -> bool:
    return not options.quantize_lm_head


def quantize(job: QuantizeJob) -> QuantizeResult:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    modifier = QuantizationModifier(config_groups=scheme_config(job.options), ignore=llmc.decoder_ignore(job))
    details = llmc.calibration_details(job) if needs_calibration(job.options) else {}
    llmc.run_oneshot(job, modifier, calibrate=needs_calibration(job.options))
    llmc.save_compressed(job)
    return QuantizeResult(job.out_dir, details)


METHOD = MethodSpec(
    quantizes_towers=True, name="fp8", engine=llmc.ENGINE, engine_package=llmc.ENGINE,
    format="compressed-tensors (float-quantized, float8_e4m3fn)",
    options=Options, quantize=quantize, precision=precision, default_gate=fixed_gate(DEFAULT_GATE),
    check=check, needs_calibration=needs_calibration, keeps_lm_head=keeps_lm_head,
)

