"""SmoothQuant W8A8 int8 through llm-compressor, saved as compressed-tensors `int-quantized`.

SmoothQuant moves activation outliers into the weights: per input channel j,
s_j = max|X_j|^alpha / max|W_j|^(1-alpha); the preceding norm's weight is divided by s and the
following linears' weight columns multiplied by s (mathematically a no-op). Then int8 weights
(per output channel, symmetric; GPTQ or round-to-nearest) and int8 activations quantized
dynamically per token at run time. Served by vLLM on any GPU with int8 tensor cores.

alpha (`smoothing_strength`) defaults to 0.8: the value of llm-compressor's W8A8 example and
close to the SmoothQuant authors' tuned values for Llama-2/3 (0.85) and Mistral (0.8). The
SmoothQuant/llm-compressor generic default is 0.5; lower it for models whose activations
have few outliers.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from quantkit.errors import InputError
from quantkit.methods import MethodSpec, QuantizeJob, QuantizeResult, fixed_gate, gptq, llmc, moe
from quantkit.methods.mappings import Mapping, model_mappings

# int8 weights and per-token int8 activations are near-lossless on trained models: tight gate.
DEFAULT_GATE = {"max_ppl_increase": 0.03, "max_kld": 0.02, "min_top1": 0.93}


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    smoothing_strength: float = 0.8
    weight_algorithm: Literal["gptq", "rtn"] = "gptq"
    dampening: float = 0.01  # GPTQ only


def needs_calibration(options: Options) -> bool:
    return True


def precision(role: str, options: Options, name: str, shape: list[int]) -> str | None:
    if role not in gptq.QUANTIZED_ROLES:
        return None
    return f"int8 W per-channel ({options.weight_algorithm.upper()}) + A per-token dynamic (SmoothQuant)"


def mappings_for(info) -> list[Mapping]:
    """The table's SmoothQuant rows for this model (quantkit.methods.mappings), or refused before work."""
    return [m for m in model_mappings(info, "smoothquant") if m.smoothquant]


def check(info, options: Options, calibration) -> None:
    if not 0 <= options.smoothing_strength <= 1:
        raise InputError(f"smoothquant: smoothing_strength={options.smoothing_strength} must be in [0, 1]")
    mappings_for(info)
    moe.check_supported(info, "smoothquant")
    moe.check_expert_storage(info, "smoothquant", "W8A8 stores every expert as int8 `int-quantized` weights",
                             hint="use gptq --bits 8 --symmetric, or fp8, for this model")
    gptq.check_calibration_tokens(calibration, "smoothquant")


def scheme_config() -> dict:
    weights = gptq.weight_args(8, -1, True)
    activations = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}
    return {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}}


def modifiers(options: Options, info, ignore: list[str]) -> list:
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    mappings = [[list(m.balance), m.smooth] for m in mappings_for(info)]
    smooth = SmoothQuantModifier(smoothing_strength=options.smoothing_strength, mappings=mappings, ignore=ignore)
    if options.weight_algorithm == "gptq":
        quant = GPTQModifier(config_groups=scheme_config(), ignore=ignore, actorder=None,
                             dampening_frac=options.dampening)
    else:
        quant = QuantizationModifier(config_groups=scheme_config(), ignore=ignore)
    return [smooth, quant]


def quantize(job: QuantizeJob) -> QuantizeResult:
    recipe = modifiers(job.options, job.info, llmc.decoder_ignore(job))
    details = llmc.calibration_details(job)
    llmc.run_oneshot(job, recipe, calibrate=True)
    llmc.save_compressed(job)
    return QuantizeResult(job.out_dir, {"smoothing_strength": job.options.smoothing_strength, **details})


METHOD = MethodSpec(
    quantizes_towers=True, name="smoothquant", engine=llmc.ENGINE, engine_package=llmc.ENGINE,
    format="compressed-tensors (int-quantized, W8A8 int8)",
    options=Options, quantize=quantize, precision=precision, default_gate=fixed_gate(DEFAULT_GATE),
    check=check, needs_calibration=needs_calibration,
)
