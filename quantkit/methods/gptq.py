"""GPTQ weight-only integer quantization (W4A16 / W8A16) through llm-compressor.

Output: compressed-tensors `pack-quantized` (int weights packed into int32), served by vLLM
(Marlin kernels). Calibration windows run through the model layer by layer (sequential
pipeline): each decoder layer's linears collect a Hessian from its inputs, are quantized
column block by column block with error feedback, and the quantized outputs feed the next layer.

`auto_precision`: some layers int8 (per channel) or 16-bit instead of int4, chosen by measured
sensitivity under a size budget (quantkit.mixed.layers), as extra config groups / ignore entries.

`group_size: auto` (the default): the largest of 128, 64 and 32 that divides every quantized layer's
input width (each is a group size vLLM's Marlin kernels take), else one scale per output channel; the
report says which and why. With an explicit group size, the layers whose input width it does not
divide stay 16-bit (listed in the report; refused with --strict-shapes).

`symmetric: auto` (the default): 4-bit weights get a zero point per group (asymmetric: a lower KL
divergence at +1 bit per group of 32..128 weights, served by vLLM's Marlin on 7.5+ and Machete on
Hopper as `uint4` with zero points); 8-bit weights and MoE experts stay symmetric (Marlin takes no
8-bit zero points; transformers cannot reload expert zero points). int8 layers of a per-layer plan are
always symmetric per channel, for the same reason.

`fallback` (gate-driven, quantkit.run.pipeline.run_fallback): when the artifact fails its gate, the layers
with the largest predicted damage at their current precision go one step up (int4 -> int8 -> 16-bit)
and the model is quantized again from the base, until the gate passes or `max_size` is spent. The
damage is the sensitivity table auto_precision recorded, else one measured at the first fallback step.
GPTQ quantizes and compresses job.model in place, and the pipeline frees it before measuring, so every
step loads the base model again (llmc.reloaded_model).

Also home of the checks shared by the weight-only integer methods (awq, smoothquant):
`check_group_size`, `check_calibration_tokens`, `quantized_linears`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from quantkit.arch import moe
from quantkit.engines.llmcompressor import layer_resume, llmc
from quantkit.errors import CalibrationError, InputError, UnsupportedError
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
)
from quantkit.mixed import layers as intmix
from quantkit.mixed.budget import Fallback
from quantkit.mixed.sensitivity import PROBES_PER_ROLE, SensitivityRow

# 4-bit rounding costs a few percent of perplexity even with GPTQ's error feedback.
DEFAULT_GATE = {"max_ppl_increase": 0.10, "max_kld": 0.10, "min_top1": 0.80}

SUPPORTED_BITS = (4, 8)
# GPTQ inverts a Hessian estimated from calibration activations; with fewer tokens than this
# the estimate is rank-deficient for any real hidden size and the result is noise.
MIN_CALIBRATION_TOKENS = 1024
QUANTIZED_ROLES = ("decoder", "other")


# ---------------------------------------------------------------- per-layer int4 / int8 / 16-bit

PRECISIONS = ("int4", "int8", "16-bit")  # gptq / awq, cheapest first
BITS = {"int4": 4, "int8": 8}
SHAPE_BYTES = 16  # weight_shape: two int64


class AutoPrecision(BaseModel):
    """Per-layer int4 / int8 / 16-bit chosen by measured sensitivity under a size budget."""

    model_config = ConfigDict(extra="forbid")
    budget_bpw: float | None = Field(None, gt=0, le=16, description="bits per weight of the quantized "
                                     "layers (scales and zero points included); default: W4A16 x (1 + headroom)")
    headroom: float = Field(0.05, ge=0, le=4, description="budget above the all-int4 (W4A16) size of the "
                            "quantized layers, as a fraction (0.05: +5%)")
    measure_windows: int = Field(8, ge=0, le=1024, description="calibration windows the probe layers' KL "
                                 "divergence is measured on (0: importance-weighted error only)")
    probes_per_role: int = Field(PROBES_PER_ROLE, ge=1, le=64, description="layers of each role (q_proj, "
                                 "down_proj, ...) whose KL divergence is measured, spread over depth")


def int_simulation(scheme: "Scheme", precisions: tuple[str, ...] = ("int4", "int8")) -> intmix.Simulation:
    """gptq / awq: round-to-nearest int weights in the target's scheme (int8 per channel)."""
    return intmix.Simulation(precisions, lambda layer, precision, weight: intmix.rtn(weight, scheme.args(precision)))


@dataclass(frozen=True)
class Scheme:
    """The target's int4 scheme (int8 is symmetric per channel: vLLM's Marlin takes no 8-bit zero points)
    and the checkpoint's bytes per element (scales and 16-bit layers are stored in its dtype)."""

    group_size: int  # -1: per channel
    symmetric: bool
    element_bytes: int = 2

    def weights(self, precision: str) -> dict:
        """compressed-tensors weight QuantizationArgs fields of an int precision."""
        if precision == "int8":
            return llmc.weight_args(8, -1, True)
        return llmc.weight_args(BITS[precision], self.group_size, self.symmetric)

    def args(self, precision: str):
        from compressed_tensors.quantization import QuantizationArgs

        return QuantizationArgs(**self.weights(precision))

    def nbytes(self, shape: tuple[int, int], precision: str) -> int:
        return layer_bytes(shape, precision, self.group_size, self.symmetric, self.element_bytes)

    def size(self, row: SensitivityRow, precision: str) -> int:
        """quantkit.mixed.budget's size model."""
        return self.nbytes(row.shape, precision)


def packed_bytes(count: int, bits: int) -> int:
    """int32 words holding `count` values of `bits` bits, in bytes."""
    return math.ceil(count * bits / 32) * 4


def layer_bytes(shape: tuple[int, int], precision: str, group_size: int, symmetric: bool, element_bytes: int) -> int:
    """Bytes stored for one Linear weight at `precision` (the size model above; group_size -1: per channel)."""
    out, inp = shape
    if precision == intmix.KEEP:
        return out * inp * element_bytes
    bits = BITS[precision]
    groups = 1 if precision == "int8" or group_size == -1 else inp // group_size
    zero_points = 0 if symmetric or precision == "int8" else packed_bytes(out, bits) * groups
    return out * packed_bytes(inp, bits) + out * groups * element_bytes + zero_points + SHAPE_BYTES


def budget_bytes(auto: AutoPrecision, shapes: list[tuple[int, int]], scheme: Scheme) -> tuple[int, int]:
    """(bytes the budgeted layers may take, their all-int4 bytes); BudgetError when budget_bpw is below
    all-int4 (the cheapest plan)."""
    from quantkit.mixed.budget import check_budget

    int4 = sum(scheme.nbytes(shape, "int4") for shape in shapes)
    if auto.budget_bpw is None:
        return int(int4 * (1 + auto.headroom)), int4
    weights = sum(o * i for o, i in shapes)
    allowed = int(auto.budget_bpw * weights / 8)
    check_budget(int4, allowed, f"auto_precision: budget_bpw={auto.budget_bpw}",
                 f"all-int4 takes {8 * int4 / weights:.3f} bits per weight; raise budget_bpw, or leave it out "
                 "(W4A16 size + headroom)")
    return allowed, int4


def config_groups(choice: dict[str, str], scheme: Scheme) -> dict:
    """compressed-tensors config groups: int4 for every Linear, int8 for the chosen layers by exact name."""
    groups = {"group_0": {"targets": ["Linear"], "weights": scheme.weights("int4")}}
    int8 = sorted(name for name, p in choice.items() if p == "int8")
    if int8:
        groups["group_1"] = {"targets": int8, "weights": scheme.weights("int8")}
    return groups


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bits: int = 4
    group_size: int | Literal["auto"] = "auto"  # -1: one scale per output channel; auto: see auto_group_size
    rotate: llmc.Rotate = "none"  # rotate before quantizing: hadamard | spinquant (llmc.rotation_modifiers)
    symmetric: bool | Literal["auto"] = "auto"  # auto: see auto_symmetric
    act_order: Literal["none", "static", "group"] = "static"
    dampening: float = 0.01  # fraction of the mean Hessian diagonal added before inversion
    block_size: int = 128
    auto_precision: AutoPrecision | None = None  # per-layer int4/int8/16-bit (quantkit.mixed.layers)
    fallback: Fallback | None = None  # on a failed gate, raise the most damaging layers' precision (quantkit.mixed.budget)
    kv_cache: llmc.KvCache = None  # fp8: calibrated per-layer FP8 k/v scales (llmc.kv_cache_scheme)
    activations: Literal["none", "int8", "fp8"] = "none"  # W4A8: dynamic per-token activations (see ACTIVATIONS)


def needs_calibration(options: Options) -> bool:
    return True


def granularity(group_size) -> str:
    return {-1: "per-channel", "auto": "group size for the model's widths"}.get(group_size, f"g{group_size}")


def precision(role: str, options: Options, name: str, shape: list[int]) -> str | None:
    if role not in QUANTIZED_ROLES:
        return None
    sym = "sym" if options.symmetric else "asym"
    order = "" if options.act_order == "none" else f", act-order {options.act_order}"
    acts = "" if options.activations == "none" else f" + A {options.activations} per-token dynamic"
    return (f"int{options.bits} {granularity(options.group_size)} {sym}{acts} (GPTQ{order}{mixed_suffix(options)})"
            + llmc.kv_suffix(options))


# ---------------------------------------------------------------- checks (shared)


def quantized_linears(info) -> dict[str, list[int]]:
    """Linear weights the int methods quantize: decoder/other roles, VLM towers and lm_head excluded."""
    from quantkit.arch.roles import classify, linear_weights

    return {name: shape for name, shape in linear_weights(info).items()
            if classify(name + ".weight", info.towers) in QUANTIZED_ROLES}


def check_bits(bits: int, method: str) -> None:
    if bits not in SUPPORTED_BITS:
        raise UnsupportedError(f"{method}: bits={bits} is not supported",
                               hint=f"use one of: {', '.join(map(str, SUPPORTED_BITS))}")


GROUP_SIZES = (128, 64, 32)  # what group_size auto tries, largest first (group sizes vLLM's Marlin kernels take)


def auto_group_size(info) -> tuple[int, str]:
    """(group size, why): the largest of GROUP_SIZES dividing every quantized layer's input width, else
    -1 (one scale per output channel)."""
    widths = {name: in_features for name, (_out, in_features) in quantized_linears(info).items()}
    refused = []
    for size in GROUP_SIZES:
        blocking = next((name for name, width in widths.items() if width % size), None)
        if blocking is None:
            why = f"the largest of {', '.join(map(str, GROUP_SIZES))} dividing every quantized layer's input width"
            return size, why + "".join(f"; {r}" for r in refused)
        refused.append(f"{size} does not divide {widths[blocking]} ({blocking})")
    return -1, "no group size of " + ", ".join(map(str, GROUP_SIZES)) + " divides every input width (" + \
        "; ".join(refused) + "): one scale per output channel"


def resolve(info, options):
    """The options with group_size auto and symmetric auto replaced by their choices for the model;
    (options, notes for the report)."""
    notes = {}
    if activations_of(options) == "fp8" and options.group_size == "auto":
        why = f"auto: {W4A8_FP8_GROUP} (vLLM's W4A8-FP8 kernel takes group size {W4A8_FP8_GROUP} only)"
        options, notes["group_size"] = options.model_copy(update={"group_size": W4A8_FP8_GROUP}), why
    if options.group_size == "auto":
        size, why = auto_group_size(info)
        options, notes["group_size"] = options.model_copy(update={"group_size": size}), f"auto: {size} ({why})"
    if options.symmetric == "auto" and activations_of(options) != "none":
        why = "auto: symmetric (W4A8: vLLM's W4A8 schemes take no weight zero points)"
        options, notes["symmetric"] = options.model_copy(update={"symmetric": True}), why
    if options.symmetric == "auto":
        symmetric, why = auto_symmetric(info, options.bits)
        words = "symmetric" if symmetric else "asymmetric"
        options, notes["symmetric"] = options.model_copy(update={"symmetric": symmetric}), f"auto: {words} ({why})"
    return options, notes


def auto_symmetric(info, bits: int) -> tuple[bool, str]:
    """(symmetric, why): zero points for 4-bit dense weights, where they lower the error and vLLM's Marlin
    and Machete kernels take them; none for MoE experts or 8-bit weights."""
    if moe.moe_layout(info.config) is not None:
        return True, "MoE experts: transformers cannot reload expert zero points"
    if bits == 8:
        return True, "8-bit: vLLM's Marlin kernels take no 8-bit zero points"
    return False, "4-bit: a zero point per group lowers the error; vLLM's Marlin and Machete serve it"


def check_group_size(group_size: int, method: str) -> None:
    """A group size is positive, or -1 (per channel), or auto."""
    if group_size not in (-1, "auto") and group_size < 1:
        raise InputError(f"{method}: group_size={group_size} is invalid", hint="use a positive size, or -1 per channel")


def group_problems(info, group_size, ignore: list[str]) -> dict[str, str]:
    """The layers the target quantizes (the ignore list left out) whose input width an explicit group size
    does not divide, with why (auto chooses one that divides every width)."""
    from quantkit.arch.roles import matches

    if group_size in (-1, "auto"):
        return {}
    widths = {name: in_features for name, (_out, in_features) in quantized_linears(info).items()}
    dividing = dividing_group_sizes(widths.values())
    return {name: f"{name}: group_size={group_size} does not divide its input width {width} (sizes that divide "
                  f"every width: {dividing}; or -1, one scale per output channel)"
            for name, width in widths.items() if width % group_size and not matches(name, ignore)}


def shape_problems(info, options, ignore: list[str]) -> dict[str, str]:
    problems = group_problems(info, options.group_size, ignore)
    if activations_of(options) == "fp8":
        problems = {**w4a8_fp8_width_problems(info, ignore), **problems}
    return problems


def dividing_group_sizes(widths) -> str:
    """The powers of two from 16 up (kernels want those) that divide every width, else the largest that does."""
    import math

    common = math.gcd(*widths)
    sizes = [g for g in (16, 32, 64, 128, 256) if common % g == 0]
    return ", ".join(map(str, sizes)) if sizes else str(common & -common)


def check_calibration_tokens(calibration, method: str, minimum: int = MIN_CALIBRATION_TOKENS) -> None:
    tokens = calibration.num_samples * calibration.seq_len
    if tokens < minimum:
        raise CalibrationError(
            f"{method}: {calibration.num_samples} x {calibration.seq_len} = {tokens} calibration tokens "
            f"is too few (at least {minimum})",
            hint="raise --num-samples or --seq-len",
        )


def check_moe(info, symmetric: bool, act_order: str, method: str) -> None:
    """An MoE family without an expert layout is refused before any work (quantkit.arch.moe.check_supported);
    any int scheme of the others is read by quantkit's gate as vLLM reads it (quantkit.eval.experts), but a VLM's
    expert zero points are refused (quantkit.arch.moe.check_vlm_expert_reload)."""
    moe.check_supported(info, method)
    if not symmetric:
        moe.check_vlm_expert_reload(info, method, "zero points", "set symmetric: true in the target's options")


def check(info, options: Options, calibration) -> None:
    check_activations(info, options)
    llmc.check_rotation(info, options.rotate, "gptq")
    check_moe(info, options.symmetric, options.act_order, "gptq")
    check_bits(options.bits, "gptq")
    check_group_size(options.group_size, "gptq")
    if options.act_order == "group" and options.group_size == -1:
        raise InputError("gptq: act_order=group needs a group size", hint="use act_order static, or a group_size")
    if not 0 <= options.dampening < 1:
        raise InputError(f"gptq: dampening={options.dampening} must be in [0, 1)",
                         hint="e.g. dampening: 0.01 (the default) in the target's options")
    if options.block_size < 1:
        raise InputError(f"gptq: block_size={options.block_size} must be positive",
                         hint="e.g. block_size: 128 (the default) in the target's options")
    check_calibration_tokens(calibration, "gptq")
    if mixed(options):
        check_auto_precision(info, options)
    if options.act_order == "group":  # llm-compressor raises only after loading and calibrating
        raise UnsupportedError("gptq: act_order=group is not supported by llm-compressor's GPTQ "
                               "(it orders by static or weight activation order only)",
                               hint="use act_order static (the default) or none")


def mixed(options) -> bool:
    """Per-layer precisions are chosen by quantkit (auto_precision), or may be raised (fallback)."""
    return getattr(options, "auto_precision", None) is not None or getattr(options, "fallback", None) is not None


def mixed_label(options) -> str:
    return "auto_precision" if getattr(options, "auto_precision", None) is not None else "fallback"


def check_auto_precision(info, options, method: str = "gptq") -> None:
    """auto_precision and fallback start every layer at int4 and give some int8 (per channel) or 16-bit
    (gptq's and awq's options)."""
    label = mixed_label(options)
    flag = "--" + label.replace("_", "-")
    if options.bits != 4:
        raise InputError(f"{method}: {label} starts every layer at int4; bits={options.bits} leaves nothing "
                         "to choose", hint=f"drop --bits (4 is the default) or {flag}")
    if getattr(options, "act_order", "none") == "group":
        raise InputError(f"{method}: {label}'s int8 layers are per channel, which act_order=group cannot order",
                         hint="use act_order static or none")
    intmix.check_streamable(info, f"{method}: {label}", flag)
    check_sizes(info, options, method)


# ---------------------------------------------------------------- quantize


def scheme_config(options: Options) -> dict:
    weights = llmc.weight_args(options.bits, options.group_size, options.symmetric)
    if options.activations != "none":
        return {"group_0": {"targets": ["Linear"], "weights": weights, **w4a8_group(options.activations)}}
    return {"group_0": {"targets": ["Linear"], "weights": weights}}


def modifier(options: Options, ignore: list[str], config_groups: dict | None = None):
    from llmcompressor.modifiers.gptq import GPTQModifier

    return GPTQModifier(
        config_groups=config_groups or scheme_config(options),
        ignore=ignore,
        actorder=None if options.act_order == "none" else options.act_order,
        dampening_frac=options.dampening,
        block_size=options.block_size,
        kv_cache_scheme=llmc.kv_cache_scheme(getattr(options, "kv_cache", None)),
    )


def quantize(job: QuantizeJob) -> QuantizeResult:
    return quantize_with(write, job, llmc.calibration_details(job))


def quantize_with(writer: Callable, job: QuantizeJob, details: dict) -> QuantizeResult:
    """The per-layer plan when auto_precision asks for one, then `writer(job, ignore, plan)` (gptq, autoround)."""
    ignore, choice = llmc.decoder_ignore(job), None
    if job.options.auto_precision is not None:
        choice, mixed_details = auto_precision(job, ignore, scheme(job))
        details.update(mixed_details)
    writer(job, ignore, choice)
    return QuantizeResult(job.out_dir, details)


def choice_groups(job: QuantizeJob, ignore: list[str], choice: dict[str, str] | None) -> tuple[list[str], dict | None]:
    """The ignore list and config groups of a per-layer `choice` ({module name: int4|int8|16-bit}: an int8
    group by exact names, the 16-bit layers ignored); (ignore, None) without one: the int4 group for all."""
    if choice is None:
        return ignore, None
    return ignore + intmix.kept_16bit(choice), config_groups(choice, scheme(job))


def mixed_suffix(options) -> str:
    """The precision plan's words for auto_precision and fallback (gptq, awq, autoround)."""
    auto = "; auto-precision: int8 or 16-bit where measured sensitive" if options.auto_precision else ""
    return auto + ("; fallback: int8 or 16-bit where the gate fails" if options.fallback else "")


def write(job: QuantizeJob, ignore: list[str], choice: dict[str, str] | None) -> None:
    """GPTQ of job.model into job.out_dir: one int4 group for every Linear, or the per-layer `choice`
    (choice_groups)."""
    ignore, groups = choice_groups(job, ignore, choice)
    llmc.run_oneshot(job, modifier(job.options, ignore, groups), calibrate=True, reads_weights_only=True)
    llmc.save_compressed(job)


# ---------------------------------------------------------------- auto precision


def budgeted_layers(info, ignore: list[str]) -> dict[str, tuple[int, int]]:
    """{module name: (out, in)} of the Linear layers the int4 group quantizes (the ones a budget may raise),
    from the checkpoint's headers (a text decoder's module names are its tensor names)."""
    from quantkit.arch.roles import matches

    return {name: tuple(shape) for name, shape in quantized_linears(info).items() if not matches(name, ignore)}


def scheme(job: QuantizeJob) -> Scheme:
    return Scheme(job.options.group_size, job.options.symmetric, element_bytes(job))


def layer_table(job: QuantizeJob, layers: dict[str, tuple[int, int]], chosen: Scheme) -> intmix.LayerTable:
    """The sensitivity table of `layers` (budgeted_layers), with the auto_precision options'
    measure_windows and probes (their defaults for a fallback without auto_precision)."""
    auto, started = job.options.auto_precision or AutoPrecision(), time.perf_counter()
    table = intmix.measure(job.info.path, layers, job.windows.calib, int_simulation(chosen), "int4",
                           auto.measure_windows, auto.probes_per_role, job.workdir, job.progress, job.ranks)
    table.seconds["total"] = round(time.perf_counter() - started, 3)
    return table


def greedy_plan(rows: list[SensitivityRow], allowed: int, chosen: Scheme) -> dict[str, str]:
    """gptq's plan: each layer on its own, the shards vLLM fuses (q/k/v, gate/up) at one precision
    (quantkit.mixed.layers.fused_assign)."""
    return intmix.fused_assign(rows, allowed, chosen.size)


def auto_precision(job: QuantizeJob, ignore: list[str], chosen: Scheme,
                   plan: Callable[[list, int, Scheme], dict[str, str]] = greedy_plan
                   ) -> tuple[dict[str, str], dict]:
    """({module name: int4|int8|16-bit}, report details): the sensitivity table and the plan under the budget.
    `plan(rows, allowed bytes, scheme)`: how the budget is spent (awq ties layers that share a scale)."""
    layers = budgeted_layers(job.info, ignore)
    allowed, int4 = budget_bytes(job.options.auto_precision, list(layers.values()), chosen)
    table = layer_table(job, layers, chosen)
    choice = plan(table.layers, allowed, chosen)
    report = intmix.plan_report(table.layers, choice, allowed, int4, chosen.size)
    job.progress(f"auto-precision: {report['counts']} within {allowed:,} budgeted bytes")
    return choice, {"sensitivity": table.as_dict(), "mixed_precision": report}


def check_sizes(info, options, method: str = "gptq") -> None:
    """Before any work: a budget_bpw below all-int4, or an absolute fallback max_size below the first
    artifact's quantized layers, is BudgetError (exit 2) with the numbers."""
    from quantkit.mixed.budget import check_max_size

    shapes = list(budgeted_layers(info, []).values())
    chosen = Scheme(options.group_size, options.symmetric, dtype_bytes(info))
    if options.auto_precision is not None:
        allowed, _ = budget_bytes(options.auto_precision, shapes, chosen)
    else:
        allowed = sum(chosen.nbytes(shape, "int4") for shape in shapes)
    check_max_size(options.fallback, allowed, f"{method} fallback")


# ---------------------------------------------------------------- gate-driven fallback


def fallback_ladder(job: QuantizeJob, result: QuantizeResult, units=None):
    """The layers the fallback raises (int4 -> int8 -> 16-bit, quantkit.mixed.budget.Ladder): the sensitivity table
    auto_precision recorded, else one measured now; `units(rows)(plan)`: what a raise moves together (awq's
    groups; by default the shards vLLM fuses, quantkit.mixed.layers.fused_units)."""
    from quantkit.mixed.budget import Ladder

    chosen = scheme(job)
    if "sensitivity" in result.details:
        table = intmix.LayerTable.from_dict(result.details["sensitivity"])
    else:
        table = layer_table(job, budgeted_layers(job.info, llmc.decoder_ignore(job)), chosen)
    plan = result.details.get("mixed_precision", {}).get("types") or {r.name: "int4" for r in table.layers}
    fused = intmix.fused_units(table.layers)
    return Ladder(table.layers, dict(plan), lambda row, p: chosen.size(row, p) + (0 if p == "int4" else intmix.METADATA_BYTES),
                  units(table.layers) if units else lambda plan: fused, keep_one=True,
                  details={"sensitivity": table.as_dict()})


def requantize(job: QuantizeJob, plan: dict[str, str], details: dict) -> QuantizeResult:
    """GPTQ again from the base model with the per-layer plan, into job.out_dir."""
    return requantize_with(write, job, plan, details)


def requantize_with(writer: Callable, job: QuantizeJob, plan: dict[str, str], details: dict) -> QuantizeResult:
    """The base model loaded again and quantized by `writer(job, ignore, plan)` into job.out_dir."""
    chosen = scheme(job)
    with llmc.reloaded_model(job):
        llmc.clear_weights(job.out_dir)
        writer(job, llmc.decoder_ignore(job), plan)
    table = intmix.LayerTable.from_dict(details["sensitivity"]).layers
    int4 = sum(chosen.size(r, "int4") for r in table)
    return QuantizeResult(job.out_dir, {**details, "mixed_precision": intmix.plan_report(table, plan, None, int4,
                                                                                          chosen.size)})


def element_bytes(job: QuantizeJob) -> int:
    """Bytes per element of the model as loaded (its scales and 16-bit layers are saved in that dtype)."""
    from quantkit.engines.transformers import torch_dtype

    return torch_dtype(job.dtype, job.info).itemsize


def dtype_bytes(info) -> int:
    """Bytes per element of the checkpoint's dtype (what an auto-dtype run saves scales in)."""
    from quantkit.engines.transformers import torch_dtype

    return torch_dtype("auto", info).itemsize


def stored_bits(options) -> float:
    """Bits per quantized weight with its 16-bit scale and zero point per group (awq's too); group_size
    auto not yet resolved counts as its smallest choice. W4A8 int8 stores one byte per int4 value and no
    zero point (W4A8_FORMATS)."""
    size = options.group_size if isinstance(options.group_size, int) else min(GROUP_SIZES)
    activations = activations_of(options)
    if activations != "none":
        values = 8 if W4A8_FORMATS[activations] == "int-quantized" else options.bits
        return values + (16 / size if size > 0 else 0)
    return options.bits + (32 / size if size > 0 else 0)


def working_set(info, options) -> int:
    """GPTQ's working set for one decoder layer: a float32 Hessian (in x in) per quantized Linear, all
    of them alive while the layer calibrates, and one float32 copy of the largest weight with a slab of
    its block-error product while it is quantized (single copies: quantkit.engines.llmcompressor.lean_hessian)."""
    from quantkit.engines.llmcompressor.lean_hessian import ERROR_SLAB, SLAB_ROWS
    from quantkit.io.checkpoint import LAYER_PREFIX

    shapes: dict[str, list[tuple[int, int]]] = {}
    for name, (out, width) in quantized_linears(info).items():
        match = LAYER_PREFIX.match(name + ".")
        shapes.setdefault(match.group(1) if match else name, []).append((out, width))

    def quantizing(out: int, width: int) -> int:
        return 4 * out * width + 4 * min(out * width, max(SLAB_ROWS * width, ERROR_SLAB))

    per_layer = [4 * sum(w * w for _o, w in s) + max(quantizing(o, w) for o, w in s) for s in shapes.values()]
    return max(per_layer, default=0)


# ---------------------------------------------------------------- W4A8

# W4A8: int4 weights (symmetric per group or channel) and activations quantized dynamically per token at run
# time, stored as the vLLM 0.32 compressed-tensors schemes load them. How vLLM picks the scheme
# (compressed_tensors.py, CompressedTensorsConfig._get_scheme_from_parts):
# - int8: `_is_dynamic_token_w4a8_int` in an activation format (int-quantized) -> CompressedTensorsW4A8Int, whose
#   `weight` is int8 [out, in], one int4 value per byte, with `weight_scale` [out, in / group]. That is what
#   compressed-tensors 0.19 writes for int weights with activations (its format inference puts int-quantized
#   before pack-quantized). Packed instead, the group would go to CompressedTensorsWNA8Int (`_is_wNaM_int`,
#   Humming on CUDA), which vLLM's CPU build runs as a weight-only CPUWNA16 matmul.
# - fp8: `_is_fp8_w4a8_sm90` -> CompressedTensorsW4A8Fp8 (CUTLASS W4A8, compute capability 9.0 exactly), whose
#   `weight_packed` is int32 [out, in / 8] with `weight_shape`, group size 128 (pack-quantized). compressed-tensors
#   infers int-quantized here too (unpacked int8, which that scheme has no parameter for), so the config
#   group names its format: `format: pack-quantized` (compressed-tensors' own packer writes it).
W4A8_ACTIVATIONS = {
    "int8": {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"},
    "fp8": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"},
}
W4A8_FORMATS = {"int8": "int-quantized", "fp8": "pack-quantized"}
W4A8_FP8_GROUP = compressed_tensors.W4A8_FP8_GROUP  # vLLM's W4A8-FP8 kernel: group 128, widths multiples of 128


def activations_of(options) -> str:
    """gptq's activations option; none for the methods that share gptq's resolve and shape rules (awq, autoround)."""
    return getattr(options, "activations", "none")


def w4a8_group(activations: str) -> dict:
    """The config group's fields beside its weights: the activations and the stored format."""
    return {"input_activations": dict(W4A8_ACTIVATIONS[activations]), "format": W4A8_FORMATS[activations]}


def check_activations(info, options) -> None:
    """W4A8 before any work: 4-bit symmetric weights, group size 128 with fp8 activations, a dense model, no
    per-layer plan (its int8 layers are weight-only)."""
    if options.activations == "none":
        return
    what = f"gptq: activations={options.activations} (W4A8)"
    if options.bits != 4:
        raise InputError(f"{what} quantizes 4-bit weights; bits={options.bits} was asked",
                         hint="drop --bits; int8 weights with int8 activations are --method smoothquant")
    if options.symmetric is False:
        raise InputError(f"{what}: vLLM's W4A8 schemes take symmetric weights only (no zero points)",
                         hint="drop --asymmetric")
    if options.activations == "fp8" and options.group_size != W4A8_FP8_GROUP:
        raise InputError(f"{what}: vLLM's W4A8-FP8 kernel (CUTLASS) takes group size {W4A8_FP8_GROUP} only; "
                         f"group_size={options.group_size} was asked", hint="drop --group-size")
    if mixed(options):
        raise InputError(f"{what} cannot take {mixed_label(options)}: its int8 layers are weight-only",
                         hint=f"drop --{mixed_label(options).replace('_', '-')}, or use activations none (W4A16)")
    if moe.moe_layout(info.config) is not None:
        raise UnsupportedError(f"{what}: mixture-of-experts models are not offered with W4A8",
                               hint="use activations none (W4A16) for this model")


def w4a8_fp8_width_problems(info, ignore: list[str]) -> dict[str, str]:
    """The layers whose output or input width is not a multiple of 128, which vLLM's W4A8-FP8 kernel refuses."""
    from quantkit.arch.roles import matches

    return {name: f"{name}: its widths {out} x {inp} are not multiples of {W4A8_FP8_GROUP} (vLLM's W4A8-FP8 "
                  "kernel, CUTLASS, needs both)"
            for name, (out, inp) in quantized_linears(info).items()
            if not matches(name, ignore) and (out % W4A8_FP8_GROUP or inp % W4A8_FP8_GROUP)}


def support(family) -> str:
    return family.decoder_support("✅")


def compressed_scheme(options) -> str:
    """The compressed-tensors scheme: int weights with 16-bit activations (wNa16), or W4A8 (w4a8-int8, w4a8-fp8)
    for gptq's `activations`; awq and autoround, which share it, have 16-bit activations."""
    activations = activations_of(options)
    return f"w{options.bits}a16" if activations == "none" else f"w4a8-{activations}"


AUTO_RUNGS = (AutoRung("gptq W8A16", (("bits", 8),), "gptq"), AutoRung("gptq W4A16", (("bits", 4),), "gptq"))

METHOD = MethodSpec(
    name="gptq", format=compressed_tensors.FORMAT, label="compressed-tensors (pack-quantized, int weights)",
    scheme=compressed_scheme, engine=llmc.ENGINE, options=Options, quantize=quantize, precision=precision,
    default_gate=fixed_gate(DEFAULT_GATE), resolve=resolve, check=check, needs_calibration=needs_calibration,
    support=support,
    layers=Layers(shape_problems=shape_problems, quantizes_fused_experts=llmc.quantizes_fused_experts),
    sizes=Sizes(stored_bits=stored_bits, working_set=working_set),
    fallback=FallbackSteps(fallback_ladder, requantize),
    resume=Resume(**layer_resume.resume_fields()),
    ranks=OnRanks(),
    towers=Towers(quantizes=True),
    auto=AUTO_RUNGS,
)
