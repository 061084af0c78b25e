"""AutoRound (SignRound) weight-only integer quantization (W4A16 / W8A16) through llm-compressor's
`AutoRoundModifier`.

Output: compressed-tensors `pack-quantized`, the same format and vLLM kernels as gptq. Calibration
windows run through the model layer by layer (llm-compressor's sequential pipeline); for each decoder
layer, AutoRound learns a rounding offset per weight and a clipping range per group with signed
gradient descent, minimising the layer's output error against the 16-bit layer on those windows
(https://aclanthology.org/2024.findings-emnlp.662.pdf), then the quantized outputs feed the next layer.

Presets (auto-round's own): `default` 200 iterations per layer at lr 1/iters, `light` 50 at 5e-3;
`iters` and `lr` override them. The tuning is seeded (auto-round's seed 42, torch's generator
reset by quantkit before the run), so the same inputs give the same bytes. torch.compile is off:
on CPU it compiles longer than the tuning it would speed up.

On torchrun ranks each rank tunes on its share of the windows with its share of the batch, every batch's loss is
the ranks' mean and the gradients are averaged over the ranks, so every rank keeps the same iteration and the same
weights, and rank 0's copy of each layer is the one the ranks share (quantkit.engines.llmcompressor.autoround_ranks).

`group_size: auto`, the checks, MoE rules, `auto_precision` and `fallback` are gptq's (int4 -> int8
-> 16-bit per layer, extra config groups or ignore entries), with AutoRound as the writer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from quantkit.engines.llmcompressor import layer_resume, llmc
from quantkit.errors import InputError, UnsupportedError
from quantkit.formats import compressed_tensors
from quantkit.methods import (
    AutoRung,
    FallbackSteps,
    Layers,
    MethodSpec,
    OnRanks,
    QuantizeJob,
    QuantizeResult,
    Resume,
    Sizes,
    Towers,
    fixed_gate,
    gptq,
)
from quantkit.mixed.budget import Fallback

# auto-round's recipes (auto_round's `--iters`/`--lr` defaults and its "light" recipe)
PRESETS = {"default": (200, None), "light": (50, 5e-3)}
SEED = 42  # auto-round's default seed
RANK_PATCHES = ("autoround.loss_over_ranks", "autoround.gradients_averaged")  # under torchrun


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bits: int = 4
    group_size: int | Literal["auto"] = "auto"  # -1: one scale per output channel; auto: gptq.auto_group_size
    symmetric: bool = True
    rotate: llmc.Rotate = "none"  # rotate before quantizing: hadamard | spinquant (llmc.rotation_modifiers)
    preset: Literal["default", "light"] = "default"
    iters: int | None = Field(None, ge=1, le=10000, description="tuning iterations per decoder layer "
                              "(default: the preset's, 200 or 50)")
    lr: float | None = Field(None, gt=0, le=1, description="SignSGD step (default: the preset's, 1/iters or 5e-3)")
    batch_size: int = Field(8, ge=1, le=1024, description="calibration windows per tuning step")
    auto_precision: gptq.AutoPrecision | None = None  # per-layer int4/int8/16-bit (quantkit.mixed.layers)
    fallback: Fallback | None = None  # on a failed gate, raise the most damaging layers' precision


def tuning(options: Options) -> tuple[int, float | None]:
    """(iterations, learning rate) of the options: the preset's unless given."""
    iters, lr = PRESETS[options.preset]
    return options.iters or iters, options.lr if options.lr is not None else (None if options.iters else lr)


def needs_calibration(options: Options) -> bool:
    return True


def precision(role: str, options: Options, name: str, shape: list[int]) -> str | None:
    if role not in gptq.QUANTIZED_ROLES:
        return None
    sym = "sym" if options.symmetric else "asym"
    iters, _lr = tuning(options)
    return (f"int{options.bits} {gptq.granularity(options.group_size)} {sym} "
            f"(AutoRound, {iters} iters{gptq.mixed_suffix(options)})")


def check(info, options: Options, calibration) -> None:
    gptq.check_moe(info, options.symmetric, "none", "autoround")
    llmc.check_rotation(info, options.rotate, "autoround")
    gptq.check_bits(options.bits, "autoround")
    gptq.check_group_size(options.group_size, "autoround")
    gptq.check_calibration_tokens(calibration, "autoround")
    if calibration.num_samples < options.batch_size:
        raise InputError(f"autoround: batch_size={options.batch_size} is more than the {calibration.num_samples} "
                         "calibration windows", hint=f"lower batch_size or raise --num-samples to {options.batch_size}")
    if gptq.mixed(options):
        gptq.check_auto_precision(info, options, "autoround")
    check_layer_by_layer(info)


def check_layer_by_layer(info) -> None:
    """auto-round tunes one decoder layer at a time, replaying the layer's cached inputs; a family whose layers
    take inputs that replay does not carry (its record's `sequential`: Gemma 4, whose KV-shared layers read earlier
    layers' keys and values through shared_kv_states and whose layers take a per-layer input, which auto-round
    drops: "Tensor * None") is refused before any work."""
    from quantkit.arch.families import of_config

    family = of_config(info.config)
    if family is not None and family.sequential is not None:
        raise UnsupportedError(f"autoround: {info.model_type}: auto-round tunes one decoder layer at a time on its "
                               "cached inputs, and drops this family's per-layer inputs and the keys and values "
                               "its KV-shared layers read from earlier layers (shared_kv_states)",
                               hint="use gptq or awq for this model")


def shape_problems(info, options: Options, ignore: list[str]) -> dict[str, str]:
    """gptq's, and the layers auto-round itself keeps 16-bit in a weight-only int scheme: a width that is not
    a multiple of 32 (auto_round's layer_config_resolver; Granite 4's Mamba in_proj, whose output width is
    2 x inner + 2 x groups x state + heads)."""
    from quantkit.arch.roles import matches

    problems = gptq.shape_problems(info, options, ignore)
    for name, (rows, columns) in gptq.quantized_linears(info).items():
        if (rows % 32 or columns % 32) and name not in problems and not matches(name, ignore):
            problems[name] = (f"{name}: auto-round keeps a layer whose widths ({rows} x {columns}) are not both "
                              "multiples of 32 16-bit")
    return problems


def modifier(options: Options, ignore: list[str], config_groups: dict | None = None):
    from llmcompressor.modifiers.autoround import AutoRoundModifier

    iters, lr = tuning(options)
    weights = llmc.weight_args(options.bits, options.group_size, options.symmetric)
    return AutoRoundModifier(config_groups=config_groups or {"group_0": {"targets": ["Linear"], "weights": weights}},
                             ignore=ignore, iters=iters, lr=lr, batch_size=options.batch_size,
                             enable_torch_compile=False)


def quantize(job: QuantizeJob) -> QuantizeResult:
    details = {**llmc.calibration_details(job), "tuning": dict(zip(("iters", "lr"), tuning(job.options)))}
    return gptq.quantize_with(write, job, details)


def write(job: QuantizeJob, ignore: list[str], choice: dict[str, str] | None) -> None:
    """AutoRound of job.model into job.out_dir: one int group for every Linear, or the per-layer `choice`
    (gptq.choice_groups), seeded."""
    import torch

    from quantkit.engines.llmcompressor.autoround_ranks import rank_batch_size
    from quantkit.engines.patches import patched
    from quantkit.io.memory import collector_skips_existing_objects

    ignore, groups = gptq.choice_groups(job, ignore, choice)
    torch.manual_seed(SEED)
    options = job.options
    if job.ranks.distributed:  # each rank's share of the batch (quantkit.engines.llmcompressor.autoround_ranks)
        options = options.model_copy(update={"batch_size": rank_batch_size(options.batch_size, job.ranks.world_size)})
    # auto-round runs gc.collect() about seven times per layer: not over the libraries' and model's objects
    with (patched("autoround.on_initialize", "autoround.suspend_offloading",  # layers on disk (--offload-dir)
                  "autoround.zero_points", *(RANK_PATCHES if job.ranks.distributed else ())),
          collector_skips_existing_objects()):
        llmc.run_oneshot(job, modifier(options, ignore, groups), calibrate=True)
    restore_dtype(job.model, next(p.dtype for p in job.model.get_input_embeddings().parameters()))
    llmc.save_compressed(job)


def restore_dtype(model, dtype) -> list[str]:
    """AutoRound tunes each decoder layer in float32 on CPU and leaves the layer's unquantized parameters
    there (norms, MoE routers, the biases of quantized layers: a float32 router then meets bfloat16 hidden
    states on reload). Cast those back to the model's dtype; quantized weights and their quantization
    parameters are left to compression. Returns the names cast."""
    import torch

    cast = []
    for name, module in model.named_modules():
        quantized = getattr(module, "quantization_scheme", None) is not None
        for key, param in list(module.named_parameters(recurse=False)):
            if quantized and key != "bias":  # the weight and its quantization parameters: compression's
                continue
            if param.is_floating_point() and param.dtype != dtype:
                cast_parameter = torch.nn.Parameter(param.data.to(dtype), requires_grad=param.requires_grad)
                del module._parameters[key]  # an offload cache copies into a present key, keeping its dtype
                module._parameters[key] = cast_parameter
                cast.append(f"{name}.{key}")
    return cast


def fallback_ladder(job: QuantizeJob, result: QuantizeResult):
    return gptq.fallback_ladder(job, result)


def requantize(job: QuantizeJob, plan: dict[str, str], details: dict) -> QuantizeResult:
    """AutoRound again from the base model with the per-layer plan."""
    return gptq.requantize_with(write, job, plan, details)


def working_set(info, options: Options) -> int:
    """One decoder layer's trainable state while it is tuned: a float32 rounding offset per weight with
    its gradient and best copy (4 x 3 bytes a weight), and the layer's 16-bit outputs on every window are
    held by the sequential pipeline anyway."""
    layers: dict[str, int] = {}
    for name, (out, width) in gptq.quantized_linears(info).items():
        layer = name.rsplit(".", 2)[0]
        layers[layer] = layers.get(layer, 0) + out * width
    return 12 * max(layers.values(), default=0)


def support(family) -> str:
    text = family.text_family if family.is_vlm else family.family
    if text is not None and text.sequential is not None:
        return "refused: auto-round's layer-by-layer replay drops its per-layer inputs and shared KV"
    return family.decoder_support("✅")


AUTO_RUNGS = (AutoRung("autoround W4A16"),)  # --method auto (quantkit.run.auto)

METHOD = MethodSpec(
    name="autoround", format=compressed_tensors.FORMAT, label="compressed-tensors (pack-quantized, int weights)",
    scheme=gptq.compressed_scheme, engine=llmc.ENGINE, options=Options, quantize=quantize, precision=precision,
    default_gate=fixed_gate(gptq.DEFAULT_GATE), resolve=gptq.resolve, check=check, needs_calibration=needs_calibration,
    support=support,
    layers=Layers(shape_problems=shape_problems, quantizes_fused_experts=llmc.quantizes_fused_experts),
    sizes=Sizes(stored_bits=gptq.stored_bits, working_set=working_set),
    fallback=FallbackSteps(fallback_ladder, requantize),
    resume=Resume(**layer_resume.resume_fields()),
    ranks=OnRanks(),
    towers=Towers(quantizes=True),
    auto=AUTO_RUNGS,
)
