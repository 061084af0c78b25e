"""Per-layer precision of Linear layers: int4 / int8 / 16-bit for gptq and awq (`auto_precision`,
`fallback`), and the 16-bit fallback of fp8, smoothquant and nf4.

A method's precisions of one layer are simulated (`Simulation`): the weight the layer effectively
applies to its own input, dequantized (compressed-tensors' own rounding for int and fp8 weights,
bitsandbytes' for nf4, the artifact's own GPTQ weights for smoothquant), and, for a method that
quantizes activations, the transform its input goes through (per-token fp8 or int8, after
SmoothQuant's division by the smoothing scales). The error of a precision p is the mean squared
error it adds to the layer's output, for inputs with the calibration windows' statistics:

    error(layer, p) = sum_j imp_j * |W - W_p|^2_j + sum_j act_j(p) * |W_p|^2_j        (16-bit: 0)

imp_j = mean x_j^2 of the layer's input column j and act_j(p) = mean (t_p(x) - x)_j^2 of what the
activation quantization moves it by, both over the calibration windows (one layer-streamed forward,
`input_statistics`); |.|^2_j sums a weight column's squares. The errors become KL divergence through
gains measured for a few probe layers per role and interpolated over depth (quantkit.mixed.budget).

Size model of gptq/awq: the bytes a compressed-tensors pack-quantized checkpoint stores for one
Linear of shape (out, in), E = bytes per element of the checkpoint's dtype (2 for bf16/fp16):

    int4 (group g):  weight_packed  out * ceil(in/8) * 4          (8 values per int32)
                     weight_scale   out * (in/g) * E
                     zero point     ceil(out/8) * (in/g) * 4      (asymmetric only; packed along out)
                     weight_shape   16                            (2 x int64)
    int8 (channel):  weight_packed  out * ceil(in/4) * 4,  weight_scale out * E,
                     zero point     ceil(out/4) * 4 (asymmetric only),  weight_shape 16
    16-bit:          weight         out * in * E

Budget (auto_precision): the W4A16 bytes of the budgeted layers x (1 + headroom), or budget_bpw bits
per weight of them. quantkit.mixed.budget.assign raises layers from int4 to int8 (or 16-bit) by the largest
damage removed per added byte. Quantization: one config group int4 targeting "Linear", one int8
targeting the chosen modules by exact name (compressed-tensors matches exact names before class
names), the 16-bit layers in the ignore list.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from quantkit.arch.modules import decoder
from quantkit.engines.llmcompressor.distributed import Ranks, measured_share
from quantkit.mixed.sensitivity import PROBES_PER_ROLE, SensitivityRow

KEEP = "16-bit"  # the top of every ladder: the layer stays in the model's dtype
# A fallback step's room for what config.json and the safetensors header add per raised layer (its name in
# a config group or the ignore list, its tensors' entries): the size models count tensor bytes only.
METADATA_BYTES = 256
MEASURE_WINDOWS = 8  # calibration windows the probes' KL divergence is measured on (the options' default)
KEEP_PROBES_PER_ROLE = 2  # the fallback of a one-precision method: each role's first and last layer


@dataclass
class LayerTable:
    layers: list[SensitivityRow]
    measured: bool  # damage scaled by measured KL divergence (else: the weighted error alone)
    windows: int = 0  # calibration windows the KL divergences were measured on
    seconds: dict[str, float] = field(default_factory=dict)  # "statistics", "errors", "kld"
    probes: int = 0  # layers whose KL divergence was measured
    rank_correlation: float | None = None  # the weighted error against the probes' KL divergence (Spearman)

    @classmethod
    def from_dict(cls, data: dict) -> "LayerTable":
        """The table as the report recorded it (as_dict)."""
        return cls([SensitivityRow.from_dict(r) for r in data["tensors"]], data["measured"], data["windows"],
                    dict(data.get("seconds", {})), data.get("probes", 0), data.get("rank_correlation"))

    def as_dict(self) -> dict:
        candidates = list(dict.fromkeys(c for r in self.layers for c in r.candidates))
        return {"measured": self.measured, "windows": self.windows, "probes": self.probes, "seconds": self.seconds,
                "rank_correlation": self.rank_correlation, "candidates": candidates,
                "tensors": [r.as_dict() for r in self.layers]}


# ------------------------------------------------------------------ simulated precisions


@dataclass(frozen=True)
class Simulation:
    """A method's precisions of one Linear layer, cheapest first (16-bit, exact, is added at the top).

    `weight(layer, precision, w)`: the float32 weight the layer effectively applies to its own
    input at that precision, from its float32 source weight `w`; `inputs(layer, precision)`: the
    transform of its input (activation quantization), None for weight-only precisions."""

    precisions: tuple[str, ...]
    weight: Callable
    inputs: Callable = lambda layer, precision: None
    probe: str = ""  # the precision probes are measured at (default: the first)

    @property
    def probe_precision(self) -> str:
        return self.probe or self.precisions[0]


def activation_quantizer(args: dict) -> Callable:
    """x -> x fake-quantized as compressed-tensors quantizes a Linear's input: per token (dynamic), or with one
    scale for the whole batch (static: the batch's range, where calibration took the windows' range)."""
    from compressed_tensors.quantization import QuantizationArgs

    parsed = QuantizationArgs(**{k: v for k, v in args.items() if k != "observer"})

    def quantize(x):
        rows = x.reshape(-1, x.shape[-1])
        if args.get("strategy") == "tensor":
            rows = rtn(rows.reshape(1, -1), parsed).reshape(rows.shape)
        else:
            rows = rtn(rows, parsed)
        return rows.reshape(x.shape)

    return quantize


# ------------------------------------------------------------------ scheme and size model


# ------------------------------------------------------------------ weighted errors


def rtn(weight, args):
    """Round-to-nearest of a float32 (out, in) weight in `args`'s scheme, dequantized (compressed-tensors' own)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    if args.group_size:
        grouped = weight.reshape(weight.shape[0], -1, args.group_size)
        lo, hi = grouped.amin(-1), grouped.amax(-1)
    else:
        lo, hi = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    scale, zero_point = calculate_qparams(lo, hi, args)
    return fake_quantize(weight, scale, zero_point, args)


def column_error(diff, weights) -> float:
    """sum_ij weights_j * diff_ij^2 in float64."""
    diff = diff.double()
    return float((diff * diff * weights.double()).sum())


def layer_errors(name: str, weight, stats: "InputStats", sim: Simulation) -> dict[str, float]:
    """Weighted error of one layer at each of the simulation's precisions, and 0 at 16-bit."""
    errors = {}
    for precision in sim.precisions:
        quantized = sim.weight(name, precision, weight)
        error = column_error(weight - quantized, stats.importance)
        moved = stats.moved.get(precision)
        errors[precision] = error + (column_error(quantized, moved) if moved is not None else 0.0)
    return {**errors, KEEP: 0.0}


def read_weight(source, name: str):
    """A layer's weight from the checkpoint, float32."""
    from quantkit.errors import UnsupportedError

    key = name + ".weight"
    if key not in source.index:
        raise UnsupportedError(f"per-layer precision: {key} is not a tensor of the checkpoint (its modules are "
                               "renamed while loading)", hint="quantize without --auto-precision / --fallback")
    return source.get(key).float()


# ------------------------------------------------------------------ input statistics


@dataclass
class InputStats:
    importance: object  # float64 (in,): mean x_j^2
    moved: dict = field(default_factory=dict)  # precision -> float64 (in,): mean (t(x) - x)_j^2


def input_statistics(model_dir: Path, windows, layers: list[str], sim: Simulation,
                     progress: Callable[[str], None] = lambda message: None,
                     ranks: Ranks = Ranks()) -> dict[str, InputStats]:
    """{layer: InputStats} over `windows` through the layer-streamed forward (one layer's weights in
    memory at a time), computed in float32 like the probes (a statistic: it needs no 16-bit rounding,
    and 16-bit matmuls are several times slower on CPUs without native support for them); a layer the
    windows never reach gets a uniform importance. Under torchrun each rank takes its share of the windows and
    the sums are added over the ranks."""
    import torch

    from quantkit.engines.transformers import hf_config
    from quantkit.eval.stream import iter_batches, stream_model, windows_per_group
    from quantkit.io.checkpoint import SafetensorsWeights

    windows, split = measured_share(windows, ranks)

    config = hf_config(model_dir)
    streamed = stream_model(config, SafetensorsWeights(model_dir), torch.float32)
    modules = dict(streamed.model.named_modules())
    sums: dict[str, dict] = {name: {} for name in layers}
    counts = dict.fromkeys(layers, 0)

    def hook(name: str):
        def collect(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            add(sums[name], "importance", x.double())
            for precision in sim.precisions:
                transform = sim.inputs(name, precision)
                if transform is not None:
                    add(sums[name], precision, (transform(x) - x).double())
            counts[name] += x.shape[0]
        return collect

    handles = [modules[name].register_forward_pre_hook(hook(name)) for name in layers]
    group = windows_per_group(config.get_text_config(), windows.shape[1])
    progress(f"sensitivity: input statistics of {len(layers)} layers on {len(windows)} calibration windows")
    try:
        with torch.inference_mode():
            for ids in iter_batches(windows, group):
                decoder(streamed.model)(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    if split:
        summed_over_ranks(sums, counts)
    return {name: stats_of(sums[name], counts[name], modules[name].in_features) for name in layers}


def summed_over_ranks(sums: dict[str, dict], counts: dict[str, int]) -> None:
    """input_statistics' sums and counts, in place, added over the ranks (each rank saw windows of every layer)."""
    import torch

    from quantkit.engines.llmcompressor.distributed import reduce_sums

    reduce_sums([sums[name][key] for name in sums for key in sorted(sums[name])])
    total = torch.tensor([counts[name] for name in counts], dtype=torch.int64)
    reduce_sums([total])
    counts.update(zip(counts, total.tolist()))


def add(sums: dict, key: str, values) -> None:
    squares = (values * values).sum(0)
    sums[key] = squares if key not in sums else sums[key] + squares


def stats_of(sums: dict, count: int, width: int) -> InputStats:
    import torch

    if not count:
        return InputStats(torch.ones(width, dtype=torch.float64))
    return InputStats(sums["importance"] / count, {k: v / count for k, v in sums.items() if k != "importance"})


# ------------------------------------------------------------------ the table


def error_table(model_dir: Path, shapes: dict[str, tuple[int, int]], stats: dict[str, InputStats],
                sim: Simulation, plain: str, progress: Callable[[str], None] = lambda message: None
                ) -> list[SensitivityRow]:
    """Weighted errors of every layer ({module name: (out, in)}) at every precision of `sim`."""
    from quantkit.io.checkpoint import SafetensorsWeights

    source, rows = SafetensorsWeights(model_dir), []
    for index, (name, shape) in enumerate(shapes.items()):
        progress(f"sensitivity: weighted errors of {name} ({index + 1}/{len(shapes)})")
        errors = layer_errors(name, read_weight(source, name), stats[name], sim)
        rows.append(SensitivityRow(name, tuple(shape), errors, sim.probe_precision, plain))
    return rows


def probe(model_dir: Path, row: SensitivityRow, sim: Simulation):
    """The quantkit.mixed.sensitivity.Probe of one layer at the simulation's probe precision."""
    return group_probe(model_dir, row.name, [row], sim)


def measure(model_dir: Path, shapes: dict[str, tuple[int, int]], calib_windows, sim: Simulation, plain: str,
            measure_windows: int = MEASURE_WINDOWS, probes_per_role: int = PROBES_PER_ROLE,
            workdir: Path | None = None, progress: Callable[[str], None] = lambda message: None,
            ranks: Ranks = Ranks()) -> LayerTable:
    """The sensitivity table: input statistics on the calibration windows, weighted errors, and with
    measure_windows > 0 the gains of probes_per_role layers per role measured and the others' interpolated,
    on at most measure_windows windows and no more than one pass of the calibration windows pays for
    (quantkit.mixed.sensitivity.probe_windows). Under torchrun the statistics and the probes are measured
    data-parallel (each rank on its share of the windows, the sums added, the probes' per-position values
    gathered) and every rank takes rank 0's table, so every rank decides alike."""
    table = measured_table(model_dir, shapes, calib_windows, sim, plain, measure_windows, probes_per_role, workdir,
                           progress, ranks)
    if not ranks.distributed:
        return table
    from quantkit.engines.llmcompressor.distributed import share_object

    return share_object(table, ranks)


def measured_table(model_dir: Path, shapes: dict[str, tuple[int, int]], calib_windows, sim: Simulation, plain: str,
                   measure_windows: int, probes_per_role: int, workdir: Path | None,
                   progress: Callable[[str], None], ranks: Ranks) -> LayerTable:
    """measure's table on this rank."""
    from quantkit.mixed.sensitivity import (layer_count, probe_klds, probe_names, probe_windows, proxy_agreement,
                                            role_and_depth, set_gains)

    started = time.perf_counter()
    stats = input_statistics(model_dir, calib_windows, list(shapes), sim, progress, ranks)
    seconds = {"statistics": round(time.perf_counter() - started, 3)}
    started = time.perf_counter()
    progress(f"sensitivity: weighted errors of {len(shapes)} layers at {', '.join(sim.precisions)}")
    table = error_table(model_dir, shapes, stats, sim, plain, progress)
    seconds["errors"] = round(time.perf_counter() - started, 3)
    if measure_windows == 0:
        return LayerTable(table, False, 0, seconds)
    started = time.perf_counter()
    chosen = set(probe_names(table, probes_per_role))
    depth = layer_count(model_dir)
    starts = [role_and_depth(name)[1] or 0 for name in chosen]
    windows = calib_windows[:probe_windows(measure_windows, len(calib_windows), depth, starts)]
    progress(f"sensitivity: KL divergence of {len(chosen)} probe layers alone on {len(windows)} windows")
    klds = probe_klds(model_dir, [probe(model_dir, r, sim) for r in table if r.name in chosen], windows,
                      "auto_precision.measure_windows: 0", workdir, progress, ranks)
    set_gains(table, klds)
    seconds["kld"] = round(time.perf_counter() - started, 3)
    agreement = proxy_agreement(table)
    if agreement is not None:
        progress(f"sensitivity: the weighted error ranks the {len(klds)} probe layers' measured KL divergence with "
                 f"Spearman's rho {agreement:.2f}")
    return LayerTable(table, True, len(windows), seconds, len(klds), agreement)


def check_streamable(info, label: str, flag: str) -> None:
    """Per-layer precision reads the checkpoint's layers by module name and streams a text decoder:
    MoE models and VLMs are refused before work."""
    from quantkit.arch.moe import moe_layout
    from quantkit.errors import UnsupportedError
    from quantkit.arch.vlm import is_vlm

    if moe_layout(info.config) is not None or is_vlm(info.config):
        kind = "MoE models" if moe_layout(info.config) is not None else "VLMs"
        raise UnsupportedError(f"{label} is not supported for {kind} ({info.architecture}): its sensitivity pass "
                               "reads the checkpoint's layers by module name and streams a text decoder",
                               hint=f"quantize without {flag}")


# ------------------------------------------------------------------ the 16-bit fallback of single-precision methods


def quantized_layers(info, ignore: list[str], roles=("decoder", "other")) -> dict[str, tuple[int, int]]:
    """{module name: (out, in)} of the Linear weights a method quantizes, from the checkpoint's headers
    (a text decoder's module names are its tensor names), those matching `ignore` left out."""
    from quantkit.arch.roles import classify, linear_weights, matches

    return {name: tuple(shape) for name, shape in linear_weights(info).items()
            if classify(name + ".weight", info.towers) in roles and not matches(name, ignore)}


def sized(layer_bytes: Callable, job) -> Callable[[tuple, str], int]:
    """layer_bytes(shape, precision, element) with the bytes per element of the model as the job loads it."""
    from quantkit.engines.transformers import torch_dtype

    element = torch_dtype(job.dtype, job.info).itemsize
    return lambda shape, precision: layer_bytes(shape, precision, element)


def fused_units(rows: list[SensitivityRow]) -> list:
    """The layers as units that take one precision (quantkit.mixed.budget.Unit): the shards vLLM loads into one
    layer (q/k/v, gate/up: quantkit.arch.fused) together, every other layer alone."""
    from quantkit.arch.fused import partners
    from quantkit.mixed.budget import Unit

    groups: dict[str, list[SensitivityRow]] = {}
    for row in rows:
        found = partners(row.name)
        groups.setdefault(found[0] if found else row.name, []).append(row)
    return [Unit(name, members) for name, members in groups.items()]


def fused_assign(rows: list[SensitivityRow], allowed: int, size: Callable[[SensitivityRow, str], int]) -> dict[str, str]:
    """quantkit.mixed.budget.assign over fused_units: {layer: precision}, one precision per fused group."""
    from quantkit.mixed.budget import assign

    units = fused_units(rows)
    choice = assign(units, allowed, lambda unit, p: sum(size(m, p) for m in unit.members))
    return {m.name: choice[unit.name] for unit in units for m in unit.members}


def keep_ladder(job, layers: dict[str, tuple[int, int]], sim: Simulation, size: Callable[[tuple, str], int]):
    """The fallback ladder of a method with one precision (fp8, smoothquant, nf4): each layer at it, or 16-bit
    (quantkit.mixed.budget.Ladder), its sensitivity measured on as many calibration windows as the gate holds
    out (MEASURE_WINDOWS at most; input statistics and probes alike) with KEEP_PROBES_PER_ROLE probes per role:
    the plain run calibrates little or nothing, and the search measures the artifacts themselves; a fused
    group (fused_units) raised together."""
    from quantkit.mixed.budget import Ladder

    plain = sim.precisions[0]
    windows = job.windows.calib[:min(MEASURE_WINDOWS, max(1, len(job.windows.eval)))]
    table = measure(job.info.path, layers, windows, sim, plain, len(windows), KEEP_PROBES_PER_ROLE, job.workdir,
                    job.progress, job.ranks)
    units = fused_units(table.layers)
    ordering = order_raises(job.info.path, table, units, sim, windows, job.workdir, job.progress, job.ranks)
    return Ladder(table.layers, {name: plain for name in layers}, lambda row, p: size(row.shape, p),
                  lambda plan: units, keep_one=True,
                  details={"sensitivity": {**table.as_dict(), "ordering": ordering.as_dict()}})


def group_probe(model_dir: Path, name: str, rows: list[SensitivityRow], sim: Simulation):
    """The quantkit.mixed.sensitivity.Probe of several layers quantized together at their probe precision (a
    fused unit, a decoder block), starting at the first layer they change."""
    from quantkit.io.checkpoint import SafetensorsWeights
    from quantkit.mixed.sensitivity import Probe, role_and_depth

    def patch() -> dict:
        source = SafetensorsWeights(model_dir)
        return {r.name + ".weight": sim.weight(r.name, r.probe, read_weight(source, r.name)) for r in rows}

    inputs = {r.name: transform for r in rows if (transform := sim.inputs(r.name, r.probe)) is not None}
    return Probe(name, min(role_and_depth(r.name)[1] or 0 for r in rows), patch, inputs)


def order_raises(model_dir: Path, table: LayerTable, units: list, sim: Simulation, calib_windows,
                 workdir: Path | None, progress: Callable[[str], None], ranks: Ranks):
    """The fallback's order (quantkit.mixed.ordering): the proxy's where it ranks the probes well; else every
    block measured alone, then the units of the most damaging blocks, and the units' gains set so that their
    damage is what was measured (in place: the rows of `table`). Each round's probes are measured on as many
    calibration windows as one pass of them through the model pays for (at least one)."""
    from quantkit.mixed import ordering
    from quantkit.mixed.sensitivity import layer_count, probe_klds, probe_windows

    choice = ordering.choose(table.rank_correlation)
    progress(f"fallback order: {choice.reason}")
    if choice.used == ordering.PROXY:
        return choice
    started, depth = time.perf_counter(), layer_count(model_dir)
    blocks = ordering.by_block(units)

    def measured(probes: list, what: str) -> tuple[dict[str, float], int]:
        count = probe_windows(len(calib_windows), len(calib_windows), depth, [p.start for p in probes])
        progress(f"fallback order: KL divergence of {len(probes)} {what} alone on {count} window(s)")
        klds = probe_klds(model_dir, probes, calib_windows[:count], "fallback order", workdir, progress, ranks)
        if ranks.distributed:  # rank 0's, so that every rank splits the same blocks and decides alike
            from quantkit.engines.llmcompressor.distributed import share_object

            klds = share_object(klds, ranks)
        return klds, count

    labels = {ordering.block_label(b): b for b in blocks}
    found, windows = measured([group_probe(model_dir, label, [m for u in blocks[b] for m in u.members], sim)
                               for label, b in labels.items()], "blocks")
    block_klds = {labels[label]: kld for label, kld in found.items()}
    split = ordering.blocks_to_split(block_klds, {b: len(us) for b, us in blocks.items()})
    unit_klds = {}
    if split:
        progress(f"fallback order: splitting {', '.join(ordering.block_label(b) for b in split)} into units")
        unit_klds, _ = measured([group_probe(model_dir, u.name, u.members, sim) for b in split for u in blocks[b]],
                                "units")
    ordering.set_unit_gains(units, ordering.unit_damages(units, block_klds, unit_klds))
    choice = replace(choice, blocks=len(block_klds), units=len(unit_klds), windows=windows,
                     seconds=round(time.perf_counter() - started, 3),
                     split=[ordering.block_label(b) for b in split])
    progress(f"fallback order: the raises follow the measured KL divergence of {choice.blocks} blocks and "
             f"{choice.units} units ({choice.seconds:.1f} s)")
    return choice


def keep_report(details: dict, plan: dict[str, str], size: Callable[[tuple, str], int]) -> dict:
    """details.mixed_precision of a fallback plan of a one-precision method (keep_ladder)."""
    table = LayerTable.from_dict(details["sensitivity"]).layers
    plain = sum(size(r.shape, r.plain) for r in table)
    return plan_report(table, plan, None, plain, lambda row, p: size(row.shape, p))


def artifact_estimate(info, layers: dict[str, tuple[int, int]], size: Callable[[tuple, str], int], plain: str) -> int:
    """The first artifact's weight bytes before any raise: the checkpoint's, with each quantized layer at
    the plain precision instead of 16-bit (for --max-size's check before work)."""
    from quantkit.io.safetensors import DTYPE_BYTES

    total = sum(DTYPE_BYTES.get(dtype, 2) * math.prod(shape) for dtype, shape in info.tensors.values())
    stored = {name: DTYPE_BYTES.get(info.tensors[name + ".weight"][0], 2) for name in layers}
    return total - sum(o * i * stored[name] for name, (o, i) in layers.items()) + \
        sum(size(shape, plain) for shape in layers.values())


# ------------------------------------------------------------------ plan, config groups, report


def kept_16bit(choice: dict[str, str]) -> list[str]:
    """The layers the plan keeps in 16 bits (added to the ignore list)."""
    return sorted(name for name, p in choice.items() if p == KEEP)


def plan_report(table: list[SensitivityRow], choice: dict[str, str], allowed: int | None, plain_bytes: int,
                size: Callable[[SensitivityRow, str], int]) -> dict:
    """details.mixed_precision: the budget (None: a fallback plan, bounded by its max_size), the bytes,
    every layer's precision and the counts."""
    from quantkit.mixed.budget import total_bytes

    counts: dict[str, int] = {}
    for precision in choice.values():
        counts[precision] = counts.get(precision, 0) + 1
    plain = table[0].plain if table else ""
    return {**({} if allowed is None else {"budget_bytes": allowed}), "plain_bytes": plain_bytes,
            "bytes": total_bytes(table, choice, size), "counts": dict(sorted(counts.items())),
            "types": dict(sorted(choice.items())),
            "changed": {name: f"{plain}->{p}" for name, p in sorted(choice.items()) if p != plain}}
