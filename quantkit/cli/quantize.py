"""`quantkit quantize`: one model in, one or more gated artifacts out."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from quantkit.cli.common import METHOD, MODEL, ProgressLog, err, handle_errors, lean_transformers, results_console, write_json
from quantkit.cli.options import (
    IGNORE,
    LORA,
    LORA_WEIGHT,
    MERGE_BASE,
    METHOD_NAME,
    METHOD_OPTIONS,
    ORIGINAL_BASE,
    OUTPUT,
    OVERWRITE,
    PROJECTOR,
    RECIPE,
    TRUST_REMOTE_CODE,
    VISION,
    CalibrationFlags,
    QuantizeGateFlags,
    ReportFlags,
    ResourceFlags,
    flag,
    takes,
)

EXAMPLES = """
Examples:

  quantkit quantize ./my-model --method fp8 -o ./my-model-fp8   (FP8 for vLLM, no calibration)

  quantkit quantize ./my-model --method gptq -o ./my-model-gptq   (W4A16 for vLLM)

  quantkit quantize my-org/my-model@main --method fp8 -o ./fp8 --push-to-hub my-org/my-model-fp8   (from the Hub and back)

  quantkit quantize ./my-model --method gguf --gguf-type Q4_K_M -o ./gguf   (llama.cpp / Ollama)

More examples:

  quantkit quantize ./my-model --method fp8 --scheme fp8-static --calib ./chat.jsonl -o ./fp8-static

  quantkit quantize --recipe recipes/fp8-dynamic.yaml --model ./ckpt -o ./dist --json report.json

  quantkit quantize ./my-model --method fp8 --scheme fp8-block -o ./fp8-block   (as DeepSeek-V3 / Qwen3 ship FP8; layers
  128 does not tile stay 16-bit, listed)

  quantkit quantize ./my-model --method gptq --serve-check vllm -o ./gptq   (the gate also loads it in vLLM)

  quantkit quantize ./my-model --method auto --for vllm:L4 -o ./auto   (the smallest artifact that passes and serves on an L4)

  quantkit quantize ./my-model --method auto --for llama.cpp --for mlx:M3-Max-64G --max-size 4GB -o ./auto   (one each)

  quantkit quantize ./my-model --method nvfp4 -o ./nvfp4   (W4A4 NVFP4: Blackwell; --scheme a16 for weights only)

  quantkit quantize ./my-model --method fp8 --kv-cache fp8 -o ./fp8-kv   (FP8 KV cache with calibrated scales)

  quantkit quantize ./my-model --method gptq --activations int8 -o ./w4a8   (W4A8: int4 weights, int8 activations)

  quantkit quantize ./my-model --method nvfp4 --rotate hadamard -o ./nvfp4-rot   (Hadamard rotation before W4A4)

  quantkit quantize ./my-model --method gguf --gguf-type Q4_K_M --auto-precision --fallback -o ./gguf

  quantkit quantize ./base --lora ./adapter --method gptq --bits 4 --group-size 128 -o ./gptq

  quantkit quantize ./my-model --method mlx --bits 4 --group-size 64 -o ./mlx   (mlx-lm on Apple silicon)

  quantkit quantize ./my-model --method gptq --auto-precision -o ./gptq-mixed   (int4/int8/16-bit per layer)

  quantkit quantize ./my-model --method gptq --fallback --max-size +10% -o ./gptq   (raise layers until the gate passes)

  quantkit quantize ./ckpt --recipe release -o ./dist   (one dir per target)

  quantkit quantize ./my-model --method gptq --task-file my_task.yaml --tasks arc_easy --limit 200 -o ./gptq   (task gate, offline data)

  quantkit quantize ./my-model --method gguf -o ./gguf --resume   (the same command after a kill continues from the last tensor written)

  torchrun --standalone --nproc-per-node 4 -m quantkit quantize ./my-model --method gptq --device cuda -o ./gptq   (one rank per GPU)

  quantkit quantize ./ckpt --lora ./adapter --recipe release -o ./dist --skip-existing --partial --quiet --summary "$GITHUB_STEP_SUMMARY"   (CI)

CLI flags override recipe fields. Exit codes: 0 ok, 1 internal error, 2 bad input, 3 quality gate
failed (with --partial: the worst target's code, 1 before 2 before 3).
"""


@dataclass(frozen=True)
class SourceFlags:
    """The model, the recipe, the adapters merged first and the output."""

    model_opt: Optional[str] = flag(str, None, "--model", panel=MODEL, help="Same as MODEL (handy in CI scripts).").field()
    output: Path = OUTPUT.field()
    recipe: Optional[str] = RECIPE.field()
    lora: list[str] = LORA.field()
    lora_weight: list[float] = LORA_WEIGHT.field()
    merge_base: Optional[str] = MERGE_BASE.field()
    original_base: Optional[str] = ORIGINAL_BASE.field()
    trust_remote_code: bool = TRUST_REMOTE_CODE.field()
    overwrite: bool = OVERWRITE.field()
    offline: bool = flag(bool, False, "--offline", panel=MODEL,
                         help="Read a Hub model from the Hugging Face cache only, as HF_HUB_OFFLINE=1 (recipe: offline: "
                              "true).").field()
    push_to_hub: Optional[str] = flag(
        Optional[str], None, "--push-to-hub", panel=MODEL, metavar="ORG/NAME",
        help="Push each target that passes its gate to this Hub repo ({name}: the target's name, one repo per target), "
             "in one commit with its model card; created if missing. Needs a token that can write (HF_TOKEN).").field()
    private: bool = flag(bool, False, "--private", panel=MODEL, help="Create a missing --push-to-hub repo private.").field()
    resume: bool = flag(
        bool, False, "--resume", panel=MODEL,
        help="Keep the run's progress beside OUT, and continue an interrupted run (SIGTERM, kill -9, power loss, out "
             "of memory) of the same inputs and recipe from it, byte-identical to an uninterrupted run: gguf from the "
             "last written tensor, fp8-dynamic (model-free) from the last written shard, gptq/awq/smoothquant/"
             "autoround/nvfp4/fp8-static from the last finished decoder layer; nf4, mlx and data-free oneshot schemes "
             "refuse it (exit 2).").field()


@dataclass(frozen=True)
class TargetFlags:
    """The method and what it leaves alone: fields of the recipe's targets (and its strict_shapes)."""

    method: Optional[str] = METHOD_NAME.field()
    ignore: list[str] = IGNORE.field()
    vision: Optional[str] = VISION.field()
    projector: Optional[str] = PROJECTOR.field()
    force: bool = flag(bool, False, "--force", panel=METHOD,
                       help="Allow 4-bit VLM towers (recorded in the report and model card).").field()
    destinations: list[str] = flag(
        list[str], [], "--for", panel=METHOD, metavar="ENGINE[:DEVICE]",
        help="With --method auto: where the artifact is served, e.g. vllm:L4, vllm:H100, vllm:cpu, llama.cpp, "
             "llama.cpp:cpu, mlx:M3-Max-64G, transformers (an engine alone: vllm on H100, llama.cpp and transformers "
             "on this CPU, mlx on M3-Max-64G); repeatable: one artifact each, in OUT/auto-<engine>-<device>.").field()
    context: Optional[int] = flag(Optional[int], None, "--context", panel=METHOD, min=1,
                                  help="With --method auto: tokens per sequence of KV cache the device must hold "
                                       "beside the weights (default 4096).").field()
    batch: Optional[int] = flag(Optional[int], None, "--batch", panel=METHOD, min=1,
                                help="With --method auto: sequences served at once (default 1).").field()
    strict_shapes: bool = flag(
        bool, False, "--strict-shapes", panel=METHOD,
        help="Refuse (exit 2) a layer whose widths the format's blocks or groups cannot tile (fp8-block, nvfp4, mxfp4, "
             "an explicit --group-size), instead of keeping it 16-bit and listing it.").field()

    def towers(self) -> dict:
        """The targets' tower fields given (None: the recipe's)."""
        return dict(vision=self.vision, projector=self.projector, force=self.force or None)


@handle_errors
@lean_transformers
@takes(source=SourceFlags, target=TargetFlags, options=METHOD_OPTIONS, calibration=CalibrationFlags,
       gate=QuantizeGateFlags, resources=ResourceFlags, reports=ReportFlags)
def quantize(
    model: Optional[str] = typer.Argument(None, help="Local checkpoint dir, or a Hub id org/name[@revision] (fetched into the Hugging Face cache, pinned to its commit). Default: the recipe's model.", rich_help_panel=MODEL),
    *, source: SourceFlags, target: TargetFlags, options, calibration: CalibrationFlags, gate: QuantizeGateFlags,
    resources: ResourceFlags, reports: ReportFlags,
) -> None:
    from quantkit.errors import GateFailedError, RunFailedError
    from quantkit.run.pipeline import run

    log = ProgressLog(err)
    recipe, opts = parse(model, source, target, options, calibration, gate, resources, reports, log)
    try:
        report = run(recipe, opts)
    except (GateFailedError, RunFailedError) as exc:
        log.close()
        show_results(exc.report, source.output, reports)
        raise
    finally:
        log.close()
    if report is None:  # a torchrun rank other than 0
        if not reports.quiet:
            err.print(f"rank {opts.ranks.rank} of {opts.ranks.world_size}: calibration and gate shares done; "
                      f"rank 0 writes {source.output}", highlight=False)
        return
    show_results(report, source.output, reports)
    if not reports.quiet:
        written = any(t.written for t in report.targets)
        results_console(reports.json_path).print(f"wrote {source.output}" if written else f"up to date: {source.output}",
                                                 highlight=False)
    for entry in report.targets:
        if entry.push:
            results_console(reports.json_path).print(f"pushed {entry.name}: {entry.push['commit_url']}", highlight=False)


def parse(model: str | None, source: SourceFlags, target: TargetFlags, options, calibration: CalibrationFlags,
          gate: QuantizeGateFlags, resources: ResourceFlags, reports: ReportFlags, log: ProgressLog):
    """The command line as (the recipe, the run's options), validated before any work (exit 2): the flags
    override the recipe's fields, and the method flags (options: quantkit.run.recipe.MethodOptions) go into
    the targets whose method has each."""
    from quantkit.engines.llmcompressor.distributed import ranks_from
    from quantkit.run.pipeline import RunOptions
    from quantkit.run.recipe import Overrides, build_recipe

    options, kv_fields = kv_cache_flags(options, gate.kv_engine, gate.kv_context)
    overrides = Overrides(
        model=model or source.model_opt, device=resources.device, dtype=resources.dtype,
        offload_dir=resources.offload_dir, strict_shapes=target.strict_shapes,
        trust_remote_code=source.trust_remote_code, resume=source.resume, offline=source.offline,
        push=dict(repo=source.push_to_hub, private=source.private or None), lora=source.lora,
        lora_weights=source.lora_weight, merge_base=source.merge_base, original_base=source.original_base,
        ignore=target.ignore, towers=target.towers(), calibration=calibration.calibration_fields(),
        gate={**gate.gate_fields(), **kv_fields}, method_options=options, destinations=target.destinations,
        auto={"context": target.context, "batch": target.batch})
    recipe = build_recipe(source.recipe, target.method, overrides)
    if gate.no_gate and not reports.quiet:
        err.print("warning: --no-gate: the quality gate is measured but not enforced (recorded in quantkit.json)",
                  style="yellow", highlight=False)
    ranks = ranks_from(os.environ)
    return recipe, RunOptions(
        model=recipe.model, out=source.output, overwrite=source.overwrite, enforce_gate=not gate.no_gate,
        max_memory=resources.memory_bytes(), only=reports.targets(), skip_existing=reports.skip_existing,
        partial=reports.partial, ranks=ranks, progress=(lambda message: None) if reports.quiet or not ranks.is_main else log)


def kv_cache_flags(options, kv_engine: str | None, kv_context: int | None = None):
    """--kv-cache fp8 stays the compressed-tensors methods' calibrated FP8 KV cache (method option, measured as
    vLLM's fp8); any other value (a list of engine types, auto) is the gate's KV-cache measurement, with the
    engine (--kv-engine) and window length (--kv-context) it is measured for."""
    from dataclasses import replace

    from quantkit.errors import InputError
    from quantkit.eval.kv import CALIBRATED_FP8

    value = getattr(options, "kv_cache", None)
    if value is None or value == CALIBRATED_FP8:
        for name, given in (("--kv-engine chooses the engine", kv_engine), ("--kv-context sets the windows", kv_context)):
            if given is not None:
                raise InputError(f"{name} of the --kv-cache measurement (engine types or auto)",
                                 hint="add --kv-cache auto, or a list of types such as llama.cpp:q8_0,llama.cpp:q4_0")
        return options, {}
    fields = {"kv_cache": value, "kv_engine": kv_engine}
    return replace(options, kv_cache=None), fields | ({"kv_context": kv_context} if kv_context is not None else {})


def show_results(report, output: Path, reports: ReportFlags) -> None:
    """The tables and per-target lines, the JSON report, the Markdown summary."""
    from quantkit.cli.report import print_report
    from quantkit.run.report import summary_markdown

    print_report(report, results_console(reports.json_path), output, reports.quiet)
    write_json(reports.json_path, report.to_dict())
    if reports.summary:
        with open(reports.summary, "a") as fh:
            fh.write(summary_markdown(report, output))


quantize.__doc__ = "Quantize a model into gated artifacts (compressed-tensors, bitsandbytes, GGUF, MLX).\n" + EXAMPLES
