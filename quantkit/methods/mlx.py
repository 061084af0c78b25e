"""MLX affine quantization for Apple silicon: an mlx-lm model directory with calibrated scales and biases.

Output: what `mlx_lm.convert -q` writes (quantkit.mlx.checkpoint): `model.safetensors` with each
quantized module's packed uint32 `weight`, `scales` and `biases` (quantkit.mlx.affine), config.json
with the `quantization` block (a per-module entry where `layer_bits` or the ignore list differ from
`bits`), the tokenizer files; `mlx_lm.generate --model OUT` runs it.

The same modules as mlx_lm.convert are quantized (every Linear of the decoder, the token embedding and
the output head, where the group size divides the input width; `--ignore` keeps a module 16-bit), in
the same format and size; what differs is how each group's scale and bias are chosen. mlx_lm.convert
rounds each group's min..max range to the nearest levels. quantkit first runs the calibration windows
through the model (streamed a layer at a time) and records, for every Linear, the mean squared
activation of each input column; each group's (scale, bias) is then the one minimizing the error
weighted by those column importances (a grid of ranges fitted by weighted least squares, as llama.cpp
does for k-quants; quantkit.mlx.affine.quantize). The output head is weighted by the final hidden
states (and, when tied, so is the embedding); an untied embedding by plain squared error.
`calibrate: false` gives plain min/max rounding with no calibration windows.

An affine group (w = scale * q + bias) is an asymmetric integer group with a zero point; the gate
reads the file back with quantkit's own dequantization, bit-exact with mlx.core.dequantize.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from quantkit.errors import UnsupportedError
from quantkit.formats import mlx as mlx_format
from quantkit.methods import AutoRung, Layers, MethodSpec, OnRanks, QuantizeJob, QuantizeResult, Sizes
from quantkit.mlx.affine import BITS
from quantkit.mlx.checkpoint import MLX_MODEL_TYPES, QUANTIZED_ROLES, Precision

Bits = Literal[2, 3, 4, 6, 8]
# By bits: 8 and 6 near-lossless, each step down looser (the gguf gates for the same bits per weight).
GATE_BY_BITS = {
    8: {"max_ppl_increase": 0.02, "max_kld": 0.01, "min_top1": 0.95},
    6: {"max_ppl_increase": 0.02, "max_kld": 0.01, "min_top1": 0.95},
    4: {"max_ppl_increase": 0.10, "max_kld": 0.10, "min_top1": 0.80},
    3: {"max_ppl_increase": 0.20, "max_kld": 0.20, "min_top1": 0.70},
    2: {"max_ppl_increase": 0.40, "max_kld": 0.40, "min_top1": 0.60},
}
KEEP = "16-bit"


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bits: Bits = 4
    group_size: Literal[32, 64, 128] = Field(64, description="input columns sharing one scale and bias (mlx-lm's "
                                              "default: 64)")
    calibrate: bool = Field(True, description="scales and biases fitted to the calibration activations; false: "
                            "plain min/max rounding, as mlx_lm.convert")
    layer_bits: dict[str, int | Literal["16-bit"]] = Field(
        default_factory=dict, description="per-module bits by name or re:REGEX (first match wins), e.g. "
        "{'re:.*down_proj': 6, lm_head: 8}; '16-bit' keeps a module unquantized")

    @field_validator("layer_bits")
    @classmethod
    def _known_bits(cls, value: dict) -> dict:
        for pattern, bits in value.items():
            if bits != KEEP and bits not in BITS:
                raise ValueError(f"layer_bits[{pattern!r}] = {bits}: use one of {', '.join(map(str, BITS))} or 16-bit")
            if pattern.startswith("re:"):
                re.compile(pattern[3:])
        return value


def default_gate(options: Options) -> dict:
    return dict(GATE_BY_BITS[options.bits])


def needs_calibration(options: Options) -> bool:
    return options.calibrate


def module_precision(options: Options, name: str, shape: list[int], ignore: list[str] = ()) -> Precision | None:
    """A quantizable module's precision: its layer_bits entry, else `bits`; None (16-bit) when ignored,
    set to 16-bit, or the group size does not divide its input width (mlx_lm.convert skips those too)."""
    from quantkit.arch.roles import matches

    if matches(name, list(ignore)) or shape[-1] % options.group_size:
        return None
    bits = next((b for pattern, b in options.layer_bits.items() if matches(name, [pattern])), options.bits)
    return None if bits == KEEP else Precision(int(bits), options.group_size)


def precision(role: str, options: Options, name: str, shape: list[int]) -> str | None:
    if role not in QUANTIZED_ROLES or len(shape) != 2:
        return None
    chosen = module_precision(options, name, shape)
    if chosen is None:
        return None
    how = "calibrated" if options.calibrate else "min/max rounding"
    return f"mlx affine {chosen.bits}-bit g{chosen.group_size} ({how})"


def layer_plan(info, options: Options, ignore: list[str]) -> dict[str, Precision | None]:
    """{module name: precision or None} of every module mlx-lm could quantize (Linear and Embedding weights)."""
    from quantkit.arch.roles import classify, linear_weights

    return {name: module_precision(options, name, shape, ignore) for name, shape in linear_weights(info).items()
            if classify(name + ".weight", info.towers) in QUANTIZED_ROLES}


def family_refusal(model_type: str, is_vlm: bool) -> str | None:
    from quantkit.arch import moe

    if is_vlm:
        return "a VLM's towers are not in mlx-lm (mlx-vlm runs those)"
    if moe.is_moe(model_type):
        return "mlx-lm stacks the experts into one tensor per projection, which is not written yet"
    if model_type not in MLX_MODEL_TYPES:
        return "not among the mlx-lm models written with the Hugging Face tensor names"
    return None


def check(info, options: Options, calibration=None) -> None:
    from quantkit.arch import moe
    from quantkit.arch.families import of_config
    from quantkit.io.checkpoint import is_vlm

    refusal = family_refusal(info.model_type, is_vlm(info.config))
    if refusal:
        raise UnsupportedError(f"mlx: model_type '{info.model_type}': {refusal}",
                               hint="mlx writes " + ", ".join(sorted(MLX_MODEL_TYPES)) + " models; "
                               "use --method gguf for llama.cpp on Apple silicon")
    family = of_config(info.config)
    for family_check in family.mlx_checks if family is not None else ():  # the family's own reason first
        family_check(info.config)
    moe.check_supported(info, "mlx")  # a family's mixture-of-experts variant without an expert layout


def support(family) -> str:
    refusal = family_refusal(family.model_type, family.is_vlm)
    return f"refused: {refusal}" if refusal else "✅"


# ---------------------------------------------------------------- calibration: column importances


def column_importance(job: QuantizeJob) -> dict:
    """{module name: mean squared input activation per column} of every Linear on the calibration
    windows, the base in float32 (CPU kernels are fastest there, and the statistics want it), whole where
    the run's placement has room for it, else streamed a layer at a time (quantkit.eval.resident.forward_model);
    the output head's from the final hidden states."""
    import torch

    from quantkit.engines.transformers import device_map, hf_config
    from quantkit.eval.evaluate import iter_batches
    from quantkit.eval.resident import forward_model
    from quantkit.eval.stream import last_hidden, windows_per_group
    from quantkit.io.checkpoint import SafetensorsWeights

    config = hf_config(job.info.path)
    streamed = forward_model(config, SafetensorsWeights(job.info.path), torch.float32, device_map(job.device),
                             job.placement.room)
    sums: dict[str, list] = {}

    def record(name: str, x) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
        entry = sums.setdefault(name, [0.0, 0])
        entry[0], entry[1] = entry[0] + (x * x).sum(0).cpu(), entry[1] + x.shape[0]

    hooks = [module.register_forward_hook(lambda m, inputs, out, name=name: record(name, inputs[0]))
             for name, module in streamed.model.named_modules() if isinstance(module, torch.nn.Linear)
             and module is not streamed.head]
    head = next(n for n, m in streamed.model.named_modules() if m is streamed.head)
    group = windows_per_group(config.get_text_config(), job.windows.calib.shape[1])
    try:
        with torch.no_grad():
            for ids in iter_batches(job.windows.calib, group):
                record(head, last_hidden(streamed, ids))
    finally:
        for hook in hooks:
            hook.remove()
    return {name: (total / max(count, 1)).to(torch.float32) for name, (total, count) in sums.items()}


def importance_of(name: str, imp: dict, info):
    """The column importances a module's groups are weighted by: its own; a tied embedding's, the head's."""
    if name in imp:
        return imp[name]
    if name.endswith("embed_tokens") and info.config.get("tie_word_embeddings"):
        return next((v for k, v in imp.items() if k.endswith("lm_head")), None)
    return None


def is_embedding(module: str, info) -> bool:
    """An embedding (the token one, Gemma 4's per-layer one): no column importances (plain squared error)."""
    from quantkit.arch.roles import classify

    return classify(module + ".weight", info.towers) == "embeddings"


# ---------------------------------------------------------------- quantize


def quantize(job: QuantizeJob) -> QuantizeResult:
    import json

    from quantkit.engines.transformers import torch_dtype
    from quantkit.io.checkpoint import SafetensorsWeights
    from quantkit.mlx import affine
    from quantkit.mlx.checkpoint import ShardedWriter, mlx_config, quantization_block, quantized_tensors

    opts = job.options
    plan = layer_plan(job.info, opts, job.ignore)
    imp = {}
    if opts.calibrate:
        calib = job.windows.calib
        job.progress(f"column importances: {len(calib)} calibration windows through the model")
        imp = column_importance(job)
    dtype = torch_dtype(job.dtype, job.info)
    source, writer = SafetensorsWeights(job.info.path), ShardedWriter(job.out_dir)
    job.progress(f"writing {sum(p is not None for p in plan.values())} quantized modules")
    for tensor in source.keys():  # noqa: SIM118  (a WeightSource, not a dict)
        module = tensor.removesuffix(".weight")
        weight = source.get(tensor)
        if plan.get(module) is None or not tensor.endswith(".weight"):
            writer.add(tensor, weight.to(dtype) if weight.is_floating_point() else weight)
            continue
        chosen, weights = plan[module], importance_of(module, imp, job.info) if opts.calibrate else None
        if opts.calibrate and weights is None and not is_embedding(module, job.info):
            from quantkit.errors import InternalError

            raise InternalError(f"mlx: no calibration activations reached {module}")
        words, scales, biases = affine.quantize(weight, chosen.bits, chosen.group_size, weights, dtype)
        for name, value in quantized_tensors(module, words, scales, biases).items():
            writer.add(name, value)
    files = writer.close()
    default = Precision(opts.bits, opts.group_size)
    block = quantization_block(default, plan)
    (job.out_dir / "config.json").write_text(json.dumps(mlx_config(job.info.config, block), indent=4) + "\n")
    counts: dict[str, int] = {}
    for p in plan.values():
        key = f"{p.bits}-bit" if p else KEEP
        counts[key] = counts.get(key, 0) + 1
    return QuantizeResult(job.out_dir, {"mlx": {
        "files": files, "bits": opts.bits, "group_size": opts.group_size, "mode": "affine", "modules": counts,
        "scales": "calibrated: importance-weighted least squares per group" if opts.calibrate else "min/max rounding",
        "calibration_tokens": int(job.windows.calib.numel()) if opts.calibrate else 0}})


def working_set(info, options: Options) -> int:
    """The larger of the calibration pass (one float32 tensor streamed at a time with a group of windows'
    activations) and the writing (one weight read whole and in float32 with its quantized copy, the
    search's temporaries on one slab of it, a shard's tensors waiting to be written)."""
    import math

    from quantkit.eval.stream import ACTIVATION_BYTES
    from quantkit.mlx.affine import SLAB_VALUES
    from quantkit.mlx.checkpoint import SHARD_BYTES

    largest = max((math.prod(shape) for _dtype, shape in info.tensors.values()), default=0)
    calibrating = 2 * 4 * largest + ACTIVATION_BYTES if options.calibrate else 0
    return max(calibrating, 2 * 4 * largest + 12 * 4 * SLAB_VALUES + SHARD_BYTES)


def stored_bits(options: Options) -> float:
    return options.bits + 32 / options.group_size  # a 16-bit scale and bias per group


def precision_bits(options: Options, text: str) -> float:
    """Bits per weight of a plan entry ("mlx affine 4-bit g64 (calibrated)": 4.5)."""
    match = re.match(r"mlx affine (\d+)-bit g(\d+)", text)
    return int(match.group(1)) + 32 / int(match.group(2))


# why a torchrun launch is refused: nothing of the work is split between ranks
RANKS_REFUSED = "quantkit's MLX conversion writes the checkpoint in one process (MLX has no torchrun ranks)"


ROTATION_REFUSED = ("an mlx-lm checkpoint stores no transform and mlx-lm applies none, and quantkit's MLX "
                    "conversion does not run llm-compressor's transform modifiers")


AUTO_RUNGS = tuple(AutoRung(f"mlx {b}-bit", (("bits", b),), "mlx") for b in (2, 3, 4, 6, 8))  # --method auto

METHOD = MethodSpec(
    name="mlx", format=mlx_format.FORMAT, label="MLX (mlx-lm affine quantized)",
    scheme=lambda options: f"affine {options.bits}-bit g{options.group_size}", engine="quantkit-mlx",
    engine_package="quantkit", options=Options, quantize=quantize, precision=precision, default_gate=default_gate,
    check=check, needs_calibration=needs_calibration,
    needs_model=lambda info, options: False,  # reads the checkpoint; the importances stream it
    support=support, rotation_refused=ROTATION_REFUSED,
    layers=Layers(keeps_lm_head=lambda options: False),  # quantized as mlx_lm.convert does (--ignore lm_head keeps it)
    sizes=Sizes(stored_bits=stored_bits, working_set=working_set, precision_bits=precision_bits),
    ranks=OnRanks(lambda options: RANKS_REFUSED),  # converts in one process: refused on ranks, saying why,
    auto=AUTO_RUNGS,
)
