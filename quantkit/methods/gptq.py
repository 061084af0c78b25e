"""GPTQ weight-only integer quantization (W4A16 / W8A16) through llm-compressor.

Output: compressed-tensors `pack-quantized` (int weights packed into int32), served by vLLM
(Marlin kernels). Calibration windows run through the model layer by layer (sequential
pipeline): each decoder layer's linears collect a Hessian from its inputs, are quantized
column block by column block with error feedback, and the quantized outputs feed the next layer.

`auto_precision`: some layers int8 (per channel) or 16-bit instead of int4, chosen by measured
sensitivity under a size budget (quantkit.methods.intmix), as extra config groups / ignore entries.

`fallback` (gate-driven): when the artifact fails its gate, the layers with the largest predicted
damage at their current precision go one step up (int4 -> int8 -> 16-bit) and the model is quantized
again from the base, until the gate passes or `max_size` is spent (quantkit.pipeline.run_fallback
re-measures after each step). The damage is the sensitivity table auto_precision recorded, else one
measured at the first fallback step. GPTQ quantizes and compresses job.model in place, and the pipeline
frees it before measuring, so every step loads the base model again (llmc.reloaded_model).

Also home of the checks shared by the weight-only integer methods (awq, smoothquant):
`check_group_size`, `check_calibration_tokens`, `quantized_linears`.
"""

from __future__ import annotations

from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict

from quantkit.errors import CalibrationError, InputError, UnsupportedError
from quantkit.methods import MethodSpec, QuantizeJob, QuantizeResult, fixed_gate, intmix, llmc, moe
from quantkit.mixed import Fallback

# A fallback step's room for what config.json and the safetensors header add per raised layer (its name in
# the int8 config group or the ignore list, its tensors' entries): the size model counts tensor bytes only.
METADATA_BYTES = 256

# 4-bit rounding costs a few percent of perplexity even with GPTQ's error feedback.
DEFAULT_GATE = {"max_ppl_increase": 0.10, "max_kld": 0.10, "min_top1": 0.80}

SUPPORTED_BITS = (4, 8)
# GPTQ inverts a Hessian estimated from calibration activations; with fewer tokens than this
# the estimate is rank-deficient for any real hidden size and the result is noise.
MIN_CALIBRATION_TOKENS = 1024
QUANTIZED_ROLES = ("decoder", "other")


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bits: int = 4
    group_size: int = 128  # -1: one scale per output channel
    symmetric: bool = True
    act_order: Literal["none", "static", "group"] = "static"
    dampening: float = 0.01  # fraction of the mean Hessian diagonal added before inversion
    block_size: int = 128
    auto_precision: intmix.AutoPrecision | None = None  # per-layer int4/int8/16-bit (quantkit.methods.intmix)
    fallback: Fallback | None = None  # on a failed gate, raise the most damaging layers' precision (quantkit.mixed)


def needs_calibration(options: Options) -> bool:
    return True


def granularity(group_size: int) -> str:
    return "per-channel" if group_size == -1 else f"g{group_size}"


def precision(role: str, options: Options, name: str, shape: list[int]) -> str | None:
    if role not in QUANTIZED_ROLES:
        return None
    sym = "sym" if options.symmetric else "asym"
    order = "" if options.act_order == "none" else f", act-order {options.act_order}"
    auto = "; auto-precision: int8 or 16-bit where measured sensitive" if options.auto_precision else ""
    auto += "; fallback: int8 or 16-bit where the gate fails" if options.fallback else ""
    return f"int{options.bits} {granularity(options.group_size)} {sym} (GPTQ{order}{auto})"


# ---------------------------------------------------------------- checks (shared)


def quantized_linears(info) -> dict[str, list[int]]:
    """Linear weights the int methods quantize: decoder/other roles, VLM towers and lm_head excluded."""
    from quantkit.plan import classify, linear_weights

    return {name: shape for name, shape in linear_weights(info).items()
            if classify(name + ".weight", info.towers) in QUANTIZED_ROLES}


def check_bits(bits: int, method: str) -> None:
    if bits not in SUPPORTED_BITS:
        raise UnsupportedError(f"{method}: bits={bits} is not supported",
                               hint=f"use one of: {', '.join(map(str, SUPPORTED_BITS))}")


def check_group_size(info, group_size: int, method: str) -> None:
    """The group size must divide the input width of every quantized linear."""
    if group_size == -1:
        return
    if group_size < 1:
        raise InputError(f"{method}: group_size={group_size} is invalid", hint="use a positive size, or -1 per channel")
    widths = {name: in_features for name, (_out, in_features) in quantized_linears(info).items()}
    for name, in_features in widths.items():
        if in_features % group_size:
            raise InputError(
                f"{method}: group_size={group_size} does not divide the input width {in_features} of {name}",
                hint=f"group sizes that divide every layer's input width: {dividing_group_sizes(widths.values())}; "
                "or -1 (one scale per output channel)",
            )


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


def expert_storage_problem(symmetric: bool, act_order: str = "none") -> str | None:
    """What int weights would store per MoE expert that transformers cannot reload (None: nothing)."""
    if not symmetric:
        return "asymmetric int weights store a zero point per expert"
    if act_order == "group":
        return "act_order=group stores a g_idx per expert"
    return None


def check_moe(info, symmetric: bool, act_order: str, method: str) -> None:
    moe.check_supported(info, method)
    moe.check_expert_storage(info, method, expert_storage_problem(symmetric, act_order),
                             hint="use --symmetric (option symmetric: true) and act_order none or static")


def check(info, options: Options, calibration) -> None:
    check_moe(info, options.symmetric, options.act_order, "gptq")
    check_bits(options.bits, "gptq")
    check_group_size(info, options.group_size, "gptq")
    if options.act_order == "group" and options.group_size == -1:
        raise InputError("gptq: act_order=group needs a group size", hint="use act_order static, or a group_size")
    if not 0 <= options.dampening < 1:
        raise InputError(f"gptq: dampening={options.dampening} must be in [0, 1)")
    if options.block_size < 1:
        raise InputError(f"gptq: block_size={options.block_size} must be positive")
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
    from quantkit.methods.moe import is_moe
    from quantkit.model import is_vlm

    label = mixed_label(options)
    flag = "--" + label.replace("_", "-")
    if options.bits != 4:
        raise InputError(f"{method}: {label} starts every layer at int4; bits={options.bits} leaves nothing "
                         "to choose", hint=f"drop --bits (4 is the default) or {flag}")
    if getattr(options, "act_order", "none") == "group":
        raise InputError(f"{method}: {label}'s int8 layers are per channel, which act_order=group cannot order",
                         hint="use act_order static or none")
    if is_moe(info.model_type) or is_vlm(info.config):
        kind = "MoE models" if is_moe(info.model_type) else "VLMs"
        raise UnsupportedError(f"{method}: {label} is not supported for {kind} ({info.architecture}): its "
                               "sensitivity pass reads the checkpoint's layers by module name and streams a "
                               "text decoder", hint=f"quantize without {flag}")


# ---------------------------------------------------------------- quantize


def weight_args(bits: int, group_size: int, symmetric: bool) -> dict:
    """compressed-tensors QuantizationArgs for static int weights."""
    args = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False}
    if group_size == -1:
        return {**args, "strategy": "channel"}
    return {**args, "strategy": "group", "group_size": group_size}


def scheme_config(options: Options) -> dict:
    weights = weight_args(options.bits, options.group_size, options.symmetric)
    return {"group_0": {"targets": ["Linear"], "weights": weights}}


def modifier(options: Options, ignore: list[str], config_groups: dict | None = None):
    from llmcompressor.modifiers.gptq import GPTQModifier

    return GPTQModifier(
        config_groups=config_groups or scheme_config(options),
        ignore=ignore,
        actorder=None if options.act_order == "none" else options.act_order,
        dampening_frac=options.dampening,
        block_size=options.block_size,
    )


def quantize(job: QuantizeJob) -> QuantizeResult:
    details = llmc.calibration_details(job)
    ignore, choice = llmc.decoder_ignore(job), None
    if job.options.auto_precision is not None:
        choice, mixed_details = auto_precision(job, ignore, scheme(job))
        details.update(mixed_details)
    write(job, ignore, choice)
    return QuantizeResult(job.out_dir, details)


def write(job: QuantizeJob, ignore: list[str], choice: dict[str, str] | None) -> None:
    """GPTQ of job.model into job.out_dir: one int4 group for every Linear, or the per-layer `choice`
    ({module name: int4|int8|16-bit}: an int8 group by exact names, the 16-bit layers ignored)."""
    groups = None
    if choice is not None:
        ignore, groups = ignore + intmix.kept_16bit(choice), intmix.config_groups(choice, scheme(job))
    llmc.run_oneshot(job, modifier(job.options, ignore, groups), calibrate=True, reads_weights_only=True)
    llmc.save_compressed(job)


# ---------------------------------------------------------------- auto precision


def budgeted_layers(job: QuantizeJob, ignore: list[str]) -> dict[str, tuple[int, int]]:
    """{module name: (out, in)} of the Linear layers the int4 group quantizes (the ones a budget may raise)."""
    import torch

    from quantkit.plan import classify, matches

    return {name: tuple(module.weight.shape) for name, module in job.model.named_modules()
            if type(module) is torch.nn.Linear and classify(name + ".weight", job.info.towers) in QUANTIZED_ROLES
            and not matches(name, ignore)}


def scheme(job: QuantizeJob) -> intmix.Scheme:
    import torch

    linear = next(m for m in job.model.modules() if type(m) is torch.nn.Linear)
    return intmix.Scheme(job.options.group_size, job.options.symmetric, linear.weight.element_size())


def importance(job: QuantizeJob, names) -> dict:
    """{module name: mean x_j^2 per input column} on the calibration windows (streamed forward)."""
    from quantkit.methods.gguf import compute_imatrix

    return compute_imatrix(job, job.windows.calib, {name: name for name in names}).weights()


def layer_table(job: QuantizeJob, layers: dict[str, tuple[int, int]], chosen: intmix.Scheme) -> intmix.LayerTable:
    """The sensitivity table of `layers` (budgeted_layers), with the auto_precision options'
    measure_windows (their default for a fallback without auto_precision)."""
    import time

    auto, started = job.options.auto_precision or intmix.AutoPrecision(), time.perf_counter()
    weights = importance(job, layers)
    imatrix_s = round(time.perf_counter() - started, 3)
    table = intmix.measure(job.info.path, layers, weights, job.windows.calib, auto, chosen, job.workdir)
    table.seconds = {"importance": imatrix_s, **table.seconds, "total": round(time.perf_counter() - started, 3)}
    return table


def greedy_plan(rows: list[intmix.LayerSensitivity], allowed: int, chosen: intmix.Scheme) -> dict[str, str]:
    """gptq's plan: every layer on its own (quantkit.mixed.assign)."""
    from quantkit.mixed import assign

    return assign(rows, allowed, chosen.size)


def auto_precision(job: QuantizeJob, ignore: list[str], chosen: intmix.Scheme,
                   plan: Callable[[list, int, intmix.Scheme], dict[str, str]] = greedy_plan
                   ) -> tuple[dict[str, str], dict]:
    """({module name: int4|int8|16-bit}, report details): the sensitivity table and the plan under the budget.
    `plan(rows, allowed bytes, scheme)`: how the budget is spent (awq ties layers that share a scale)."""
    layers = budgeted_layers(job, ignore)
    allowed, int4 = intmix.budget_bytes(job.options.auto_precision, list(layers.values()), chosen)
    table = layer_table(job, layers, chosen)
    choice = plan(table.layers, allowed, chosen)
    return choice, {"sensitivity": table.as_dict(),
                    "mixed_precision": intmix.plan_report(table.layers, choice, allowed, int4, chosen)}


# ---------------------------------------------------------------- gate-driven fallback


Writer = Callable[[QuantizeJob, list[str], dict[str, str]], object]
Units = Callable[[list[intmix.LayerSensitivity], dict[str, str]], list[intmix.TiedLayers]]


def single_layers(table: list[intmix.LayerSensitivity], current: dict[str, str]) -> list[intmix.TiedLayers]:
    """gptq's fallback units: every layer raised on its own."""
    return [intmix.TiedLayers(row.name, [row]) for row in table]


def fallback(job: QuantizeJob, result: QuantizeResult, write: Writer = write,
             units: Units = single_layers) -> QuantizeResult | None:
    """The artifact quantized again from the base model with the layers of largest predicted damage one
    precision up, or None when no raise fits in Fallback.max_size (measured against the first artifact).
    `write(job, ignore, plan)` quantizes job.model into job.out_dir with a per-layer plan; `units(table,
    current plan)` are what one raise moves together (awq: its tied balance layers, capped at int8)."""
    from contextlib import ExitStack

    details = dict(result.details)
    with ExitStack() as loaded:
        if "sensitivity" not in details:  # plain W4A16 first: measure the table once, with the model loaded
            loaded.enter_context(llmc.reloaded_model(job))
            layers = budgeted_layers(job, llmc.decoder_ignore(job))
            details["sensitivity"] = layer_table(job, layers, scheme(job)).as_dict()
        choice = next_plan(job, result, details, units)
        if choice is None:
            return None
        if job.model is None:
            loaded.enter_context(llmc.reloaded_model(job))
        llmc.clear_weights(job.out_dir)
        write(job, llmc.decoder_ignore(job), choice)
    return QuantizeResult(job.out_dir, details)


def next_plan(job: QuantizeJob, result: QuantizeResult, details: dict,
              units: Units = single_layers) -> dict[str, str] | None:
    """One fallback step's per-layer plan ({module name: precision}); details gets its mixed_precision
    report and fallback_state (the first artifact's bytes, the layers raised). None: nothing fits.
    A unit moves as one: its members take the unit's next candidate (from its lowest member's)."""
    from quantkit.export import artifact_bytes
    from quantkit.mixed import raise_step, size_limit, step_count, total_bytes

    opts = job.options
    table = intmix.LayerTable.from_dict(details["sensitivity"]).layers
    chosen = intmix.Scheme(opts.group_size, opts.symmetric, element_bytes(job))
    current = details.get("mixed_precision", {}).get("types") or {r.name: "int4" for r in table}
    now = artifact_bytes(result.artifact)
    state = details.get("fallback_state") or {"first_bytes": now}
    limit = size_limit(opts.fallback.max_size, state["first_bytes"])
    moved = units(table, current)
    unit_current = {u.name: min((current[m.name] for m in u.members), key=intmix.PRECISIONS.index) for u in moved}
    raised_units = raise_step(moved, unit_current, step_count(opts.fallback.tensors_per_step, len(moved)), limit - now,
                              lambda unit, p: sum(chosen.size(m, p) + (0 if p == "int4" else METADATA_BYTES)
                                                  for m in unit.members))
    members = {u.name: u.members for u in moved}
    choice = dict(current)
    for name, (_, new) in raised_units.items():
        choice.update({m.name: new for m in members[name]})
    if raised_units and set(choice.values()) == {"16-bit"}:  # one quantized layer needed: the last raised stays
        last = list(raised_units)[-1]
        choice.update({m.name: current[m.name] for m in members[last]})
        del raised_units[last]
    raised = {m.name: (current[m.name], choice[m.name]) for name in raised_units for m in members[name]
              if choice[m.name] != current[m.name]}  # most damaging unit first
    if not raised:
        return None
    layers_budget = limit - (now - total_bytes(table, current, chosen.size))  # what the layers may take
    int4 = total_bytes(table, {r.name: "int4" for r in table}, chosen.size)
    details["mixed_precision"] = intmix.plan_report(table, choice, layers_budget, int4, chosen)
    details["fallback_state"] = {**state, "raised": {n: f"{a}->{b}" for n, (a, b) in raised.items()}}
    return choice


def element_bytes(job: QuantizeJob) -> int:
    """Bytes per element of the model as loaded (its scales and 16-bit layers are saved in that dtype)."""
    from quantkit.model import torch_dtype

    return torch_dtype(job.dtype, job.info).itemsize


METHOD = MethodSpec(
    quantizes_towers=True, name="gptq", engine=llmc.ENGINE, engine_package=llmc.ENGINE,
    format="compressed-tensors (pack-quantized, int weights)",
    options=Options, quantize=quantize, precision=precision, default_gate=fixed_gate(DEFAULT_GATE),
    check=check, needs_calibration=needs_calibration,
    fallback=fallback,
    wants_fallback=lambda options: options.fallback is not None,
)
