"""AWQ (activation-aware weight quantization) W4A16 asymmetric through llm-compressor.

AWQModifier searches per-channel scales between each smooth layer and the linears it feeds
(mappings per architecture in `awq_mappings`), then QuantizationModifier rounds the scaled
weights to int4 with a zero point per group. Output: compressed-tensors `pack-quantized`
with `weight_zero_point`, served by vLLM (Marlin).

backend "autoawq" (the archived AutoAWQ package, GEMM format) is accepted as an option so
recipes can name it, but it is refused before any work with a clear reason: not installed
(MissingExtraError), or installed but its GEMM checkpoint cannot be reloaded by transformers 5
without `gptqmodel`, so the gate could not measure it (see docs/methods.md).

`auto_precision`: per-layer int4 / int8 (per channel) / 16-bit under a size budget, with gptq's
machinery (quantkit.mixed.layers: the same sensitivity table, size model and config groups), and two
constraints from llm-compressor 0.14.0.1's AWQModifier (modifiers/transform/awq/base.py):
* its grid search (`_compute_best_scale`) fake-quantizes every balance layer of a mapping with the
  scheme of the *last* balance layer (`w_qscheme` is read in the loop before, not per layer): mixed
  int4 / int8 balance layers under one smoothing scale crash (a per-channel scale against a group
  weight) or are searched with the wrong scheme. So the quantized balance layers of one mapping in one
  decoder layer (q/k/v, gate/up) share one precision: the plan chooses per such group (`tied_plan`).
  16-bit balance layers have no scheme, are left exact in the search and smoothed like the others.
* with duo_scaling, `_compute_layer_means` averages over the quantized balance layers and divides by
  their count: a mapping whose smooth layer is a quantized Linear (up_proj -> down_proj; v_proj ->
  o_proj where the widths match) must keep a balance layer quantized; where the plan keeps them all
  16-bit they go back to int8 (fewer bytes, so still within the budget; `keep_balance_quantized`).

`fallback` (gate-driven): gptq's ladder (gptq.fallback_ladder: the base model reloaded, the plan one
precision up where the predicted damage is largest, AWQ run again and re-gated until the gate passes or
`max_size` is spent), with the same two constraints on every raised plan (`fallback_units`): a tied group
of balance layers is raised as one unit, and the balance layers of a row whose smooth layer is quantized
go no higher than int8 (a step never leaves them all 16-bit).

`group_size: auto` (the default) as gptq's (gptq.auto_group_size).

On torchrun ranks: each rank collects AWQ's activation statistics on its share of the windows and llm-compressor
0.14.0.1 sums them and the grid search's losses over the ranks, so every rank finds the one-process scales; rank 0
alone writes the smoothed weights the ranks share (quantkit.engines.llmcompressor.one_writer). On 2 gloo ranks the
micro toy model's artifact is the one-process artifact bit for bit.

CPU workaround: llm-compressor 0.14.0.1 pins the cached parent-module inputs in host memory
before AWQ's grid search (`IntermediatesCache.pin_memory`, called from
`AWQModifier._apply_smoothing`); `Tensor.pin_memory()` raises "Cannot access accelerator
device when none is available" on a machine without an accelerator. `cpu_pin_memory_guard`
turns exactly that method into a no-op while AWQ runs, and only when no accelerator exists
(pinning only speeds up host-to-device copies, which never happen then).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator, Literal

from pydantic import BaseModel, ConfigDict

from quantkit.arch.mappings import model_mappings
from quantkit.engines.llmcompressor import layer_resume, llmc
from quantkit.errors import InputError, MissingExtraError, UnsupportedError
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
from quantkit.mixed.sensitivity import SensitivityRow

# 4-bit weights: the same looser gate as GPTQ.
DEFAULT_GATE = {"max_ppl_increase": 0.10, "max_kld": 0.10, "min_top1": 0.80}



class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bits: int = 4
    group_size: int | Literal["auto"] = "auto"  # -1: one scale per output channel; auto: gptq.auto_group_size
    symmetric: bool = False
    duo_scaling: bool | Literal["both"] = True
    n_grid: int = 20
    backend: Literal["llmcompressor", "autoawq"] = "llmcompressor"
    auto_precision: gptq.AutoPrecision | None = None  # per-layer int4/int8/16-bit (quantkit.mixed.layers)
    fallback: Fallback | None = None  # on a failed gate, raise the most damaging layers' precision (quantkit.mixed.budget)


# the fewest grid points llm-compressor 0.14.0.1's scale search divides by without a zero
# (AWQModifier._get_grid_search_params: n_grid - 2 with duo_scaling, n_grid - 1 without, n_grid // 2 - 1 for both)
MIN_GRID = {True: 3, False: 2, "both": 4}


def needs_calibration(options: Options) -> bool:
    return True


def precision(role: str, options: Options, name: str, shape: list[int]) -> str | None:
    if role not in gptq.QUANTIZED_ROLES:
        return None
    sym = "sym" if options.symmetric else "asym"
    return f"int{options.bits} {gptq.granularity(options.group_size)} {sym} (AWQ{gptq.mixed_suffix(options)})"


def check_backend(backend: str) -> None:
    """autoawq: say honestly why it cannot be used here (missing, or its output cannot be gated)."""
    if backend != "autoawq":
        return
    import importlib.util

    if importlib.util.find_spec("awq") is None:
        raise MissingExtraError("autoawq", "autoawq", "awq backend 'autoawq'")
    if importlib.util.find_spec("gptqmodel") is None:
        raise UnsupportedError(
            "awq backend 'autoawq' cannot be gated here: transformers 5 loads AutoAWQ GEMM checkpoints only "
            "through the 'gptqmodel' package, which is not installed, so the artifact could not be reloaded "
            "and measured",
            hint="use the default backend 'llmcompressor' (compressed-tensors, served by vLLM)",
        )
    raise UnsupportedError(
        "awq backend 'autoawq' is not implemented in this version of quantkit (AutoAWQ 0.2.9 is archived)",
        hint="use the default backend 'llmcompressor' (compressed-tensors, served by vLLM)",
    )


def check(info, options: Options, calibration) -> None:
    check_backend(options.backend)
    gptq.check_moe(info, options.symmetric, "none", "awq")  # first: an MoE layout it lacks refuses every method
    model_mappings(info, "awq")
    gptq.check_bits(options.bits, "awq")
    gptq.check_group_size(options.group_size, "awq")
    least = MIN_GRID[options.duo_scaling]
    if options.n_grid < least:
        raise InputError(f"awq: n_grid={options.n_grid} is too small for duo_scaling {options.duo_scaling}: "
                         f"the scale search needs at least {least} grid points",
                         hint="e.g. n_grid: 20 in the target's options")
    gptq.check_calibration_tokens(calibration, "awq")
    if gptq.mixed(options):
        gptq.check_auto_precision(info, options, "awq")


# ---------------------------------------------------------------- the CPU workaround


@contextmanager
def cpu_pin_memory_guard() -> Iterator[bool]:
    """No-op `IntermediatesCache.pin_memory` while inside, only without an accelerator.

    Yields whether the patch is active. The original method is restored on exit.
    """
    import torch

    from quantkit.engines.patches import patched

    if torch.accelerator.is_available():
        yield False
        return
    with patched("awq.pin_memory"):
        yield True


# ---------------------------------------------------------------- quantize


def mappings(info) -> list:
    """llm-compressor's AWQ mappings: the table's AWQ rows for this model (quantkit.arch.mappings)."""
    from llmcompressor.modifiers.transform.awq import AWQMapping

    return [AWQMapping(m.smooth, list(m.balance)) for m in model_mappings(info, "awq") if m.awq]


def modifiers(options: Options, info, ignore: list[str], config_groups: dict | None = None) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    weights = llmc.weight_args(options.bits, options.group_size, options.symmetric)
    return [
        AWQModifier(mappings=mappings(info), duo_scaling=options.duo_scaling,
                    n_grid=options.n_grid),
        QuantizationModifier(config_groups=config_groups or {"group_0": {"targets": ["Linear"], "weights": weights}},
                             ignore=ignore),
    ]


def quantize(job: QuantizeJob) -> QuantizeResult:
    ignore, choice = llmc.decoder_ignore(job), None
    details = llmc.calibration_details(job)
    if job.options.auto_precision is not None:
        layers = gptq.budgeted_layers(job.info, ignore)
        ties, rows = balance_groups(job.info, list(layers)), linear_rows(job.info, layers)
        choice, mixed = gptq.auto_precision(
            job, ignore, gptq.scheme(job), lambda table, allowed, scheme: keep_balance_quantized(
                tied_plan(table, ties, allowed, scheme), rows))
        details.update(mixed)
    patched = write(job, ignore, choice)
    return QuantizeResult(job.out_dir, {**details, "cpu_pin_memory_workaround": patched})


def write(job: QuantizeJob, ignore: list[str], choice: dict[str, str] | None) -> bool:
    """AWQ of job.model into job.out_dir: int4 for every Linear, or the per-layer `choice` ({module
    name: int4|int8|16-bit}: an int8 group by exact names, the 16-bit layers ignored). Returns whether
    the CPU pin_memory workaround was active."""
    ignore, groups = gptq.choice_groups(job, ignore, choice)
    recipe = modifiers(job.options, job.info, ignore, groups)
    with cpu_pin_memory_guard() as patched:
        llmc.run_oneshot(job, recipe, calibrate=True)
    llmc.save_compressed(job)
    return patched


# ---------------------------------------------------------------- auto precision

DECODER_LAYER = re.compile(r"^(.*\.layers\.\d+)\.")


def balance_groups(info, names: list[str]) -> list[list[str]]:
    """The layers of `names` that must share one precision: the balance layers of one AWQ mapping in
    one decoder layer (q/k/v, gate/up); every other layer alone."""
    from quantkit.arch.roles import matches

    keyed: dict[tuple, list[str]] = {}
    for index, row in enumerate(model_mappings(info, "awq")):
        if not row.awq:
            continue
        for name in names:
            if matches(name, list(row.balance)):
                layer = DECODER_LAYER.match(name)
                keyed.setdefault((index, layer.group(1) if layer else name), []).append(name)
    groups: list[list[str]] = []
    for members in keyed.values():  # merge groups sharing a layer (none in the mapping table today)
        overlapping = [g for g in groups if set(g) & set(members)]
        merged = [n for g in overlapping for n in g] + [n for n in members if not any(n in g for g in overlapping)]
        groups = [g for g in groups if g not in overlapping] + [merged]
    grouped = {n for g in groups for n in g}
    return groups + [[n] for n in names if n not in grouped]


def tied_plan(table: list[SensitivityRow], groups: list[list[str]], allowed: int,
              scheme: gptq.Scheme) -> dict[str, str]:
    """quantkit.mixed.budget.assign over the balance groups: {module name: precision}, one per group."""
    from quantkit.mixed.budget import Unit, assign

    rows = {r.name: r for r in table}
    tied = [Unit(group[0], [rows[n] for n in group]) for group in groups if all(n in rows for n in group)]
    choice = assign(tied, allowed, lambda t, p: sum(scheme.nbytes(m.shape, p) for m in t.members))
    return {m.name: choice[t.name] for t in tied for m in t.members}


def linear_rows(info, layers: dict[str, tuple[int, int]]) -> list[tuple[str, list[str]]]:
    """(smooth layer, its balance layers) of the AWQ rows whose smooth layer is one of `layers`
    ({module name: (out, in)}), resolved per decoder layer (the balance layers are the smooth layer's
    siblings), leaving out those llm-compressor skips (a balance layer whose input width differs from
    the smooth layer's output width: v_proj -> o_proj under grouped-query attention)."""
    from quantkit.arch.roles import matches

    rows = []
    for row in model_mappings(info, "awq"):
        if not row.awq:
            continue
        for smooth in (name for name in layers if matches(name, [row.smooth])):
            parent = smooth.rsplit(".", 1)[0]
            balance = [name for name in layers
                       if name.rsplit(".", 1)[0] == parent and matches(name, list(row.balance))]
            if balance and all(layers[b][1] == layers[smooth][0] for b in balance):
                rows.append((smooth, balance))
    return rows


def keep_balance_quantized(choice: dict[str, str], rows: list[tuple[str, list[str]]]) -> dict[str, str]:
    """The plan with the balance layers of each linear_rows row at int8 where its smooth layer is
    quantized and the plan kept every balance layer 16-bit (see the module docstring)."""
    fixed = dict(choice)
    for smooth, balance in rows:
        if fixed[smooth] != "16-bit" and all(fixed[b] == "16-bit" for b in balance):
            fixed.update({b: "int8" for b in balance})
    return fixed


# ---------------------------------------------------------------- gate-driven fallback


def fallback_units(info, table: list[SensitivityRow], current: dict[str, str]) -> list:
    """What one fallback raise moves together (quantkit.mixed.budget.Unit), so that every raised plan keeps AWQ's
    constraints: the balance groups (q/k/v, gate/up share one precision), each capped at int8 while it
    holds a balance layer of a linear_rows row whose smooth layer `current` keeps quantized (raised to
    16-bit, that row's balance layers would leave AWQ's duo scaling nothing to average over)."""
    from quantkit.mixed.budget import Unit

    rows = {r.name: r for r in table}
    shapes = {r.name: r.shape for r in table}
    capped = {name for smooth, balance in linear_rows(info, shapes) if current[smooth] != "16-bit"
              for name in balance}
    return [Unit(group[0], [rows[n] for n in group], "int8" if set(group) & capped else None)
            for group in balance_groups(info, list(rows))]


def fallback_ladder(job: QuantizeJob, result: QuantizeResult):
    """gptq's ladder with AWQ's tied, capped units (fallback_units)."""
    return gptq.fallback_ladder(job, result, lambda table: lambda plan: fallback_units(job.info, table, plan))


def requantize(job: QuantizeJob, plan: dict[str, str], details: dict) -> QuantizeResult:
    """AWQ again from the base model with the per-layer plan."""
    return gptq.requantize_with(write, job, plan, details)


def check_ignore(info, options: Options, ignore: list[str]) -> None:
    """A smoothing row whose smooth layer is quantized needs a quantized balance layer: llm-compressor's
    duo scaling divides by their count (ZeroDivisionError after loading and calibrating)."""
    from quantkit.arch.roles import matches

    for smooth, balance in linear_rows(info, gptq.quantized_linears(info)):
        if not matches(smooth, ignore) and all(matches(b, ignore) for b in balance):
            raise InputError(f"awq: the ignore list keeps {', '.join(balance)} 16-bit while {smooth}, whose "
                             "output it smooths them against, is quantized; llm-compressor's AWQ cannot "
                             "search that scale", hint=f"ignore {smooth} as well, or quantize {balance[0]}")


def support(family) -> str:
    return (family.smoothing_refusal() or family.expert_reload_refusal("zero points (symmetric: true takes it)")
            or family.decoder_support("✅"))


ROTATION_REFUSED = ("llm-compressor applies the rotation when calibration starts, and AWQ then scales the input "
                    "channels of Linears whose inputs an online Hadamard rotation has mixed, so the smoothed model "
                    "would not be the original; AWQ after SpinQuant is not offered either (not measured)")


AUTO_RUNGS = (AutoRung("awq W4A16"),)  # --method auto (quantkit.run.auto)

METHOD = MethodSpec(
    name="awq", format=compressed_tensors.FORMAT, label="compressed-tensors (pack-quantized, int4 asymmetric)",
    scheme=gptq.compressed_scheme, engine=llmc.ENGINE, options=Options, quantize=quantize, precision=precision,
    default_gate=fixed_gate(DEFAULT_GATE), resolve=gptq.resolve, check=check, needs_calibration=needs_calibration,
    support=support, rotation_refused=ROTATION_REFUSED,
    layers=Layers(check_ignore=check_ignore, shape_problems=gptq.shape_problems,
                  quantizes_fused_experts=llmc.quantizes_fused_experts),
    sizes=Sizes(stored_bits=gptq.stored_bits),
    fallback=FallbackSteps(fallback_ladder, requantize),
    resume=Resume(**layer_resume.resume_fields()),
    ranks=OnRanks(),
    towers=Towers(quantizes=True),
    auto=AUTO_RUNGS,
)
