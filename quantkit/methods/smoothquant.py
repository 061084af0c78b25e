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

from quantkit.errors import InputError, UnsupportedError
from quantkit.methods import gptq, llmc

ENGINE = llmc.ENGINE
FORMAT = "compressed-tensors (int-quantized, W8A8 int8)"
# int8 weights and per-token int8 activations are near-lossless on trained models: tight gate.
DEFAULT_GATE = {"max_ppl_increase": 0.03, "max_kld": 0.02, "min_top1": 0.93}

# model_type -> [(smooth layer, [balance layers])]: the norm whose output feeds the linears.
# o_proj and down_proj are not smoothed (their inputs are not a norm output).
_LLAMA_LIKE = [
    ("re:.*input_layernorm$", ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]),
    ("re:.*post_attention_layernorm$", ["re:.*gate_proj$", "re:.*up_proj$"]),
]
# Gemma 2/3: post_attention_layernorm normalizes the attention *output*; the MLP input comes
# from pre_feedforward_layernorm (llm-compressor's own registry maps these models like Llama).
_GEMMA2_LIKE = [
    ("re:.*input_layernorm$", ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]),
    ("re:.*pre_feedforward_layernorm$", ["re:.*gate_proj$", "re:.*up_proj$"]),
]
SMOOTHQUANT_MAPPINGS: dict[str, list[tuple[str, list[str]]]] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma": _LLAMA_LIKE,
    "gemma2": _GEMMA2_LIKE,
    "gemma3": _GEMMA2_LIKE,
    "gemma3_text": _GEMMA2_LIKE,
}


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


def mappings_for(model_type: str) -> list[tuple[str, list[str]]]:
    if model_type not in SMOOTHQUANT_MAPPINGS:
        raise UnsupportedError(
            f"smoothquant has no smoothing mappings for architecture '{model_type}'",
            hint="supported model types: " + ", ".join(sorted(SMOOTHQUANT_MAPPINGS)),
        )
    return SMOOTHQUANT_MAPPINGS[model_type]


def check(info, options: Options, calibration) -> None:
    if not 0 <= options.smoothing_strength <= 1:
        raise InputError(f"smoothquant: smoothing_strength={options.smoothing_strength} must be in [0, 1]")
    mappings_for(info.model_type)
    gptq.check_calibration_tokens(calibration, "smoothquant")


def scheme_config() -> dict:
    weights = gptq.weight_args(8, -1, True)
    activations = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}
    return {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}}


def modifiers(options: Options, model_type: str, ignore: list[str]) -> list:
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    mappings = [[balance, smooth] for smooth, balance in mappings_for(model_type)]
    smooth = SmoothQuantModifier(smoothing_strength=options.smoothing_strength, mappings=mappings, ignore=ignore)
    if options.weight_algorithm == "gptq":
        quant = GPTQModifier(config_groups=scheme_config(), ignore=ignore, actorder=None,
                             dampening_frac=options.dampening)
    else:
        quant = QuantizationModifier(config_groups=scheme_config(), ignore=ignore)
    return [smooth, quant]


def quantize(job) -> None:
    recipe = modifiers(job.options, job.info.model_type, job.ignore)
    llmc.run_oneshot(job, recipe, calibrate=True)
    llmc.save_compressed(job)
    job.extra["report"] = {"smoothing_strength": job.options.smoothing_strength,
                           "calibration_tokens": int(job.windows.calib.numel())}
