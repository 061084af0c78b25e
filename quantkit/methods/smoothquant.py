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

On torchrun ranks: each rank observes its share of the windows, llm-compressor 0.14.0.1 reduces the per-channel
activation minimum and maximum over the ranks (MIN/MAX: exact), every rank computes the one-process scales, and rank
0 alone writes the smoothed weights the ranks share (quantkit.engines.llmcompressor.one_writer). GPTQ's int8 step
then sums each layer's Hessians over the ranks, in another order than one process.

`fallback` (gate-driven, quantkit.run.pipeline.run_fallback): the Linear layers predicted to cost the most
stay 16-bit, a few more each step, until the gate passes or `max_size` is spent. The prediction reads
the first artifact: each layer's int8 weights as GPTQ left them and its smoothing scales (the source
norm's weight over the artifact's), and the per-token int8 rounding of its smoothed input on the
calibration windows (quantkit.mixed.layers). Kept layers stay smoothed (SmoothQuant scales every
balance layer of a mapping), which leaves their function unchanged.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from quantkit.arch import moe
from quantkit.arch.mappings import Mapping, model_mappings
from quantkit.engines.llmcompressor import layer_resume, llmc
from quantkit.errors import InputError, UnsupportedError
from quantkit.formats import compressed_tensors
from quantkit.methods import (
    AutoRung,
    FallbackSteps,
    MethodSpec,
    OnRanks,
    QuantizeJob,
    QuantizeResult,
    Resume,
    Towers,
    fixed_gate,
    gptq,
)
from quantkit.mixed import layers as intmix
from quantkit.mixed.budget import Fallback

# int8 weights and per-token int8 activations are near-lossless on trained models: tight gate.
DEFAULT_GATE = {"max_ppl_increase": 0.03, "max_kld": 0.02, "min_top1": 0.93}


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    smoothing_strength: float = 0.8
    weight_algorithm: Literal["gptq", "rtn"] = "gptq"
    rotate: llmc.Rotate = "none"  # rotate before quantizing: hadamard | spinquant (llmc.rotation_modifiers)
    dampening: float = 0.01  # GPTQ only
    fallback: Fallback | None = None  # on a failed gate, keep the most damaging layers 16-bit (quantkit.mixed.budget)


def needs_calibration(options: Options) -> bool:
    return True


def precision(role: str, options: Options, name: str, shape: list[int]) -> str | None:
    if role not in gptq.QUANTIZED_ROLES:
        return None
    return f"int8 W per-channel ({options.weight_algorithm.upper()}) + A per-token dynamic (SmoothQuant)"


def mappings_for(info) -> list[Mapping]:
    """The table's SmoothQuant rows for this model (quantkit.arch.mappings), or refused before work (also where
    the family's rows hold no norm row: SmoothQuant smooths only a norm's output)."""
    rows = [m for m in model_mappings(info, "smoothquant") if m.smoothquant]
    if not rows:
        raise UnsupportedError(f"smoothquant: {info.model_type} has no norm whose output feeds only linear layers "
                               f"({no_norm_row_reason(info.config)})",
                               hint="use awq (its linear -> linear rows), gptq or fp8 for this model")
    return rows


def no_norm_row_reason(config: dict) -> str:
    from quantkit.arch.families import of_config

    family = of_config(config)
    return (family.smoothquant_refusal if family is not None and family.smoothquant_refusal
            else "SmoothQuant smooths a norm's output into the layers it feeds")


def check_rotation(rotate: str) -> None:
    """hadamard refused: llm-compressor applies QuIP's rotation when calibration starts, and SmoothQuant then
    divides a norm's output channels by its scales and multiplies the next Linears' input columns, which the
    rotation has mixed (the weight holds W H, the online H^T runs after the norm): the smoothed model is no
    longer the original. SpinQuant folds the norms and every rotation into the weights, so smoothing after it
    stays exact."""
    if rotate == "hadamard":
        raise UnsupportedError("smoothquant: --rotate hadamard is refused: llm-compressor rotates each Linear's "
                               "input online before SmoothQuant smooths its input channels, which the rotation "
                               "has mixed, so the smoothed model would not be the original",
                               hint="use --rotate spinquant (folded into the weights before smoothing)")


def check(info, options: Options, calibration) -> None:
    if not 0 <= options.smoothing_strength <= 1:
        raise InputError(f"smoothquant: smoothing_strength={options.smoothing_strength} must be in [0, 1]",
                         hint="e.g. --smoothing-strength 0.8")
    moe.check_supported(info, "smoothquant")  # first: an MoE layout it lacks refuses every method
    mappings_for(info)
    check_rotation(options.rotate)
    llmc.check_rotation(info, options.rotate, "smoothquant")
    gptq.check_calibration_tokens(calibration, "smoothquant")
    if options.fallback is not None:
        from quantkit.mixed.budget import check_max_size

        intmix.check_streamable(info, "smoothquant: fallback", "--fallback")
        layers = intmix.quantized_layers(info, [])
        check_max_size(options.fallback, intmix.artifact_estimate(info, layers, layer_bytes, PRECISION),
                       "smoothquant fallback")


def scheme_config() -> dict:
    weights = llmc.weight_args(8, -1, True)
    activations = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}
    return {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}}


def modifiers(options: Options, info, ignore: list[str], kept: list[str] = ()) -> list:
    """SmoothQuant over the mappings, then int8 weights (GPTQ or RTN) for every Linear but `ignore` and the
    `kept` layers (16-bit, still smoothed: a fallback plan)."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    mappings = [[list(m.balance), m.smooth] for m in mappings_for(info)]
    smooth = SmoothQuantModifier(smoothing_strength=options.smoothing_strength, mappings=mappings, ignore=ignore)
    if options.weight_algorithm == "gptq":
        quant = GPTQModifier(config_groups=scheme_config(), ignore=ignore + list(kept), actorder=None,
                             dampening_frac=options.dampening)
    else:
        quant = QuantizationModifier(config_groups=scheme_config(), ignore=ignore + list(kept))
    return [smooth, quant]


def quantize(job: QuantizeJob) -> QuantizeResult:
    return write(job, [])


def write(job: QuantizeJob, kept: list[str]) -> QuantizeResult:
    """SmoothQuant + int8 of job.model into job.out_dir, the `kept` layers 16-bit (a fallback plan)."""
    recipe = modifiers(job.options, job.info, llmc.decoder_ignore(job), kept)
    details = llmc.calibration_details(job)
    llmc.run_oneshot(job, recipe, calibrate=True)
    llmc.save_compressed(job)
    return QuantizeResult(job.out_dir, {"smoothing_strength": job.options.smoothing_strength, **details})


# ---------------------------------------------------------------- gate-driven fallback

PRECISION = "int8"  # W8A8: the one precision of the fallback ladder below 16-bit
ACTIVATIONS = scheme_config()["group_0"]["input_activations"]


def layer_bytes(shape: tuple[int, int], precision: str, element: int = 2) -> int:
    """A Linear's stored bytes: int8 weight and a per-channel scale, or the model's dtype (`element` bytes);
    plus the room its name takes in the ignore list and the header."""
    out, inp = shape
    return (out * inp + out * element if precision == PRECISION else out * inp * element) + intmix.METADATA_BYTES


def smoothing_scales(info, artifact) -> dict:
    """{layer: s} for every balance layer SmoothQuant scaled: the smooth layer's (a norm's) source weight over
    its weight in the artifact (SmoothQuant divided it by s and multiplied the balance columns by s)."""
    from quantkit.arch.roles import matches
    from quantkit.io.checkpoint import SafetensorsWeights

    source, smoothed = SafetensorsWeights(info.path), SafetensorsWeights(artifact)
    layers = intmix.quantized_layers(info, [])
    offset = 1.0 if info.model_type.startswith("gemma") else 0.0  # Gemma's RMSNorm scales by (1 + w)
    scales = {}
    for mapping in mappings_for(info):
        for smooth in (n.removesuffix(".weight") for n in info.tensors if matches(n.removesuffix(".weight"),
                                                                                   [mapping.smooth])):
            base = source.get(smooth + ".weight").float() + offset
            stored = smoothed.get(smooth + ".weight").float() + offset
            s = torch_where_nonzero(base, stored)
            parent = smooth.rsplit(".", 1)[0]
            scales.update({name: s for name in layers if name.startswith(parent + ".")
                           and matches(name, list(mapping.balance))})
    return scales


def torch_where_nonzero(base, stored):
    """base / stored elementwise, 1 where either is 0 (a channel SmoothQuant left alone)."""
    import torch

    ok = (base != 0) & (stored != 0)
    return torch.where(ok, base / torch.where(ok, stored, torch.ones_like(stored)), torch.ones_like(base))


def simulation(info, artifact) -> intmix.Simulation:
    """W8A8 of one layer as the first artifact has it: its int8 weights (GPTQ's, decompressed) over its
    smoothing scales, and its input divided by them, int8-quantized per token and multiplied back."""
    import torch

    from quantkit.engines.transformers import hf_config
    from quantkit.eval.compressed import CompressedWeights, quantized_meta_model

    stored = CompressedWeights(artifact, quantized_meta_model(hf_config(artifact), torch.float32))
    scales, quantize = smoothing_scales(info, artifact), intmix.activation_quantizer(ACTIVATIONS)

    def weight(layer, precision, source):
        s = scales.get(layer)
        dequantized = stored.get(layer + ".weight").float()
        return dequantized if s is None else dequantized / s

    def inputs(layer, precision):
        s = scales.get(layer)
        return quantize if s is None else (lambda x: quantize(x / s.to(x.dtype)) * s.to(x.dtype))

    return intmix.Simulation((PRECISION,), weight, inputs)


def fallback_ladder(job: QuantizeJob, result: QuantizeResult):
    return intmix.keep_ladder(job, intmix.quantized_layers(job.info, llmc.decoder_ignore(job)),
                              simulation(job.info, result.artifact), intmix.sized(layer_bytes, job))


def requantize(job: QuantizeJob, plan: dict[str, str], details: dict) -> QuantizeResult:
    """SmoothQuant + int8 again from the base model, the plan's 16-bit layers kept out of the quantization."""
    with llmc.reloaded_model(job):
        llmc.clear_weights(job.out_dir)
        result = write(job, intmix.kept_16bit(plan))
    return QuantizeResult(result.artifact, {**details, **result.details,
                                            "mixed_precision": intmix.keep_report(details, plan,
                                                                                  intmix.sized(layer_bytes, job))})


def support(family) -> str:
    refused = family.smoothing_refusal() or family.smoothquant_refusal()
    if refused:
        return refused
    record = getattr(family, "family", None)  # a text family's record (its norm rows may hold only in some configs)
    rows = [m for m in record.smoothing if m.smoothquant] if record is not None else []
    if rows and all(m.when is not None for m in rows) and record.smoothquant_refusal:
        return f"{family.kept()}; refused where no norm row holds ({record.smoothquant_refusal})"
    return family.decoder_support("✅ the experts' norm left unsmoothed")


AUTO_RUNGS = (AutoRung("smoothquant W8A8 (int8)"),)  # --method auto (quantkit.run.auto)

METHOD = MethodSpec(
    name="smoothquant", format=compressed_tensors.FORMAT, label="compressed-tensors (int-quantized, W8A8 int8)",
    scheme=lambda options: "w8a8-int8", engine=llmc.ENGINE, options=Options, quantize=quantize, precision=precision,
    default_gate=fixed_gate(DEFAULT_GATE), check=check, needs_calibration=needs_calibration, support=support,
    fallback=FallbackSteps(fallback_ladder, requantize),
    resume=Resume(**layer_resume.resume_fields()),
    ranks=OnRanks(),
    towers=Towers(quantizes=True),
    auto=AUTO_RUNGS,
)
