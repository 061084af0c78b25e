"""run(recipe) -> RunReport: the only place that sequences the steps of a quantization run.

check inputs and resolve every selected target once (fast) -> hash the inputs; with
--skip-existing, set aside the targets whose output is up to date -> tokenizer + token windows
-> [merge LoRA] -> baseline on held-out windows (once) -> per target: fresh model, quantize into
staging, reload from disk, measure, gate -> all targets pass: write reports and rename staging to
OUT; otherwise nothing is written. With --partial, a target that fails its gate or raises does
not stop the others, and those that passed are published.

Output layout (by the recipe's target count, whatever --only selects): one target -> OUT is that
artifact; several -> OUT/<target name>/ each, plus OUT/quantkit.json for the run. A run with
several targets and --only, --partial or --skip-existing publishes target by target: each
OUT/<target> is renamed into place from staging on its own, and the other targets' directories in
OUT are left alone.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import platform
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from pydantic import BaseModel

from quantkit import __version__
from quantkit.arch.families import check_family
from quantkit.arch.vlm import FAMILIES, is_vlm, tower_summary
from quantkit.engines.llmcompressor.distributed import (
    Ranks,
    check_launch,
    gather_for,
    process_group,
    rank_zero_alone,
    see_from_every_rank,
)
from quantkit.engines.transformers import Offload, check_device, check_known, device_map
from quantkit.errors import (
    CalibrationError,
    GateFailedError,
    InputError,
    OutputExistsError,
    QuantkitError,
    RunFailedError,
    UnsupportedError,
)
from quantkit.io import export
from quantkit.io.checkpoint import (
    ModelInfo,
    check_generative,
    check_model_dir,
    check_submodel_packages,
    resolve_source,
)
from quantkit.io.memory import PeakTracker
from quantkit.io.numerics import check_finite
from quantkit.methods import MethodSpec, ModelHandle, QuantizeJob, QuantizeResult, get_method, ignore_patterns, on_ranks
from quantkit.run import auto, resume, serving
from quantkit.run.follow import announce, follow, leading
from quantkit.run.cache import fingerprint, input_hashes, up_to_date
from quantkit.run.lora import plan_merge
from quantkit.run.plan import build_plan
from quantkit.run.preflight import (
    available_vram,
    check_disk,
    check_ram,
    check_vram,
    describe_placement,
    gate_placement,
    ram_estimate,
    run_estimate,
    vram_estimate,
    with_resume,
)
from quantkit.run.recipe import Calibration, Gate, Recipe, Target, push_places, target_gate, target_options
from quantkit.run.card import Place, kept_summary, read_license, write_card
from quantkit.run.report import ModelReport, RunReport, TargetReport, package_version

if TYPE_CHECKING:
    from quantkit.eval.scorers import Placement

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ResolvedTarget:
    """One recipe target, resolved once in prepare(); flows unchanged to quantize, measure,
    the report and the model card."""

    target: Target
    method: MethodSpec
    options: BaseModel
    gate: Gate
    ignore: list[str]  # the full ignore list handed to the method (lm_head, VLM towers, the user's)
    needs_calibration: bool
    needs_model: bool  # quantize() gets the model loaded in memory
    choices: dict[str, str] = field(default_factory=dict)  # what method.resolve chose for this model, and why
    kept_16bit: dict[str, str] = field(default_factory=dict)  # layers added to the ignore list by rule -> why
    # method auto: the ladder, and each candidate it may build resolved as a target of its own (by rung label);
    # the fields above are then its first open candidate's
    ladder: auto.Ladder | None = None
    candidates: dict[str, "ResolvedTarget"] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.target.name


def every_candidate(targets: list[ResolvedTarget]) -> list[ResolvedTarget]:
    """The targets as they are built: a method auto target's candidates in its place (the preflight's
    estimates and checks cover each of them)."""
    return [c for t in targets for c in (t.candidates.values() if t.ladder else [t])]


@dataclass
class RunOptions:
    model: str
    out: Path
    overwrite: bool = False
    enforce_gate: bool = True
    max_memory: int | None = None  # bytes; None: the memory available when the run starts
    only: list[str] = field(default_factory=list)  # target names to run (empty: all)
    skip_existing: bool = False  # skip targets whose output is up to date; replace stale ones
    partial: bool = False  # publish the targets that pass; a failing or raising one does not stop the others
    ranks: Ranks = Ranks()  # this process's place in a torchrun launch (quantkit.engines.llmcompressor.distributed)
    progress: Progress = lambda message: None


def prepare(recipe: Recipe, opts: RunOptions) -> tuple[ModelInfo, list[ResolvedTarget], Placement]:
    """All cheap checks, before any long work: targets selected, model, device, output,
    calibration, method options, memory. Returns the model, the selected targets, resolved, and where
    the gate's forwards run (resident or streamed: preflight.gate_placement)."""
    from quantkit.run.calibration import validate_source

    selected = select_targets(recipe.targets, opts.only)
    check_device(recipe.device)
    check_outputs(recipe, opts, selected)
    validate_source(recipe.calibration.source)
    check_push(recipe, selected)
    info = check_model_dir(*resolve_source(opts.model, recipe.offline, recipe.trust_remote_code))
    check_generative(info)
    check_family(info)
    check_submodel_packages(info)
    check_not_quantized(info, recipe)
    check_offload_dir(recipe, info)
    resolved = [resolve_target(recipe, target, info) for target in selected]
    check_auto(recipe, opts, resolved)
    targets = every_candidate(resolved)
    if recipe.calibration.eval_windows or any(t.needs_model or t.needs_calibration for t in targets):
        check_known(info, recipe.trust_remote_code)  # transformers builds the model for them
    given = {"--lora": bool(recipe.lora), "--offload-dir": recipe.offload_dir is not None,
             "--skip-existing": opts.skip_existing, "--partial": opts.partial}
    check_launch(opts.ranks, [rank_row(t) for t in targets],
                 window_settings(recipe, targets).num_samples, [flag for flag, on in given.items() if on],
                 recipe.calibration.eval_windows)
    if recipe.lora:
        lora_plan(info, recipe)  # every adapter checked against the base before work
    check_disk(opts.out, disk_estimate(recipe, opts, info, disk_targets(resolved)))
    bound = opts.max_memory or recipe.max_memory_bytes  # --max-memory, else the recipe's max_memory
    named = "--max-memory" if opts.max_memory else "the recipe's max_memory"
    placement = gate_placement(info, recipe, targets, bound, opts.ranks.world_size, named)
    check_ram(ram_estimate(info, recipe, targets, placement), bound, named)
    if device_map(recipe.device) == "cuda":
        check_vram(vram_estimate(info, recipe, targets, placement, placement.onload), available_vram())
    check_finite([*info.weight_files, *(Path(p) / "adapter_model.safetensors" for p in recipe.lora)])
    check_gate_tasks(recipe, targets, opts)
    check_serve_engines(targets, recipe.calibration.eval_windows)
    check_kv_types(targets, info, recipe.calibration.eval_windows)
    return info, resolved, placement


def rank_row(target: ResolvedTarget) -> tuple[str, str, bool, BaseModel, str | None]:
    """(name, method, whether the method runs on torchrun ranks, options, why these options do not) for check_launch."""
    runs, why = on_ranks(target.method, target.options)
    return target.name, target.target.method, runs, target.options, why


def disk_estimate(recipe: Recipe, opts: RunOptions, info: ModelInfo, targets: list[ResolvedTarget]):
    """What the run writes beside OUT (quantkit.run.preflight); with --resume, every target's method must
    resume (exit 2 otherwise), and its saved progress counts, less what an interrupted run already wrote."""
    methods = [(t.method, t.options) for t in targets]
    estimate = run_estimate(info, recipe, methods)
    if not recipe.resume:
        return estimate
    resume.check_methods(info, [(t.name, t.method, t.options) for t in targets])
    return with_resume(estimate, info, methods, resume.staged_bytes(opts.out), window_settings(recipe, targets))


def gate_tasks(targets: list[ResolvedTarget]) -> list:
    """Every lm-eval task some target's gate names (quantkit.eval.tasks.TaskGate)."""
    return [task for t in targets for task in t.gate.tasks]


def check_gate_tasks(recipe: Recipe, targets: list[ResolvedTarget], opts: RunOptions) -> None:
    """The gate's tasks, before any model work: lm-eval installed, every task's data found offline
    (exit 2 naming the task otherwise), held-out windows to measure with."""
    tasks = gate_tasks(targets)
    if not tasks:
        return
    if recipe.calibration.eval_windows == 0:
        raise InputError("the gate's tasks are measured with the gate, but eval_windows is 0",
                         hint="raise --eval-windows, or drop the tasks")
    from quantkit.eval.tasks import check_tasks

    opts.progress(f"tasks: {', '.join(check_tasks(tasks))} (data found offline)")


def select_targets(targets: list[Target], only: list[str]) -> list[Target]:
    """The targets --only names, in the recipe's order; all of them without --only."""
    if not only:
        return targets
    names = [t.name for t in targets]
    unknown = [name for name in only if name not in names]
    if unknown:
        raise InputError(f"--only: no target named {', '.join(unknown)}; the recipe's targets are {', '.join(names)}",
                         hint=f"e.g. --only {names[0]}")
    return [t for t in targets if t.name in only]


def multi_target(recipe: Recipe) -> bool:
    """The output layout: OUT/<target>/ per target when the recipe has several."""
    return len(recipe.targets) > 1


def per_target_outputs(recipe: Recipe, opts: RunOptions) -> bool:
    """Publish target by target into OUT (which may hold other targets' outputs) instead of
    renaming the whole run into place at once."""
    return multi_target(recipe) and bool(opts.only or opts.partial or opts.skip_existing)


def output_dir(out: Path, recipe: Recipe, name: str) -> Path:
    return out / name if multi_target(recipe) else out


def check_outputs(recipe: Recipe, opts: RunOptions, targets: list[Target]) -> None:
    """OUT (or, when publishing target by target, each selected OUT/<target>) must not exist
    unless --overwrite or --skip-existing (which replaces a stale output)."""
    replace = opts.overwrite or opts.skip_existing
    if not per_target_outputs(recipe, opts):
        export.check_output(opts.out, replace)
        return
    export.check_output(opts.out, overwrite=True)  # a directory of targets: parent, lock, not a file
    existing = [opts.out / t.name for t in targets if (opts.out / t.name).exists()]
    if existing and not replace:
        raise OutputExistsError(f"output already exists: {existing[0]}",
                                hint="pass --overwrite to replace it, or --skip-existing to keep it when up to date")


def resolve_target(recipe: Recipe, target: Target, info: ModelInfo) -> ResolvedTarget:
    """Method, options, gate, ignore list and calibration needs of one target, checked (method auto: its ladder)."""
    if target.method == auto.AUTO:
        return resolve_ladder(recipe, target, info)
    method = get_method(target.method)
    options, choices = method.resolve(info, target_options(target))
    if target.ignore and not method.layers.takes_ignore:
        raise InputError(f"target '{target.name}': method {target.method} does not take ignore patterns",
                         hint="its type mixture decides every tensor's type; remove `ignore`/--ignore")
    needs_calibration = method.needs_calibration(options)
    if needs_calibration and recipe.calibration.num_samples == 0:
        raise CalibrationError(f"target '{target.name}': {target.method} needs calibration windows, "
                               "but num_samples is 0", hint="raise --num-samples")
    check_tower_precision(target, info, method)
    method.check(info, options, recipe.calibration)
    ignore = ignore_patterns(info, target.ignore, method.layers.keeps_lm_head(options), tuple(target.tower_precision()))
    kept = family_kept(info, method, needs_calibration) | shapes_kept(recipe, target, method, info, options, ignore)
    kept.update(fused_partners_kept(info, method, ignore + sorted(kept)))
    ignore = ignore + sorted(kept)
    method.layers.check_ignore(info, options, ignore)
    return ResolvedTarget(target, method, options, gate_with_task_files(target_gate(recipe, target)), ignore,
                          needs_calibration,
                          method.needs_model(info, options) or bool(target.tower_precision()), choices, kept)


def resolve_ladder(recipe: Recipe, target: Target, info: ModelInfo) -> ResolvedTarget:
    """A method auto target: its ladder (quantkit.run.auto) built for the model and the destination, each open
    candidate resolved as a target of its own under the one gate (a candidate its method refuses for this model
    is skipped with the reason); exit 2 when none is left."""
    from quantkit.run.preflight import available_ram, total_ram

    if recipe.resume:
        raise InputError(f"target '{target.name}': method auto does not resume (its candidates are measured one "
                         "after another)", hint="drop --resume, or run the method the ladder chose with --resume")
    gate = gate_with_task_files(target_gate(recipe, target))
    destination = auto.parse_for(target.destination, total_ram() or available_ram())
    if gate.kv_cache is not None and gate.kv_engine is None:
        gate = gate.model_copy(update={"kv_engine": auto.kv_engine_for(destination)})
    ladder = auto.build_ladder(info, destination, target_options(target), gate.max_kld)
    candidates = {}
    for rung in ladder.rungs:
        if rung.status == auto.OPEN:
            try:
                candidates[rung.label] = candidate_target(recipe, target, info, rung.candidate, gate)
            except QuantkitError as exc:
                rung.status, rung.why = "skipped", f"refused for this model: {exc.message}"
    auto.check_buildable(ladder)
    first = next(candidates[r.label] for r in ladder.rungs if r.status == auto.OPEN)
    return dataclasses.replace(first, target=target, ladder=ladder, candidates=candidates)


def candidate_target(recipe: Recipe, target: Target, info: ModelInfo, candidate: auto.Candidate,
                     gate: Gate) -> ResolvedTarget:
    """One candidate of a method auto target resolved as that method's target (named '<target>: <candidate>' in
    the progress lines), under the ladder's gate."""
    built = target.model_copy(update={"name": f"{target.name}: {candidate.label}", "method": candidate.method,
                                      "options": candidate.option_dict(), "destination": None})
    built._options = None  # the copy holds the auto target's validated options
    return dataclasses.replace(resolve_target(recipe, built, info), gate=gate)


def check_auto(recipe: Recipe, opts: RunOptions, targets: list[ResolvedTarget]) -> None:
    """Method auto chooses by the gate's verdicts, in one process."""
    if not any(t.ladder for t in targets):
        return
    if not opts.enforce_gate or not recipe.gate.enabled or recipe.calibration.eval_windows == 0:
        raise InputError("method auto chooses by the quality gate: it needs the gate on and held-out windows",
                         hint="drop --no-gate / eval_windows: 0, or name the method")
    if opts.ranks.distributed:
        raise InputError("method auto runs in one process", hint="run it without torchrun, or name the method")


def disk_targets(targets: list[ResolvedTarget]) -> list[ResolvedTarget]:
    """What is on disk at once: each target's artifact; of a ladder, its two largest candidates (the one that
    passed so far beside the one being measured)."""
    held = []
    for t in targets:
        if t.ladder is None:
            held.append(t)
            continue
        sizes = {r.label: r.weights for r in t.ladder.rungs}
        held += [t.candidates[label] for label in sorted(t.candidates, key=lambda label: -sizes[label])[:2]]
    return held


def gate_with_task_files(gate: Gate) -> Gate:
    """The gate with each task name a given task file defines read from that file (quantkit.eval.tasks.with_task_files)."""
    if not any(t.file is not None for t in gate.tasks):
        return gate
    from quantkit.eval.tasks import with_task_files

    return gate.model_copy(update={"tasks": with_task_files(gate.tasks)})


def family_kept(info: ModelInfo, method: MethodSpec, calibrates: bool = False) -> dict[str, str]:
    """The layers the model's family keeps 16-bit, each with its reason (quantkit.arch.families: a record's
    `kept`, and its `untraced` when llm-compressor calibrates), for a method that takes an ignore list (a GGUF
    mixture types every tensor as llama-quantize does)."""
    from quantkit.arch.families import kept_layers, untraced_layers

    if not method.layers.takes_ignore:
        return {}
    sequential = calibrates and method.engine == "llmcompressor"  # quantkit.engines.llmcompressor.llmc.ENGINE
    return kept_layers(info, method.name) | (untraced_layers(info) if sequential else {})


def fused_partners_kept(info: ModelInfo, method: MethodSpec, ignore: list[str]) -> dict[str, str]:
    """For a format whose engine loads fused shards as one (compressed-tensors in vLLM: Format.fuses_shards): the
    shards of a fused layer (q/k/v, gate/up) the ignore list leaves quantized while it keeps another shard
    16-bit, which vLLM cannot load (quantkit.arch.fused)."""
    from quantkit.arch.fused import split_groups
    from quantkit.arch.roles import linear_weights, matches

    if not method.format.fuses_shards:
        return {}
    layers = list(linear_weights(info))
    return split_groups([name for name in layers if matches(name, ignore)], layers)


def shapes_kept(recipe: Recipe, target: Target, method: MethodSpec, info: ModelInfo, options: BaseModel,
                ignore: list[str]) -> dict[str, str]:
    """The layers the target would quantize whose widths its format cannot tile (Layers.shape_problems),
    kept 16-bit; with strict_shapes (--strict-shapes) the first is refused instead (exit 2)."""
    problems = method.layers.shape_problems(info, options, ignore)
    if not problems:
        return problems
    name, why = next(iter(sorted(problems.items())))
    if recipe.strict_shapes:
        raise UnsupportedError(f"target '{target.name}': {method.name}: {why}; {len(problems)} layer(s) do not tile",
                               hint=f"drop --strict-shapes to keep them 16-bit, or --ignore {name}")
    plan = build_plan(info, method, options, ignore + sorted(problems), target.tower_precision())
    if not any(not entry.kept for entry in plan):
        raise UnsupportedError(f"target '{target.name}': {method.name} can tile no layer of this model ({why}, and "
                               f"{len(problems) - 1} more)", hint="choose a format without that rule (e.g. --scheme "
                               "fp8-dynamic, or group_size auto)")
    return problems


def check_tower_precision(target: Target, info: ModelInfo, method: MethodSpec) -> None:
    """A target's `vision`/`projector` other than keep: a method that can store it, on a model that has
    that tower in a known family's table (towers found by look always stay 16-bit)."""
    asked = target.tower_precision()
    if not asked:
        return
    fields = ", ".join(f"{role}: {value}" for role, value in asked.items())
    if not method.towers.quantizes:
        raise UnsupportedError(f"target '{target.name}': {fields} is not available with {method.name}",
                               hint="use fp8, gptq, awq or smoothquant, or keep the towers 16-bit")
    family = FAMILIES.get(info.towers.family or "")
    if "vision" in asked and family and family.vision_stays_16bit:
        raise UnsupportedError(f"target '{target.name}': vision: {asked['vision']} refused for {family.name}: "
                               f"{family.vision_stays_16bit}", hint="keep the vision tower 16-bit (vision: keep)")
    missing = [role for role in asked if not info.towers.names(role)]
    if missing:
        found = f" (its towers were found by look: {', '.join(info.towers.unknown)})" if info.towers.unknown else ""
        raise InputError(f"target '{target.name}': {fields}, but {info.architecture} has no "
                         f"{' or '.join(missing)} in quantkit's VLM table{found}",
                         hint="remove the option; towers found by look stay 16-bit")
    without_linears = [role for role in asked if not tower_weights(info, role)]
    if without_linears:
        raise UnsupportedError(f"target '{target.name}': {' and '.join(without_linears)}: {info.architecture} has "
                               "no linear layer there to quantize", hint=f"set {without_linears[0]}: keep")


def tower_weights(info: ModelInfo, role: str) -> list[str]:
    """The linear weights of a tower role (2-D `.weight`s, its embeddings left out), from the headers."""
    from quantkit.arch.roles import TOWER_EMBEDDING, classify, linear_weights

    return [name for name in linear_weights(info)
            if classify(name + ".weight", info.towers) == role and not TOWER_EMBEDDING.search(name)]


def check_not_quantized(info: ModelInfo, recipe: Recipe) -> None:
    """Quantizing needs full precision; a QLoRA (bitsandbytes) base is fine when adapters are merged."""
    from quantkit.formats.bitsandbytes import in_config
    from quantkit.io.checkpoint import QUANTIZED_CHECKPOINTS, quant_method

    method = quant_method(info.config)
    if not method or (in_config(info.config) and recipe.lora):
        return
    if method in QUANTIZED_CHECKPOINTS:
        what, hint = QUANTIZED_CHECKPOINTS[method]
        raise InputError(f"{info.path} is already quantized ({method}: {what}); quantkit quantizes full-precision "
                         "checkpoints", hint=hint)
    raise InputError(
        f"{info.path} is already quantized ({method}); quantkit quantizes full-precision checkpoints",
        hint="point at the original 16-bit model (a bitsandbytes QLoRA base is accepted together with --lora)",
    )


def check_offload_dir(recipe: Recipe, info: ModelInfo) -> None:
    """--offload-dir must be a writable directory, and the model a plain decoder (a VLM's checkpoint
    names differ from its module names, so its layers cannot be mapped to disk by name)."""
    if recipe.offload_dir is None:
        return
    path = Path(recipe.offload_dir)
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise InputError(f"offload directory is not a writable directory: {path}",
                         hint="create it on a disk with room for the model's 16-bit weights")
    if is_vlm(info.config):
        raise UnsupportedError(f"--offload-dir is not supported for VLMs ({info.architecture})",
                               hint="run without --offload-dir")


def window_settings(recipe: Recipe, targets: list[ResolvedTarget]) -> Calibration:
    """The recipe's calibration settings; no calibration windows when no target uses them
    (the held-out evaluation windows are the same either way)."""
    if any(t.needs_calibration for t in targets):
        return recipe.calibration
    return recipe.calibration.model_copy(update={"num_samples": 0})


def run(recipe: Recipe, opts: RunOptions) -> RunReport | None:
    """Execute the recipe; returns the report (also written to OUT/quantkit.json). Under torchrun,
    a rank other than 0 does its share of the calibration, writes nothing and returns None."""
    started = time.time()
    info, targets, placement = prepare(recipe, opts)
    with process_group(opts.ranks, recipe.device):
        if not opts.ranks.is_main:
            run_share(recipe, opts, info, targets, placement)
            return None
        return run_main(recipe, opts, info, targets, placement, started)


def run_main(recipe: Recipe, opts: RunOptions, info: ModelInfo, targets: list[ResolvedTarget],
             placement: Placement, started: float) -> RunReport:
    inputs = input_hashes(info, recipe)
    report = base_report(recipe, opts, info, inputs)
    candidates = every_candidate(targets)
    if placement.onload:
        opts.progress("quantize: the model does not fit the GPU whole; it stays in RAM and llm-compressor "
                      "onloads one layer at a time to the GPU")
    if placement.why:
        opts.progress(describe_placement(placement, info, recipe.calibration.seq_len, recipe.calibration.eval_windows))
        estimate = ram_estimate(info, recipe, candidates, placement)
        report.gate_placement = {"resident": placement.resident, "device": placement.device, "why": placement.why,
                                 "lockstep": placement.lockstep, "estimated_peak_rss_bytes": estimate.peak,
                                 "estimated_steps": {"fixed": estimate.fixed, **estimate.steps}}
    if (placement.tables_on_disk and placement.device == "cpu" and recipe.offload_dir is None
            and not is_vlm(info.config) and any(t.needs_model for t in candidates)):
        opts.progress("quantize: the model does not fit whole beside the rest of the run; its embeddings and head "
                      "stay on disk until used")
    for t in candidates:
        if t.kept_16bit:
            opts.progress(f"[{t.name}] kept 16-bit: {kept_summary(t.kept_16bit)}")
    prints = {t.name: fingerprint(recipe, t.target, t.gate, inputs, opts.enforce_gate) for t in targets}
    todo = [t for t in targets if not (opts.skip_existing and skipped(recipe, opts, t, prints[t.name], report))]
    staging = make_staging(recipe, opts, info, inputs)
    try:
        if opts.ranks.distributed:  # every rank reads the staged artifacts: storage every node sees
            see_from_every_rank(staging, opts.ranks)
        if todo:
            _run_in(staging, recipe, opts, info, todo, prints, report, placement)
        report.timings["total_s"] = round(time.time() - started, 3)
        _finish(staging, recipe, opts, report)
    except BaseException:
        keep_or_discard(staging, recipe, opts)
        raise
    push_published(recipe, opts, report)
    return report


def places(recipe: Recipe) -> dict[str, Place]:
    """Target name -> where it goes on the Hub, for the targets the recipe pushes (quantkit.run.push)."""
    return {name: Place(repo, subfolder) for name, (repo, subfolder) in push_places(recipe).items()}


def check_push(recipe: Recipe, selected: list[Target]) -> None:
    """Before any work: a run that pushes has the network and a token that can write."""
    from quantkit.io.hub import offline_mode

    chosen = places(recipe)
    repos = list(dict.fromkeys(chosen[t.name].repo for t in selected if t.name in chosen))
    if repos:
        from quantkit.run import push

        push.check_push(repos, offline_mode(recipe.offline))


def push_published(recipe: Recipe, opts: RunOptions, report: RunReport) -> None:
    """After a run that passed: each pushed target's artifact, read back from OUT, to its Hub repo; the
    commit recorded in the target's report entry (the --json report)."""
    from quantkit.run import push

    chosen = places(recipe)
    names = [t.name for t in report.targets if t.name in chosen and t.status in ("passed", "skipped")]
    if not names:
        return
    folders = {name: output_dir(opts.out, recipe, name) for name in names}
    pushed = push.push(push.uploads_for(folders, {name: chosen[name] for name in names}),
                       recipe.push.private if recipe.push else False, opts.progress)
    for target in report.targets:
        target.push = pushed.get(target.name, target.push)


def make_staging(recipe: Recipe, opts: RunOptions, info: ModelInfo, inputs: dict[str, str]) -> Path:
    """The run's staging directory beside OUT; with --resume, the one an interrupted run of the same
    identity left (quantkit.run.resume), or a fresh one that keeps its progress."""
    if not recipe.resume:
        return export.make_staging(opts.out, opts.progress)
    dump = {**recipe.model_dump(mode="json"), "model": str(info.path)}
    return resume.begin(opts.out, resume.identity(dump, inputs, opts.only, opts.ranks.world_size), opts.progress)


def keep_or_discard(staging: Path, recipe: Recipe, opts: RunOptions) -> None:
    """A run that did not publish: its staging directory removed, or with --resume kept (with its
    saved progress) for the next --resume run; a run without --resume removes it."""
    if recipe.resume and staging.is_dir():
        opts.progress(f"progress kept in {staging} (run again with --resume to continue)")
        return
    export.discard(staging)


def skipped(recipe: Recipe, opts: RunOptions, resolved: ResolvedTarget, wanted: dict[str, Any],
            report: RunReport) -> bool:
    """--skip-existing: when the target's output is up to date, report it as skipped (with the
    entry of that output's quantkit.json) and return True."""
    out_dir = output_dir(opts.out, recipe, resolved.name)
    existing = up_to_date(out_dir, resolved.name, wanted)
    if existing is None:
        return False
    opts.progress(f"[{resolved.name}] skipped: {out_dir} is up to date")
    entry = TargetReport.from_dict(existing)
    entry.status, entry.written, entry.exit_code, entry.error = "skipped", False, 0, None
    report.targets.append(entry)
    return True


def _run_in(staging: Path, recipe: Recipe, opts: RunOptions, info: ModelInfo, targets: list[ResolvedTarget],
            prints: dict[str, dict], report: RunReport, placement: Placement) -> None:
    """Load only what some step needs: no tokenizer, windows or torch model for a run that neither
    calibrates, nor evaluates, nor hands a target the model (e.g. gguf without imatrix and gate)."""
    from quantkit.engines.transformers import load_tokenizer

    workdir = staging / export.WORK_DIR
    workdir.mkdir(exist_ok=True)  # a --resume run's holds its saved progress already
    if recipe.lora:
        info = merge_lora(info, recipe, workdir, report, opts.progress)
    candidates = every_candidate(targets)
    settings = window_settings(recipe, candidates)
    uses_windows = settings.num_samples + settings.eval_windows > 0
    tokenizer = load_tokenizer(info, recipe.trust_remote_code) if uses_windows or any(
        t.needs_model for t in candidates) else None
    windows = make_windows(tokenizer, settings, opts.progress) if uses_windows else None
    kv_windows = long_kv_windows(tokenizer, settings, candidates, opts.progress) if windows is not None else {}
    if windows is not None:
        report.calibration.update(source_sha256=windows.sha256, calib_windows=len(windows.calib),
                                  eval_windows=len(windows.eval))
    baseline = None
    if windows is not None and len(windows.eval):
        baseline = compute_baseline(info, recipe, windows.eval, workdir, report, opts.progress, placement,
                                    opts.ranks)
        score_base_extras(info, recipe, candidates, tokenizer, windows.eval, baseline, workdir, report, opts.progress,
                          placement)
    kv_long = {context: (eval_windows, kv_baseline(info, recipe, eval_windows, workdir, opts.progress))
               for context, eval_windows in kv_windows.items()}
    for resolved in targets:
        out_dir = output_dir(staging, recipe, resolved.name)
        out_dir.mkdir(exist_ok=True)
        try:
            if resolved.ladder is not None:
                report.targets.append(run_ladder(recipe, opts, info, resolved, tokenizer, windows, out_dir, workdir,
                                                 placement, baseline, kv_long))
                report.targets[-1].fingerprint = prints[resolved.name]
                continue
            # a fresh model per target (methods change it in place); the job holds the only reference,
            # so run_target can free it before measuring
            with offload_plan(recipe, info, workdir, placement) as offload:
                job = target_job(recipe, opts, info, resolved, tokenizer, windows, out_dir, workdir, offload,
                                 placement, resume.target_dir(staging, resolved.name) if recipe.resume else None)
                entry = run_target(job, resolved, baseline, opts, kv_long)
                announce(opts.ranks, "done")  # the other ranks go on to the next target (quantkit.run.follow)
                del job
            note_lockstep_baseline(report, baseline)
        except Exception as exc:
            if not opts.partial:
                raise
            entry = error_report(resolved, exc)
            opts.progress(f"[{resolved.name}] {entry.status}: {entry.error}")
        gc.collect()
        entry.fingerprint = prints[resolved.name]
        report.targets.append(entry)


def target_job(recipe: Recipe, opts: RunOptions, info: ModelInfo, resolved: ResolvedTarget, tokenizer, windows,
               out_dir: Path, workdir: Path, offload: Offload | None, placement: Placement | None = None,
               resume_dir: Path | None = None) -> QuantizeJob:
    """One target's job, with the full-precision model (`offload` on disk) and the tokenizer when its
    method needs them, where quantkit's own forwards run (streamed without a placement), and with
    --resume where its method keeps its progress."""
    job = QuantizeJob(info, resolved.options, windows, resolved.ignore, out_dir, workdir, recipe.dtype, recipe.device,
                      recipe.trust_remote_code, resolved.target.tower_precision(), offload, opts.ranks,
                      lambda message: opts.progress(f"[{resolved.name}] {message}"),
                      ModelHandle(tokenizer=tokenizer if resolved.needs_model else None),
                      **({"placement": placement} if placement is not None else {}), resume_dir=resume_dir)
    if resolved.needs_model:
        job.load_model(offload)
    return job


def run_share(recipe: Recipe, opts: RunOptions, info: ModelInfo, targets: list[ResolvedTarget],
              placement: Placement) -> None:
    """A rank other than 0 (quantkit.engines.llmcompressor.distributed), in step with rank 0's run: it checks it
    sees rank 0's staging directory, scores its share of the held-out windows with the base, quantizes each
    target on its share of the calibration windows, then takes the steps rank 0 announces (quantkit.run.follow):
    its share of the gate's windows with each artifact rank 0 stages (the sums gathered by rank 0's gate), and a
    fallback's sensitivity and re-quantizations. Nothing written outside a private work directory next to OUT."""
    import tempfile

    from quantkit.engines.transformers import load_tokenizer
    from quantkit.formats import gate

    staging = see_from_every_rank(None, opts.ranks)
    tokenizer = load_tokenizer(info, recipe.trust_remote_code)
    windows = make_windows(tokenizer, window_settings(recipe, targets), lambda message: None)
    parent = opts.out.resolve().parent
    with tempfile.TemporaryDirectory(prefix=f".quantkit-rank{opts.ranks.rank}-", dir=parent) as tmp:
        workdir = Path(tmp)
        baseline = None
        if len(windows.eval):
            baseline = score_baseline(info, recipe, windows.eval, workdir, placement, opts.ranks)
            gather_for(opts.ranks)(baseline.nll)  # rank 0's perplexity of the base (compute_baseline)
        def score(artifact: Path) -> None:  # rank 0's measure(): its artifact, this rank's share of the windows
            gate.evaluate_artifact(artifact, info.path, eval_share(windows.eval, opts.ranks), baseline,
                                   recipe.device, recipe.trust_remote_code, workdir, placement,
                                   gather=gather_for(opts.ranks))

        for resolved in targets:
            with offload_plan(recipe, info, workdir, placement) as offload:
                job = target_job(recipe, opts, info, resolved, tokenizer, windows, workdir, workdir, offload,
                                 placement, resume.target_dir(staging, resolved.name) if recipe.resume else None)
                resolved.method.quantize(job)
                job.free_model()
                follow(job, resolved.method, score)  # the gate's readings and the fallback's steps, as rank 0 says
                del job


def eval_share(windows, ranks: Ranks):
    """This rank's contiguous share of the held-out windows (all of them in one process)."""
    return windows[ranks.share(len(windows))]


def score_baseline(info: ModelInfo, recipe: Recipe, windows, workdir: Path, placement: Placement, ranks: Ranks,
                   progress: Progress = lambda message: None):
    """The base's scores on this rank's share of the held-out windows (all of them in one process); in lockstep
    nothing is scored now (quantkit.eval.scorers.base_baseline)."""
    from quantkit.eval import scorers

    return scorers.base_baseline(info, eval_share(windows, ranks), recipe.dtype, recipe.device,
                                 recipe.trust_remote_code, workdir, placement, progress)


def compute_baseline(info: ModelInfo, recipe: Recipe, windows, workdir: Path, report: RunReport,
                     progress: Progress, placement: Placement, ranks: Ranks = Ranks()):
    """Score the full-precision model once on the held-out windows (reused for every target); a text
    decoder is read from its checkpoint, resident or streamed a layer at a time as `placement` says.
    Under torchrun each rank scores its share (score_baseline, run_share) and keeps its share's baseline;
    the report's perplexity is that of every position."""
    from quantkit.eval.evaluate import perplexity, positions

    if placement.lockstep:
        progress(f"baseline: the base is scored on {len(windows)} held-out windows beside each artifact")
        report.baseline = {"positions": positions(windows), "scored": "beside each artifact"}
        return score_baseline(info, recipe, windows, workdir, placement, ranks, progress)
    progress(f"baseline: scoring {len(windows)} held-out windows"
             + (f" on {ranks.world_size} ranks" if ranks.distributed else ""))
    with PeakTracker() as t:
        baseline = score_baseline(info, recipe, windows, workdir, placement, ranks, progress)
        nll = gather_for(ranks)(baseline.nll) if ranks.distributed else baseline.nll
    report.timings["baseline_s"] = t.seconds
    report.baseline = {"ppl": perplexity(nll), "positions": int(nll.shape[0]), "peak_rss_bytes": t.peak_rss}
    return baseline


def note_lockstep_baseline(report: RunReport, baseline) -> None:
    """A lockstep baseline's perplexity in the report once a gate has scored the base (compute_baseline)."""
    from quantkit.eval.evaluate import perplexity

    if baseline is not None and baseline.scorer is not None and baseline.scored and "ppl" not in report.baseline:
        report.baseline["ppl"] = perplexity(baseline.nll)


def score_base_extras(info: ModelInfo, recipe: Recipe, targets: list[ResolvedTarget], tokenizer, windows,
                      baseline, workdir: Path, report: RunReport, progress: Progress, placement: Placement) -> None:
    """What the targets' gates ask beyond the held-out windows, from the base once per run: greedy
    continuations for `flips` (baseline.flips, quantkit.eval.generate) and lm-eval task scores
    (baseline.tasks, quantkit.eval.tasks, per task limit)."""
    from quantkit.eval import generate, scorers, tasks

    flipping = [t for t in targets if t.gate.flip_prompts]
    asked = [t for t in targets if t.gate.tasks]
    if not flipping and not asked:
        return
    logits = scorers.base_logits(info, recipe.dtype, recipe.device, recipe.trust_remote_code, workdir, placement)
    if flipping:
        count, steps = max(t.gate.flip_prompts for t in flipping), max(t.gate.flip_tokens for t in flipping)
        progress(f"flips: the base's greedy continuations of {count} held-out prompts ({steps} tokens)")
        with PeakTracker() as t:
            baseline.flips = generate.base_flips(logits, windows, count, steps)
        report.timings["baseline_flips_s"] = t.seconds
    if asked:
        progress(f"tasks: scoring the base on {len(gate_tasks(asked))} task(s)")
        length, scores = tasks.max_context(info.config), {}
        with PeakTracker() as t:
            for limit in sorted({t.gate.task_limit for t in asked}, key=lambda n: n or 0):
                same = [task for t in asked if t.gate.task_limit == limit for task in t.gate.tasks]
                scores[limit] = tasks.base_scores(logits, tokenizer, length, same, limit)
        report.timings["baseline_tasks_s"] = t.seconds
        report.baseline["tasks"] = {f"{key} (limit {limit})": score.value for limit, by_key in scores.items()
                                    for key, score in by_key.items()}
        baseline.tasks = tasks.TaskBaseline(scores, tokenizer, length)


@dataclass
class KeptReading:
    """What the gate kept of its reading of the artifact for the KV-cache types (measure_kv_types): its log-probs
    on the held-out windows (evaluate.Keeper's Baseline) and, where nothing else reads the artifact in between,
    its resident model (quantkit.formats.gate.held_artifact; else None)."""

    own: object
    held: object = None


def measure(job: QuantizeJob, resolved: ResolvedTarget, artifact: Path, baseline, entry: TargetReport,
            opts: RunOptions, keep_own: bool = False) -> KeptReading | None:
    """The artifact read back and measured against the base: the gate's metrics on the held-out
    windows, its lm-eval tasks when the gate names some, and the verdict, into `entry`. With `keep_own`, what
    the gate read is kept and returned (KeptReading; else None)."""
    from quantkit.eval import evaluate, generate
    from quantkit.eval.scorers import kv_cache_scheme
    from quantkit.formats import gate as reading

    gate = resolved.gate
    keeper = evaluate.Keeper(evaluate.positions(job.windows.eval), job.workdir) if keep_own else None
    alone = keep_own and reading.holds_artifact(gate) and not kv_cache_scheme(artifact)  # nor measure_kv_cache
    held = reading.held_artifact(artifact, job.info.path, job.device, job.placement, job.trust_remote_code,
                                 job.progress) if alone else None
    announce(job.ranks, "measure", str(artifact))  # the other ranks score their shares of the windows with it
    entry.metrics = reading.evaluate_artifact(artifact, job.info.path, eval_share(job.windows.eval, job.ranks),
                                               baseline, job.device, job.trust_remote_code, job.workdir,
                                               job.placement, job.progress, gather=gather_for(job.ranks),
                                               keep=keeper, held=held)
    logits = None
    if gate.flip_prompts or gate.tasks:
        with rank_zero_alone(job.ranks):
            logits = reading.artifact_logits(artifact, job.info.path, job.device, job.trust_remote_code, job.workdir,
                                             job.placement)
    if gate.flip_prompts:
        job.progress(f"flips: greedy continuations of {gate.flip_prompts} held-out prompts")
        entry.metrics.flips = generate.flips(logits, baseline.flips, gate.flip_prompts, gate.flip_tokens)
    entry.gate = evaluate.gate_verdict(entry.metrics, gate, enforced=opts.enforce_gate and gate.enabled)
    if gate.tasks:
        from quantkit.eval import tasks

        job.progress(f"tasks: scoring the artifact on {len(gate.tasks)} task(s)")
        started = time.time()
        base = baseline.tasks
        results = tasks.score_tasks(logits, base.tokenizer, base.max_length, gate.tasks, gate.task_limit,
                                    base.scores[gate.task_limit])
        entry.tasks = [r.as_dict() for r in results]
        entry.gate = evaluate.with_checks(entry.gate, tasks.task_checks(results))
        entry.timings["tasks_s"] = round(entry.timings.get("tasks_s", 0.0) + time.time() - started, 3)
    return KeptReading(keeper.baseline, held) if keeper else None


def serve_gate(job: QuantizeJob, resolved: ResolvedTarget, artifact: Path, entry: TargetReport) -> None:
    """gate.serve: the staged artifact loaded by the engine that serves it and measured there
    (quantkit.serve.check); the result into entry.details["serve_check"], and a failed check fails the gate.
    An engine that cannot serve this format on this device is exit 2 (nothing written). The KV-cache type the
    gate chose (--kv-cache) is the one the engine is started with, where its served log-probs can show it."""
    from quantkit.eval.evaluate import Check, with_checks
    from quantkit.serve.check import Generation, Tolerances, prepare, serve_check
    from quantkit.serve.settings import ServeOptions

    serve, gate = resolved.gate.serve, resolved.gate
    _, found, accelerator = prepare(artifact, serve.engine)
    kv_cache = served_kv_choice(entry, found, job.info.path, accelerator)
    job.progress(f"serving check: the artifact in {serve.engine if serve.engine != 'auto' else 'its engine'}")
    report = serve_check(
        artifact, job.info.path, job.windows.eval[: serve.windows], serve.engine,
        options=ServeOptions(logprobs=serve.logprobs, concurrency=max(serve.concurrency)),
        tolerances=Tolerances(serve.max_reading_kld, serve.max_ppl_drift, serve.min_reading_top1,
                              serve.max_base_kld if serve.max_base_kld is not None else gate.max_kld),
        generation=Generation(concurrencies=tuple(serve.concurrency)), device=job.device,
        trust_remote_code=job.trust_remote_code, progress=job.progress, kv_cache=kv_cache,
        gated_kld=entry.metrics.kld_mean if entry.metrics else None)
    entry.details["serve_check"] = report.as_dict()
    failed = "; ".join(f"{c.name} {c.value:.4g} (needs {c.op} {c.threshold:g})" for c in report.checks if not c.passed)
    job.progress(f"serving check: {report.engine['name']} {'agrees with the gate' if report.passed else failed}")
    entry.gate = with_checks(entry.gate, [Check("serve", float(len(report.failed)), 0.0, "==", report.passed)])


def served_kv_choice(entry: TargetReport, found, base_dir: Path, accelerator) -> str | None:
    """The KV type the gate chose for the artifact, to start the engine with in the serving check: None where none
    was chosen, or where serve-check would refuse it (quantkit.serve.check.served_kv_type: the engine's served
    log-probs would not show it, mlx_lm.server's or vLLM's TurboQuant's), said in the report's kv_cache_types.
    `found`, `accelerator`: the installed engine and this device (quantkit.serve.check.prepare)."""
    from quantkit.serve.check import served_kv_type

    section = entry.details.get("kv_cache_types") or {}
    chosen = section.get("chosen")
    if chosen is None:
        return None
    try:
        served_kv_type(chosen, found.name, base_dir, accelerator)
    except UnsupportedError as exc:
        section["serve_check"] = f"served with a 16-bit cache: {exc.message}"
        return None
    return chosen


def serve_or_say_why_not(job: QuantizeJob, resolved: ResolvedTarget, artifact: Path, entry: TargetReport) -> None:
    """The serving check a target's gate asks for: run, unless the enforced gate has already failed (nothing is
    written, so nothing is served): then the report and the log say it was not run and why. Under --no-gate a
    failed gate is only recorded, so the artifact is written and the check runs."""
    if entry.gate.passed or not entry.gate.enforced:
        serve_gate(job, resolved, artifact, entry)
        return
    why = f"not run: the gate failed ({', '.join(entry.gate.failed)}), so nothing is written or served"
    job.progress(f"[{resolved.name}] serving check {why}")
    entry.details["serve_check"] = {"skipped": why}


def check_serve_engines(targets: list[ResolvedTarget], eval_windows: int) -> None:
    """Before any work: the engine of every target whose gate has `serve` is installed, and there are held-out
    windows to compare the engine's reading with (exit 2 otherwise)."""
    serving = [t.name for t in targets if t.gate.serve is not None]
    if serving and eval_windows == 0:
        raise InputError(f"target {', '.join(serving)}: the serving check compares the engine with the gate's "
                         "reading on the held-out windows, but eval_windows is 0",
                         hint="raise --eval-windows (the check sends the first gate.serve.windows of them), or drop "
                              "--serve-check")
    from quantkit.serve.check import pick_engine

    for t in targets:
        if t.gate.serve is not None:
            pick_engine(t.method.format.kind, t.gate.serve.engine)


def check_kv_types(targets: list[ResolvedTarget], info: ModelInfo, eval_windows: int) -> None:
    """Before any work: every target's --kv-cache types exist for its engine and this model (exit 2)."""
    from quantkit.eval import kv

    for t in targets:
        if t.gate.kv_cache is None:
            continue
        if eval_windows == 0:
            raise InputError(f"target {t.name}: --kv-cache measures on the held-out windows, but eval_windows is 0",
                             hint="raise --eval-windows, or drop --kv-cache")
        kv.for_artifact(t.gate.kv_cache, kv.shape_of(info.config), t.method.format.engines, t.gate.kv_engine)


def long_kv_windows(tokenizer, settings: Calibration, targets: list[ResolvedTarget], progress: Progress) -> dict:
    """{context: held-out windows of that many tokens} for each --kv-context of a target measuring KV-cache types
    that differs from the gate's seq_len (made before any work: too little text fails here, exit 2)."""
    contexts = sorted({t.gate.kv_context for t in targets if t.gate.kv_cache is not None and t.gate.kv_context
                       and t.gate.kv_context != settings.seq_len})
    return {context: make_windows(tokenizer, settings.model_copy(update={"seq_len": context, "num_samples": 0}),
                                  progress).eval for context in contexts}


def kv_baseline(info: ModelInfo, recipe: Recipe, windows, workdir: Path, progress: Progress):
    """The base's baseline on the longer windows of --kv-context, streamed a layer at a time (as `eval
    --kv-context` scores it)."""
    from quantkit.eval import scorers

    progress(f"KV cache: the base on {len(windows)} windows of {windows.shape[1]} tokens (streamed)")
    return scorers.base_baseline(info, windows, recipe.dtype, recipe.device, recipe.trust_remote_code, workdir,
                                 progress=progress)


def keeps_own_reading(job: QuantizeJob, gate, kv_long: dict | None) -> bool:
    """Whether the gate keeps the artifact's reading as it measures it, for the KV-cache types to be compared with
    (measure_kv_types): they are measured on the gate's own windows, in one process."""
    return gate.kv_cache is not None and not job.ranks.distributed and gate.kv_context not in (kv_long or {})


def measure_kv_types(job: QuantizeJob, resolved: ResolvedTarget, artifact: Path, baseline, entry: TargetReport,
                     opts: RunOptions, kv_long: dict | None = None, kept: KeptReading | None = None) -> None:
    """The gate's --kv-cache types on the final artifact (quantkit.eval.kv.measure) into
    entry.details["kv_cache_types"]; the smallest passing type's flags go into the serve command. On the windows
    of --kv-context where it is set (`kv_long`: context -> (windows, the base's baseline)), else the gate's, with
    what the gate `kept` of its reading (measure)."""
    from quantkit.eval import kv
    from quantkit.eval.kv.measure import measure_types, smallest_passing
    from quantkit.formats.gate import opened_for_kv

    gate, shape = resolved.gate, kv.shape_of(job.info.config)
    kinds = kv.for_artifact(gate.kv_cache, shape, resolved.method.format.engines, gate.kv_engine)
    windows, base = (kv_long or {}).get(gate.kv_context, (job.windows.eval, baseline))
    opts.progress(f"[{resolved.name}] measuring {len(kinds)} KV-cache type(s) on windows of {windows.shape[1]} tokens")
    with PeakTracker() as tracked:
        gates = windows is job.windows.eval and kept is not None  # on the gate's windows, its reading kept
        held = kept.held if gates else None
        reading, model = (held.reading, None) if held else opened_for_kv(artifact, job.info.path, job.device,
                                                                          job.trust_remote_code)
        rows = measure_types(reading, model, windows, base, kinds, shape, gate, job.device, opts.progress,
                             until_pass=kv.stops_at_first_pass(gate.kv_cache),
                             placement=job.placement if windows is job.windows.eval else None,
                             own=kept.own if gates else None, held=held)
        del reading, model, held
    entry.timings["kv_cache_s"] = tracked.seconds
    entry.peak_rss_by_step["kv cache"] = tracked.peak_rss
    entry.peak_rss_bytes = max(entry.peak_rss_bytes or 0, tracked.peak_rss)
    chosen = smallest_passing(rows)
    entry.details["kv_cache_types"] = {"types": [r.as_dict(shape) for r in rows], "context": windows.shape[1],
                                       "chosen": chosen.kind.name if chosen else None,
                                       "serve_flags": list(chosen.kind.flag) if chosen else []}


def measure_kv_cache(job: QuantizeJob, resolved: ResolvedTarget, artifact: Path, entry: TargetReport,
                     opts: RunOptions) -> None:
    """An artifact with a kv_cache_scheme: the KV quantization's own damage (the same weights with the
    KV cache 16-bit against quantized) into entry.details["kv_cache"]."""
    from quantkit.eval import scorers
    from quantkit.formats import gate

    scheme = scorers.kv_cache_scheme(artifact)
    if not scheme:
        return
    opts.progress(f"[{resolved.name}] measuring the KV-cache quantization alone (same weights, KV 16-bit)")
    kv = gate.kv_only_metrics(artifact, job.windows.eval, job.device, job.trust_remote_code)
    entry.details["kv_cache"] = {"scheme": scheme, "kld_mean": kv.kld_mean, "kld_p99": kv.kld_p99,
                                 "top1": kv.top1, "ppl_increase": kv.ppl_increase}


def run_target(job: QuantizeJob, resolved: ResolvedTarget, baseline, opts: RunOptions,
               kv_long: dict | None = None) -> TargetReport:
    """Quantize one target into its staging dir, then reload it from disk and measure it."""
    opts.progress(f"[{resolved.name}] quantizing with {resolved.target.method}")
    with PeakTracker() as qt:
        result = resolved.method.quantize(job)
    export.copy_side_files(job.info.path, job.out_dir)
    entry = target_report(resolved, job.info, result)
    entry.timings["quantize_s"] = qt.seconds
    entry.peak_rss_bytes = qt.peak_rss
    entry.peak_rss_by_step["quantize"] = qt.peak_rss
    job.free_model()  # the engine's freed model goes back to the OS before the gate loads the artifact
    if job.info.towers.components:
        entry.details["towers"] = (resolved.method.towers.proof or tower_proof)(job, result)
    if baseline is None:
        entry.details["serving"] = serving.artifact_plan(job.info, resolved.method, result.artifact, job.options)
        return entry
    opts.progress(f"[{resolved.name}] measuring the artifact against the base")
    with PeakTracker() as et:
        kept = measure(job, resolved, result.artifact, baseline, entry, opts,
                       keep_own=keeps_own_reading(job, resolved.gate, kv_long))
    entry.timings["eval_s"] = et.seconds
    entry.peak_rss_bytes = max(qt.peak_rss, et.peak_rss)
    entry.peak_rss_by_step["eval"] = et.peak_rss
    if not entry.gate.passed and fallback_options(resolved) is not None:
        kept = None  # the guide changes the artifact: it is read again
        run_fallback(job, resolved, result, entry, baseline, opts)
    with rank_zero_alone(job.ranks):  # the other ranks are done with this target
        measure_kv_cache(job, resolved, result.artifact, entry, opts)  # the final artifact's, after any fallback
        if resolved.gate.kv_cache is not None:
            measure_kv_types(job, resolved, result.artifact, baseline, entry, opts, kv_long, kept)
        del kept
        if resolved.gate.serve is not None:
            serve_or_say_why_not(job, resolved, result.artifact, entry)
    if entry.failed_enforced_gate:
        entry.status, entry.exit_code = "failed", GateFailedError.exit_code
    entry.details["serving"] = serving.artifact_plan(job.info, resolved.method, result.artifact, job.options,
                                                     (entry.details.get("kv_cache_types") or {}).get("serve_flags"))
    return entry


def run_ladder(recipe: Recipe, opts: RunOptions, info: ModelInfo, resolved: ResolvedTarget, tokenizer, windows,
               out_dir: Path, workdir: Path, placement: Placement, baseline, kv_long: dict | None = None) -> TargetReport:
    """Method auto: the candidates measured in the order quantkit.run.auto chooses until the answer is known,
    each built in a directory of its own (a failed one removed at once); when none passed, the guide on the one
    that came closest; the chosen artifact moved into the target's output. The report entry is the chosen
    candidate's (none passed: the closest one's, failed), with the ladder in details.auto."""
    ladder = resolved.ladder
    built: dict[str, tuple[TargetReport, Path | None]] = {}  # label -> its entry, and its artifact while kept

    def search() -> auto.Rung | None:  # measure until the answer is known and stands its after-choice checks
        while True:
            while (rung := auto.next_probe(ladder)) is not None:
                run_candidate(recipe, opts, info, ladder, rung, resolved.candidates[rung.label], tokenizer, windows,
                              workdir, placement, baseline, built)
            chosen = auto.answer(ladder)
            if chosen is not None and built[chosen.label][1] is None:  # removed when a smaller one passed, which
                auto.reopen(ladder, chosen)  # the engine then failed: measured again
                continue
            if chosen is None or after_choice(recipe, opts, info, resolved, ladder, chosen, windows, workdir,
                                              placement, baseline, built, kv_long):
                return chosen

    if search() is None and (closest := auto.guide_candidate(ladder)) is not None:
        raised = auto.guided(ladder, closest)
        try:
            resolved.candidates[raised.label] = candidate_target(recipe, resolved.target, info, raised.candidate,
                                                                 resolved.gate)
        except QuantkitError as exc:
            auto.record(ladder, raised, False, None, f"refused: {exc.message}")
        search()
    auto.finish(ladder)
    return ladder_entry(resolved, ladder, built, out_dir, opts)


def after_choice(recipe: Recipe, opts: RunOptions, info: ModelInfo, resolved: ResolvedTarget, ladder: auto.Ladder,
                 chosen: auto.Rung, windows, workdir: Path, placement: Placement, baseline,
                 built: dict[str, tuple[TargetReport, Path | None]], kv_long: dict | None = None) -> bool:
    """What the gate asks beyond the reading, on the chosen candidate only: its KV-cache types (--kv-cache) and
    the serving check (--serve-check). False when the engine's check failed it: the candidate fails (settling
    nothing else in its chain) and the search goes on."""
    import shutil

    gate = resolved.gate
    if gate.serve is None and gate.kv_cache is None:
        return True
    entry, build = built[chosen.label]
    candidate = dataclasses.replace(resolved.candidates[chosen.label], gate=gate, needs_model=False)
    artifact = candidate.method.format.served_path(build)
    job = target_job(recipe, opts, info, candidate, None, windows, build, workdir, None, placement)
    if gate.kv_cache is not None:
        measure_kv_types(job, candidate, artifact, baseline, entry, opts, kv_long)
    if gate.serve is not None:
        serve_or_say_why_not(job, candidate, artifact, entry)
    entry.details["serving"] = serving.artifact_plan(info, candidate.method, artifact, candidate.options,
                                                     (entry.details.get("kv_cache_types") or {}).get("serve_flags"))
    if entry.gate.passed:
        return True
    auto.record(ladder, chosen, False, chosen.kld, f"failed the serving check ({gate.serve.engine})", settles=False)
    shutil.rmtree(build, ignore_errors=True)
    built[chosen.label] = (entry, None)
    return False


def run_candidate(recipe: Recipe, opts: RunOptions, info: ModelInfo, ladder: auto.Ladder, rung: auto.Rung,
                  candidate: ResolvedTarget, tokenizer, windows, workdir: Path, placement: Placement, baseline,
                  built: dict[str, tuple[TargetReport, Path | None]]) -> None:
    """One candidate built, measured and recorded in the ladder; a candidate that raises a QuantkitError (it
    cannot be built or read back) fails with its message and the ladder goes on."""
    import shutil

    from quantkit.units import human_bytes

    build = workdir / "auto" / ladder_name(candidate) / str(ladder.rungs.index(rung))
    build.mkdir(parents=True)
    candidate = dataclasses.replace(candidate, gate=candidate.gate.model_copy(update={"serve": None, "kv_cache": None}))
    opts.progress(f"[{ladder_name(candidate)}] candidate {rung.label}: about {human_bytes(rung.weights)}, "
                  f"{rung.runtime}")
    started = time.time()
    try:
        with offload_plan(recipe, info, workdir, placement) as offload:
            job = target_job(recipe, opts, info, candidate, tokenizer, windows, build, workdir, offload, placement)
            entry = run_target(job, candidate, baseline, opts)
            del job
    except QuantkitError as exc:
        auto.record(ladder, rung, False, None, f"not built: {exc.message}")
        shutil.rmtree(build, ignore_errors=True)
        return
    finally:
        gc.collect()
    rung.seconds = round(time.time() - started, 1)
    rung.artifact_bytes = export.artifact_bytes(build)
    limit = ladder.options.max_bytes()
    kld = entry.metrics.kld_mean if entry.metrics else None
    passed = bool(entry.gate and entry.gate.passed) and not (limit and rung.artifact_bytes > limit)
    why = "" if passed else candidate_failure(entry, rung, ladder)
    auto.record(ladder, rung, passed, kld, why)
    opts.progress(f"[{ladder_name(candidate)}] candidate {rung.label}: {rung.status}, {rung.why}")
    if passed:  # one passed artifact on disk: a larger one that passed goes (search() reopens it if it is needed)
        for label, (other, path) in list(built.items()):
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)
                built[label] = (other, None)
    else:
        shutil.rmtree(build, ignore_errors=True)
    built[rung.label] = (entry, build if passed else None)


def ladder_name(candidate: ResolvedTarget) -> str:
    return candidate.name.partition(": ")[0]


def candidate_failure(entry: TargetReport, rung: auto.Rung, ladder: auto.Ladder) -> str:
    """Why a measured candidate did not pass: the gate's failed checks, or its size on disk over --max-size."""
    from quantkit.units import human_bytes

    if entry.gate and not entry.gate.passed:
        guide = entry.details.get("fallback")
        stopped = f"; the guide stopped: {guide['stopped']}" if guide and guide.get("stopped") else ""
        return f"failed the gate: {', '.join(entry.gate.failed)}{auto.kld_text(entry.metrics.kld_mean)}{stopped}"
    return f"written at {human_bytes(rung.artifact_bytes)}, over --max-size {ladder.options.max_size}"


def ladder_entry(resolved: ResolvedTarget, ladder: auto.Ladder, built: dict[str, tuple[TargetReport, Path | None]],
                 out_dir: Path, opts: RunOptions) -> TargetReport:
    """The target's report entry: the chosen candidate's with its artifact moved into `out_dir`; none passed:
    the closest candidate's (failed, exit 3), or an error entry when none could be measured."""
    import shutil

    if ladder.chosen is not None:
        entry, build = built[ladder.chosen.label]
        for item in sorted(build.iterdir()):
            shutil.move(str(item), str(out_dir / item.name))
    else:
        measured = [built[r.label][0] for r in ladder.rungs if r.label in built and r.kld is not None]
        entry = (min(measured, key=lambda e: e.metrics.kld_mean) if measured else
                 error_report(resolved, GateFailedError(
                     "no candidate of the ladder could be built and measured",
                     hint="see each candidate's reason in the ladder; name a method to see its own error")))
        entry.status, entry.exit_code = "failed", GateFailedError.exit_code
        entry.error = entry.error or f"no candidate for {ladder.destination.text} passed the gate"
    entry.name = resolved.name
    entry.details["auto"] = ladder.as_dict()
    opts.progress(f"[{resolved.name}] chose {ladder.chosen.label}" if ladder.chosen else
                  f"[{resolved.name}] no candidate passed")
    return entry


def tower_proof(job: QuantizeJob, result: QuantizeResult) -> dict:
    """A VLM checkpoint artifact reloaded: towers bit-identical to the source and an image+text forward
    (quantkit.eval.vlm_proof; exit 3 otherwise). A method whose artifact is not a checkpoint directory
    proves its towers itself (Towers.proof)."""
    from quantkit.eval.vlm_proof import prove_towers
    from quantkit.formats.gate import load_artifact

    model = load_artifact(result.artifact, None, job.device, job.trust_remote_code)
    proof = prove_towers(model, result.artifact, job.info, tuple(job.towers))
    return {**proof, "tower_precision": job.towers, "forced": "int4" in job.towers.values()} if job.towers else proof


def fallback_options(resolved: ResolvedTarget):
    """The target's fallback options (quantkit.mixed.budget.Fallback), None when it has none."""
    return getattr(resolved.options, "fallback", None)


def run_fallback(job: QuantizeJob, resolved: ResolvedTarget, result: QuantizeResult, entry: TargetReport,
                 baseline, opts: RunOptions) -> None:
    """Gate-driven fallback (quantkit.run.fallback): the artifact written again with the units the method's
    ladder predicts most damaging raised, each step measured like the first artifact."""
    from quantkit.run import fallback

    leader = dataclasses.replace(resolved, method=leading(resolved.method, job.ranks))  # announced to the other ranks
    fallback.run_fallback(job, leader, result, entry,
                          lambda artifact: measure(job, resolved, artifact, baseline, entry, opts))


def error_report(resolved: ResolvedTarget, exc: Exception) -> TargetReport:
    """A target that raised (--partial): reported with the error's message and exit code; an
    artifact that did not reload (exit 3) counts as failed, anything else as an error."""
    if isinstance(exc, QuantkitError):
        message, exit_code = exc.message, exc.exit_code
    else:
        message, exit_code = f"internal error: {type(exc).__name__}: {exc}".splitlines()[0], 1
    return TargetReport(
        name=resolved.name, method=resolved.method.name, format=resolved.method.label,
        engine=resolved.method.engine, engine_version=package_version(resolved.method.package),
        options=resolved.options.model_dump(mode="json"), ignore=resolved.ignore, kept=[], quantized_modules=0,
        status="failed" if exit_code == GateFailedError.exit_code else "error", error=message, exit_code=exit_code,
    )


def target_report(resolved: ResolvedTarget, info: ModelInfo, result: QuantizeResult) -> TargetReport:
    plan = build_plan(info, resolved.method, resolved.options, resolved.ignore, resolved.target.tower_precision())
    return TargetReport(
        name=resolved.name,
        method=resolved.method.name,
        format=resolved.method.label,
        engine=resolved.method.engine,
        engine_version=package_version(resolved.method.package),
        options=resolved.options.model_dump(mode="json"),
        ignore=resolved.ignore,
        kept=sorted({e.role for e in plan if e.kept}),
        quantized_modules=sum(1 for e in plan if not e.kept),
        details={**({"choices": resolved.choices} if resolved.choices else {}),
                 **({"kept_16bit": resolved.kept_16bit} if resolved.kept_16bit else {}), **result.details},
    )


def _finish(staging: Path, recipe: Recipe, opts: RunOptions, report: RunReport) -> None:
    """Write reports and publish. Without --partial, any failed target publishes nothing; with it,
    the targets that passed are published and the run still fails (with the worst exit code)."""
    import shutil

    shutil.rmtree(staging / export.WORK_DIR, ignore_errors=True)
    order = [t.name for t in recipe.targets]
    report.targets.sort(key=lambda t: order.index(t.name))
    measured = [t.gate for t in report.targets if t.gate is not None]
    report.passed = all(g.passed for g in measured) if measured else None
    bad = [t for t in report.targets if t.status in ("failed", "error")]
    if bad and not opts.partial:
        raise run_failure(report, opts, bad)
    if per_target_outputs(recipe, opts):
        publish_targets(staging, recipe, opts, report)
    elif not bad and any(t.status == "passed" for t in report.targets):
        publish_run(staging, recipe, opts, report)
    else:
        export.discard(staging)  # one target, skipped (up to date) or not passed
    if bad:
        raise run_failure(report, opts, bad)


def finalize_target(out_dir: Path, target: TargetReport, report: RunReport, single: bool,
                    place: Place | None = None) -> None:
    """The model card (for its Hub repo when the recipe pushes it) and quantkit.json of a target about to
    be published."""
    target.files = sorted(p.name for p in out_dir.iterdir() if p.name != export.WORK_DIR)
    target.written = True
    write_card(out_dir, target, report, place)
    export.write_json(out_dir / "quantkit.json", report.to_dict(None if single else [target]))


def publish_run(staging: Path, recipe: Recipe, opts: RunOptions, report: RunReport) -> None:
    """Every target passed: rename the whole staging dir to OUT at once."""
    single = not multi_target(recipe)
    for target in report.targets:
        finalize_target(staging if single else staging / target.name, target, report, single,
                        places(recipe).get(target.name))
    if not single:
        export.write_json(staging / "quantkit.json", report.to_dict())
    export.publish(staging, opts.out, opts.overwrite or opts.skip_existing)


def publish_targets(staging: Path, recipe: Recipe, opts: RunOptions, report: RunReport) -> None:
    """Rename each passed target's staging dir to OUT/<target> on its own (replacing a stale
    one), leave the others in OUT alone, and rewrite OUT/quantkit.json for this run."""
    out = opts.out.resolve()
    ready = [t for t in report.targets if t.status == "passed"]
    if ready:
        out.mkdir(exist_ok=True)
    for target in ready:
        finalize_target(staging / target.name, target, report, single=False, place=places(recipe).get(target.name))
        export.move_into_place(staging / target.name, out / target.name, opts.overwrite or opts.skip_existing)
    if out.is_dir():
        export.replace_json(out / "quantkit.json", report.to_dict())
    export.discard(staging)


def run_failure(report: RunReport, opts: RunOptions, bad: list[TargetReport]) -> QuantkitError:
    """The error a run with failed targets ends with: a gate failure (exit 3) when every bad target
    failed its gate (or did not reload); otherwise the worst error's code (1 before 2 before 3)."""
    written = [t.name for t in report.targets if t.written]
    where = f"written to {opts.out}: {', '.join(written)}" if written else f"nothing was written to {opts.out}"
    if all(t.exit_code == GateFailedError.exit_code for t in bad):
        names = ", ".join(f"{t.name} ({', '.join(t.gate.failed) if t.gate else t.error})" for t in bad)
        return GateFailedError(f"quality gate failed for {names}; {where}", report=report, hint=gate_hint(report, bad))
    names = "; ".join(f"{t.name}: {t.error or 'quality gate failed'}" for t in bad)
    return RunFailedError(f"{len(bad)} of {len(report.targets)} targets failed ({names}); {where}", report,
                          min(t.exit_code for t in bad), hint="see the per-target lines above")


def gate_hint(report: RunReport, bad: list[TargetReport]) -> str:
    """What to try after failed gates: --fallback where a failed target's method has it and it was not
    used, a larger --max-size where it was used and ran out of room."""
    hint = "see the table above; loosen the gate in the recipe, or use --no-gate"
    if any("auto" in t.details for t in bad):
        return ("see the ladder above: a larger --max-size, a device with more memory (--for), or a looser gate "
                "(--max-kld, --min-top1)")
    methods = {t.method for t in bad if "fallback" in get_method(t.method).options.model_fields}
    spent = [t for t in bad if "fallback" in t.details]
    if spent:
        return f"{hint}; or raise --max-size (the fallback ran out of room: {spent[0].details['fallback']['stopped']})"
    if methods:
        return (f"{hint}; or add --fallback ({', '.join(sorted(methods))}: keep the most damaging layers at a "
                "higher precision until the gate passes, within --max-size)")
    return hint


def base_report(recipe: Recipe, opts: RunOptions, info: ModelInfo, inputs: dict[str, str]) -> RunReport:
    packages = ("torch", "transformers", "llmcompressor", "compressed-tensors", "gguf", "bitsandbytes")
    pinned = {"model": info.hub.pinned} if info.hub else {}  # a rerun of the recorded recipe reads this commit
    return RunReport(
        quantkit_version=__version__,
        versions={"python": platform.python_version(), **{p: package_version(p) for p in packages}},
        recipe={**recipe.model_dump(mode="json"), **pinned},
        model=ModelReport(path=str(info.path), architecture=info.architecture, model_type=info.model_type,
                          parameters=info.num_parameters, dtype=info.dtype,
                          towers=tower_summary(info.towers) if info.towers.components else None,
                          sha256={p.name: inputs[f"model/{p.name}"] for p in info.weight_files},
                          hub=info.hub.as_dict() if info.hub else None, license=read_license(info.path)),
        calibration=recipe.calibration.model_dump(mode="json"),
        gate_enforced=opts.enforce_gate,
        inputs=inputs,
    )


def make_windows(tokenizer, settings: Calibration, progress: Progress):
    from quantkit.run.calibration import make_windows as build

    progress(f"calibration: {settings.num_samples} x {settings.seq_len} tokens from '{settings.source}' "
             f"(+{settings.eval_windows} held out)")
    return build(tokenizer, settings)


@contextmanager
def offload_plan(recipe: Recipe, info: ModelInfo, workdir: Path,
                 placement: Placement | None = None) -> Iterator[Offload | None]:
    """What one target's model keeps on disk, in a fresh folder removed afterwards: with --offload-dir
    every decoder layer and the vocabulary tables, in a folder there; otherwise nothing where the model fits
    whole (the placement says so: tables_on_disk False on a CPU, a model that fits the GPU of a GPU run; a
    VLM always loads whole), else the tables alone, in the run's work directory.
    quantkit.engines.transformers.Offload says why."""
    import shutil
    import tempfile

    from quantkit.engines.transformers import Offload

    whole_on_gpu = placement is not None and placement.device == "cuda" and not placement.onload
    fits = placement is not None and placement.device != "cuda" and not placement.tables_on_disk
    if recipe.offload_dir is None and (is_vlm(info.config) or whole_on_gpu or fits):
        yield None
        return
    parent = recipe.offload_dir or workdir
    folder = Path(tempfile.mkdtemp(prefix="quantkit-offload-", dir=parent))
    try:
        yield Offload(folder, layers=recipe.offload_dir is not None)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def lora_plan(info: ModelInfo, recipe: Recipe):
    return plan_merge(info, recipe.model or str(info.path), recipe.lora, recipe.lora_weights, recipe.merge_base,
                      recipe.original_base, recipe.trust_remote_code)


def merge_lora(info: ModelInfo, recipe: Recipe, workdir: Path, report: RunReport, progress: Progress) -> ModelInfo:
    """Merge adapters into the full-precision base (quantkit.run.lora) and continue from the merged checkpoint."""
    from quantkit.run.lora import merge

    progress(f"merging {len(recipe.lora)} LoRA adapter(s)")
    report.merge = merge(lora_plan(info, recipe), workdir / "merged", workdir, progress).to_dict()
    return check_model_dir(workdir / "merged")


__all__ = ["ResolvedTarget", "RunOptions", "run", "prepare"]
