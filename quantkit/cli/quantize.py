"""`quantkit quantize`: one model in, one or more gated artifacts out."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from quantkit.cli.common import (
    CALIBRATION,
    GATE,
    METHOD,
    MODEL,
    REPORTS,
    RESOURCES,
    ProgressLog,
    err,
    handle_errors,
    lean_transformers,
    results_console,
    write_json,
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


@handle_errors
@lean_transformers
def quantize(
    model: Optional[str] = typer.Argument(None, help="Local checkpoint dir, or a Hub id org/name[@revision] (fetched into the Hugging Face cache, pinned to its commit). Default: the recipe's model.", rich_help_panel=MODEL),
    model_opt: Optional[str] = typer.Option(None, "--model", help="Same as MODEL (handy in CI scripts).", rich_help_panel=MODEL),
    output: Path = typer.Option(..., "--output", "-o", help="Output directory (must not exist unless --overwrite).", rich_help_panel=MODEL),
    recipe: Optional[str] = typer.Option(None, "--recipe", "-r", help="Recipe YAML file or bundled recipe name.", rich_help_panel=MODEL),
    method: Optional[str] = typer.Option(None, "--method", "-m", help="fp8 | gptq | awq | autoround | smoothquant | nf4 | gguf | nvfp4 | mxfp4 | mlx", rich_help_panel=METHOD),
    scheme: Optional[str] = typer.Option(None, help="Method scheme: fp8: fp8-dynamic | fp8-static | fp8-block (128x128 weight blocks); nvfp4: w4a4 (default) | a16 (weights only).", rich_help_panel=METHOD),
    bits: Optional[int] = typer.Option(None, help="Weight bits (gptq/awq/autoround; mlx: 2 | 3 | 4 | 6 | 8).", rich_help_panel=METHOD),
    group_size: Optional[str] = typer.Option(None, help="gptq/awq/autoround group size: auto (default: the largest of 128, 64, 32 dividing every layer's input width) | N | -1 (per channel); mlx: 32 | 64 (default) | 128.", rich_help_panel=METHOD),
    act_order: Optional[str] = typer.Option(None, help="GPTQ activation order: none | static | group.", rich_help_panel=METHOD),
    symmetric: Optional[bool] = typer.Option(None, "--symmetric/--asymmetric", help="Integer weights without / with a zero point (gptq/awq/autoround).", rich_help_panel=METHOD),
    activations: Optional[str] = typer.Option(None, "--activations", help="gptq activations: none (W4A16, default) | int8 (W4A8 for vLLM's CPU backend) | fp8 (W4A8 for Hopper; group size 128); quantized dynamically per token at run time, int4 weights symmetric.", rich_help_panel=METHOD),
    backend: Optional[str] = typer.Option(None, help="Engine backend where a method has several.", rich_help_panel=METHOD),
    gguf_type: Optional[str] = typer.Option(None, help="GGUF type or mixture, e.g. Q4_K_M, Q6_K, Q8_0, IQ4_XS.", rich_help_panel=METHOD),
    imatrix: Optional[str] = typer.Option(None, help="GGUF importance matrix: auto | none | FILE.", rich_help_panel=METHOD),
    mmproj: Optional[str] = typer.Option(None, "--mmproj", help="GGUF of a VLM: its vision tower as llama.cpp's mmproj .gguf, auto | f16 | bf16 | f32; none = the language model alone (no image input).", rich_help_panel=METHOD),
    auto_precision: bool = typer.Option(False, "--auto-precision", help="Precision chosen per tensor by measured sensitivity under a size budget, never exceeded. gguf: the types llama.cpp allows for each tensor's rows, at the size of llama.cpp's --gguf-type mixture; gptq, awq: int4, int8 or 16-bit per layer at the W4A16 size +5%.", rich_help_panel=METHOD),
    budget_bpw: Optional[float] = typer.Option(None, "--budget-bpw", help="--auto-precision budget in bits per weight (gguf: of the whole file; gptq, awq: of the quantized layers, scales and zero points included).", rich_help_panel=METHOD),
    fallback: bool = typer.Option(False, "--fallback", help="When the gate fails, raise the precision of the most damaging tensors and re-measure until it passes or --max-size is reached (gguf: the next type; gptq, awq: int4 -> int8 -> 16-bit; fp8, smoothquant, nf4: 16-bit).", rich_help_panel=METHOD),
    max_size: Optional[str] = typer.Option(None, "--max-size", help="--fallback size limit: +N% of the first artifact (default +25%) or a size such as 120MB.", rich_help_panel=METHOD),
    smoothing_strength: Optional[float] = typer.Option(None, help="SmoothQuant alpha.", rich_help_panel=METHOD),
    preset: Optional[str] = typer.Option(None, help="AutoRound preset: default (200 iterations per layer) | light (50).", rich_help_panel=METHOD),
    iters: Optional[int] = typer.Option(None, help="AutoRound tuning iterations per decoder layer (overrides the preset).", rich_help_panel=METHOD),
    batch_size: Optional[int] = typer.Option(None, help="AutoRound calibration windows per tuning step (default 8).", rich_help_panel=METHOD),
    double_quant: Optional[bool] = typer.Option(None, "--double-quant/--no-double-quant", help="NF4 double quantization.", rich_help_panel=METHOD),
    compute_dtype: Optional[str] = typer.Option(None, help="NF4 compute dtype.", rich_help_panel=METHOD),
    kv_cache: Optional[str] = typer.Option(None, "--kv-cache", help="KV-cache precision stored in a compressed-tensors artifact (fp8, gptq, nvfp4, mxfp4): fp8 = calibrated per-layer FP8 k/v scales, served with vLLM's --kv-cache-dtype fp8; the gate reports the KV quantization's own KLD.", rich_help_panel=METHOD),
    rotate: Optional[str] = typer.Option(None, "--rotate", help="Rotate before quantizing, through llm-compressor's transform modifiers (gptq, autoround, smoothquant, fp8, nvfp4, mxfp4): none (default) | hadamard (QuIP: random Hadamard on each quantized Linear's input, applied online by the loader) | spinquant (SpinQuant R1+R2, folded into the weights). Refused for gguf, mlx, nf4 and awq.", rich_help_panel=METHOD),
    calib: Optional[str] = typer.Option(None, "--calib", help="Calibration source: bundled name, file, or hf:NAME.", rich_help_panel=CALIBRATION),
    calib_text_field: Optional[str] = typer.Option(None, "--calib-text-field", help="Field holding the text in .jsonl/.json/.parquet/hf: records (default: text).", rich_help_panel=CALIBRATION),
    num_samples: Optional[int] = typer.Option(None, help="Calibration windows.", rich_help_panel=CALIBRATION),
    seq_len: Optional[int] = typer.Option(None, help="Tokens per window.", rich_help_panel=CALIBRATION),
    eval_windows: Optional[int] = typer.Option(None, help="Held-out windows for the quality gate.", rich_help_panel=CALIBRATION),
    seed: Optional[int] = typer.Option(None, help="Sampling seed.", rich_help_panel=CALIBRATION),
    ignore: list[str] = typer.Option([], "--ignore", help="Keep modules unquantized (name or re:REGEX); repeatable.", rich_help_panel=METHOD),
    vision: Optional[str] = typer.Option(None, "--vision", help="VLM vision encoder: keep (16-bit, default) | int8 | int4 (W/A16; int4 needs --force).", rich_help_panel=METHOD),
    projector: Optional[str] = typer.Option(None, "--projector", help="VLM projector: keep (16-bit, default) | int8 | int4 (int4 needs --force).", rich_help_panel=METHOD),
    force: bool = typer.Option(False, "--force", help="Allow 4-bit VLM towers (recorded in the report and model card).", rich_help_panel=METHOD),
    lora: list[str] = typer.Option([], "--lora", help="LoRA adapter dir merged before quantizing; repeatable.", rich_help_panel=MODEL),
    lora_weight: list[float] = typer.Option([], "--lora-weight", help="Scale of each adapter's update, one per --lora (default 1.0).", rich_help_panel=MODEL),
    merge_base: Optional[str] = typer.Option(None, "--merge-base", help="QLoRA base: dequantized | original (see quantkit merge --help).", rich_help_panel=MODEL),
    original_base: Optional[str] = typer.Option(None, "--original-base", help="16-bit original of a QLoRA base (--merge-base original).", rich_help_panel=MODEL),
    device: Optional[str] = typer.Option(None, help="cpu | cuda | auto", rich_help_panel=RESOURCES),
    offload_dir: Optional[str] = typer.Option(None, "--offload-dir", help="Offload decoder layers to disk in this directory while quantizing (gptq/awq/autoround/smoothquant/fp8): RAM holds one layer at a time.", rich_help_panel=RESOURCES),
    dtype: Optional[str] = typer.Option(None, help="auto | bfloat16 | float16 | float32", rich_help_panel=RESOURCES),
    serve_check: Optional[str] = typer.Option(None, "--serve-check", metavar="ENGINE", help="Gate: also load the staged artifact in the engine that serves it (auto | vllm | llama.cpp | mlx; scripts/setup_engines.sh installs them) and fail the gate when it reads differently (quantkit serve-check --help).", rich_help_panel=GATE),
    strict_shapes: bool = typer.Option(False, "--strict-shapes", help="Refuse (exit 2) a layer whose widths the format's blocks or groups cannot tile (fp8-block, nvfp4, mxfp4, an explicit --group-size), instead of keeping it 16-bit and listing it.", rich_help_panel=METHOD),
    trust_remote_code: bool = typer.Option(False, help="Allow custom model code from the model dir.", rich_help_panel=MODEL),
    max_ppl_increase: Optional[float] = typer.Option(None, help="Gate: max relative perplexity increase.", rich_help_panel=GATE),
    max_kld: Optional[float] = typer.Option(None, help="Gate: max mean KL divergence.", rich_help_panel=GATE),
    min_top1: Optional[float] = typer.Option(None, help="Gate: min top-1 agreement.", rich_help_panel=GATE),
    max_ppl_delta: Optional[float] = typer.Option(None, help="Gate: max absolute perplexity increase (artifact - base).", rich_help_panel=GATE),
    tasks: Optional[str] = typer.Option(None, "--tasks", metavar="TASK[:METRIC][,...]", help="Gate: lm-evaluation-harness tasks whose data is in the local Hugging Face cache, e.g. hellaswag,arc_easy:acc_norm (needs quantkit[eval]); added to the recipe's gate.tasks.", rich_help_panel=GATE),
    task_file: list[Path] = typer.Option([], "--task-file", help="Gate: a task YAML in lm-eval's format (dataset_path: json, local data_files); repeatable.", rich_help_panel=GATE),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Gate: samples per task (gate.task_limit).", rich_help_panel=GATE),
    min_recovery: Optional[float] = typer.Option(None, "--min-recovery", min=0, help="Gate: artifact task score / base score at least this for --tasks/--task-file (default 0.95).", rich_help_panel=GATE),
    flip_prompts: Optional[int] = typer.Option(None, "--flip-prompts", min=0, help="Gate: greedy continuations of this many held-out prompts, base vs. artifact (the flips metric).", rich_help_panel=GATE),
    flip_tokens: Optional[int] = typer.Option(None, "--flip-tokens", min=1, help="Gate: tokens generated per prompt for flips (default 16).", rich_help_panel=GATE),
    max_flips: Optional[float] = typer.Option(None, "--max-flips", help="Gate: max share of greedy tokens after the first divergence (needs --flip-prompts).", rich_help_panel=GATE),
    no_gate: bool = typer.Option(False, "--no-gate", help="Measure but do not enforce the gate (recorded).", rich_help_panel=GATE),
    overwrite: bool = typer.Option(False, help="Replace an existing output.", rich_help_panel=MODEL),
    offline: bool = typer.Option(False, "--offline", help="Read a Hub model from the Hugging Face cache only, as HF_HUB_OFFLINE=1 (recipe: offline: true).", rich_help_panel=MODEL),
    push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", metavar="ORG/NAME", help="Push each target that passes its gate to this Hub repo ({name}: the target's name, one repo per target), in one commit with its model card; created if missing. Needs a token that can write (HF_TOKEN).", rich_help_panel=MODEL),
    private: bool = typer.Option(False, "--private", help="Create a missing --push-to-hub repo private.", rich_help_panel=MODEL),
    resume: bool = typer.Option(False, "--resume", help="Keep the run's progress beside OUT, and continue an interrupted run (SIGTERM, kill -9, power loss, out of memory) of the same inputs and recipe from it, byte-identical to an uninterrupted run: gguf from the last written tensor, fp8-dynamic (model-free) from the last written shard, gptq/awq/smoothquant/autoround/nvfp4/fp8-static from the last finished decoder layer; nf4, mlx and data-free oneshot schemes refuse it (exit 2).", rich_help_panel=MODEL),
    max_memory: Optional[str] = typer.Option(None, "--max-memory", help="RAM the run may use, e.g. 16GiB (default: what is available); a run estimated above it is refused before work.", rich_help_panel=RESOURCES),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the report as JSON to FILE ('-' = stdout).", rich_help_panel=REPORTS),
    only: list[str] = typer.Option([], "--only", metavar="NAME[,NAME]", help="Run only these targets: NAME[,NAME]; repeatable.", rich_help_panel=REPORTS),
    skip_existing: bool = typer.Option(False, "--skip-existing", help="Skip a target whose output's quantkit.json shows the same inputs, recipe and quantkit version; re-run and replace a stale one.", rich_help_panel=REPORTS),
    partial: bool = typer.Option(False, "--partial", help="Publish the targets that pass; a target that fails or raises does not stop the others (exit code still non-zero).", rich_help_panel=REPORTS),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only errors and one summary line per target.", rich_help_panel=REPORTS),
    summary: Optional[Path] = typer.Option(None, "--summary", metavar="FILE", help="Append a Markdown gate table to FILE (e.g. $GITHUB_STEP_SUMMARY).", rich_help_panel=REPORTS),
) -> None:
    from quantkit.errors import GateFailedError, RunFailedError
    from quantkit.run.pipeline import RunOptions, run
    from quantkit.run.recipe import Overrides, build_recipe, cli_tasks

    overrides = Overrides(
        model=model or model_opt, device=device, dtype=dtype, offload_dir=offload_dir, strict_shapes=strict_shapes,
        trust_remote_code=trust_remote_code, resume=resume, offline=offline,
        push=dict(repo=push_to_hub, private=private or None), lora=lora,
        lora_weights=lora_weight, merge_base=merge_base, original_base=original_base,
        ignore=ignore,
        towers=dict(vision=vision, projector=projector, force=force or None),
        calibration=dict(source=calib, text_field=calib_text_field, num_samples=num_samples, seq_len=seq_len,
                         eval_windows=eval_windows, seed=seed),
        gate=dict(max_ppl_increase=max_ppl_increase, max_kld=max_kld, min_top1=min_top1, max_ppl_delta=max_ppl_delta,
                  task_limit=limit, tasks=cli_tasks(tasks, [str(f) for f in task_file], min_recovery) or None,
                  flip_prompts=flip_prompts, flip_tokens=flip_tokens, max_flips=max_flips,
                  serve={"engine": serve_check} if serve_check else None),
        # Method flags name method option fields; each applies to every target whose method has that
        # option, and naming one no target has is an error.
        method_options=dict(scheme=scheme, bits=bits, group_size=group_size_option(group_size), act_order=act_order,
                            symmetric=symmetric, activations=activations,
                            backend=backend,
                            gguf_type=gguf_type, imatrix=imatrix, mmproj=mmproj, smoothing_strength=smoothing_strength,
                            rotate=rotate,
                            double_quant=double_quant, compute_dtype=compute_dtype, preset=preset, iters=iters,
                            batch_size=batch_size, kv_cache=kv_cache),
    )
    overrides.method_options.update(mixed_precision_options(auto_precision, budget_bpw, fallback, max_size))
    resolved = build_recipe(recipe, method, overrides)
    if no_gate and not quiet:
        err.print("warning: --no-gate: the quality gate is measured but not enforced (recorded in quantkit.json)",
                  style="yellow", highlight=False)
    from quantkit.engines.llmcompressor.distributed import ranks_from
    from quantkit.units import parse_size

    ranks = ranks_from(os.environ)
    log = ProgressLog(err)
    opts = RunOptions(model=resolved.model, out=output, overwrite=overwrite, enforce_gate=not no_gate,
                      max_memory=parse_size(max_memory) if max_memory else None,
                      only=[name.strip() for names in only for name in names.split(",") if name.strip()],
                      skip_existing=skip_existing, partial=partial, ranks=ranks,
                      progress=(lambda message: None) if quiet or not ranks.is_main else log)
    try:
        report = run(resolved, opts)
    except (GateFailedError, RunFailedError) as exc:
        log.close()
        show_results(exc.report, output, json_path, summary, quiet)
        raise
    finally:
        log.close()
    if report is None:  # a torchrun rank other than 0
        if not quiet:
            err.print(f"rank {ranks.rank} of {ranks.world_size}: calibration and gate shares done; "
                      f"rank 0 writes {output}", highlight=False)
        return
    show_results(report, output, json_path, summary, quiet)
    if not quiet:
        written = any(t.written for t in report.targets)
        results_console(json_path).print(f"wrote {output}" if written else f"up to date: {output}", highlight=False)
    for target in report.targets:
        if target.push:
            results_console(json_path).print(f"pushed {target.name}: {target.push['commit_url']}", highlight=False)


def group_size_option(value: str | None) -> int | str | None:
    """--group-size: auto, or a whole number."""
    from quantkit.errors import InputError

    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise InputError(f"--group-size {value}: give auto or a whole number", hint="e.g. --group-size 64") from None


def mixed_precision_options(auto_precision: bool, budget_bpw: float | None, fallback: bool,
                            max_size: str | None) -> dict:
    """--auto-precision / --budget-bpw and --fallback / --max-size as the method options they set."""
    from quantkit.errors import InputError

    if max_size is not None and not fallback:
        raise InputError("--max-size is the --fallback size limit", hint="add --fallback")
    auto = {"budget_bpw": budget_bpw} if budget_bpw is not None else {}
    return {"auto_precision": auto if auto_precision or budget_bpw is not None else None,
            "fallback": ({"max_size": max_size} if max_size else {}) if fallback else None}


def show_results(report, output: Path, json_path: str | None, summary: Path | None, quiet: bool) -> None:
    """The tables and per-target lines, the JSON report, the Markdown summary."""
    from quantkit.cli.report import print_report
    from quantkit.run.report import summary_markdown

    print_report(report, results_console(json_path), output, quiet)
    write_json(json_path, report.to_dict())
    if summary:
        with open(summary, "a") as fh:
            fh.write(summary_markdown(report, output))


quantize.__doc__ = "Quantize a model into gated artifacts (compressed-tensors, bitsandbytes, GGUF, MLX).\n" + EXAMPLES
