"""`quantkit eval`: measure any supported artifact against its base, with the gate's metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from quantkit.cli.common import (
    GATE,
    MEASURED,
    MODEL,
    REPORTS,
    RESOURCES,
    handle_errors,
    lean_transformers,
    progress,
    results_console,
    write_json,
)


@handle_errors
@lean_transformers
def eval_command(
    model: Path = typer.Argument(..., help="Artifact: a checkpoint dir (compressed-tensors, bitsandbytes, plain), an mlx-lm dir or a .gguf.", rich_help_panel=MODEL),
    against: Optional[str] = typer.Option(None, "--against", "-a", help="Base checkpoint. Default: the base named in the artifact's quantkit.json.", rich_help_panel=MODEL),
    data: str = typer.Option("default", "--data", help="Evaluation text: bundled name, file, or hf:NAME.", rich_help_panel=MEASURED),
    num_windows: int = typer.Option(16, min=1, help="Held-out windows to score.", rich_help_panel=MEASURED),
    seq_len: int = typer.Option(512, min=8, help="Tokens per window.", rich_help_panel=MEASURED),
    seed: int = typer.Option(0, help="Sampling seed (the same as quantize's gives the same held-out windows).", rich_help_panel=MEASURED),
    device: str = typer.Option("cpu", help="cpu | cuda | auto", rich_help_panel=RESOURCES),
    max_memory: Optional[str] = typer.Option(None, "--max-memory", help="RAM the forwards may use, e.g. 16GiB: with room for the model whole they run resident on a CPU (default: streamed a layer at a time; on a GPU resident whenever it fits).", rich_help_panel=RESOURCES),
    trust_remote_code: bool = typer.Option(False, help="Allow custom model code from the base and artifact dirs.", rich_help_panel=MODEL),
    max_ppl_increase: Optional[float] = typer.Option(None, help="Gate: max relative perplexity increase.", rich_help_panel=GATE),
    max_kld: Optional[float] = typer.Option(None, help="Gate: max mean KL divergence.", rich_help_panel=GATE),
    min_top1: Optional[float] = typer.Option(None, help="Gate: min top-1 agreement.", rich_help_panel=GATE),
    max_ppl_delta: Optional[float] = typer.Option(None, help="Gate: max absolute perplexity increase (artifact - base).", rich_help_panel=GATE),
    tasks: Optional[str] = typer.Option(None, "--tasks", metavar="TASK[:METRIC][,...]", help="lm-evaluation-harness tasks whose data is in the local Hugging Face cache, e.g. hellaswag,arc_easy:acc_norm (needs quantkit[eval]).", rich_help_panel=GATE),
    task_file: list[Path] = typer.Option([], "--task-file", help="A task YAML in lm-eval's format (dataset_path: json, local data_files); repeatable.", rich_help_panel=GATE),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Samples per task (all without it).", rich_help_panel=GATE),
    min_recovery: Optional[float] = typer.Option(None, "--min-recovery", min=0, help="Gate: artifact task score / base score at least this (default 0.95).", rich_help_panel=GATE),
    flip_prompts: int = typer.Option(0, "--flip-prompts", min=0, help="Greedy continuations of this many held-out prompts, base vs. artifact (the flips metric).", rich_help_panel=GATE),
    flip_tokens: int = typer.Option(16, "--flip-tokens", min=1, help="Tokens generated per prompt for flips.", rich_help_panel=GATE),
    max_flips: Optional[float] = typer.Option(None, "--max-flips", help="Gate: max share of greedy tokens after the first divergence (needs --flip-prompts).", rich_help_panel=GATE),
    llama_perplexity: bool = typer.Option(False, "--llama-perplexity", help="For a .gguf, also score the held-out text with llama.cpp's llama-perplexity (needs a llama.cpp build).", rich_help_panel=GATE),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the metrics as JSON to FILE ('-' = stdout).", rich_help_panel=REPORTS),
) -> None:
    """Perplexity, KL divergence and top-1 agreement of MODEL against its base.

    Examples:

      quantkit eval ./my-model-fp8 --against ./my-model

      quantkit eval ./gguf/model-Q4_K_M.gguf --against ./my-model --num-windows 32 --json metrics.json

      quantkit eval ./gguf --llama-perplexity     # cross-check with llama.cpp when it is built

      quantkit eval ./my-model-gptq --tasks hellaswag,arc_easy --task-file my_task.yaml --limit 200

    With any threshold given, exits 3 when the artifact fails it; with tasks, each task's score must
    recover --min-recovery of the base's (0.95 by default). Tasks run offline: data missing from this
    machine is exit 2 before any work.
    """
    from quantkit.cli.report import metrics_table, tasks_table, thresholds_table
    from quantkit.engines.transformers import check_device, device_map, load_tokenizer
    from quantkit.errors import GateFailedError, InputError, ModelError
    from quantkit.eval import evaluate, scorers
    from quantkit.eval.artifacts import artifact_kind
    from quantkit.io.checkpoint import check_model_dir, resolve_model
    from quantkit.run.pipeline import gate_with_task_files
    from quantkit.run.preflight import describe_placement, eval_placement
    from quantkit.run.recipe import cli_tasks
    from quantkit.units import parse_size

    if not model.exists():
        raise ModelError(f"artifact not found: {model}",
                         hint="give the output directory of quantkit quantize, or a .gguf file")
    kind = artifact_kind(model)
    if llama_perplexity and kind != "gguf":
        raise InputError("--llama-perplexity applies to .gguf artifacts only",
                         hint="drop --llama-perplexity, or give the .gguf file itself")
    if limit is not None and not (tasks or task_file):
        raise InputError("--limit bounds the samples of --tasks / --task-file", hint="add --tasks or --task-file")
    check_device(device)
    gate = cli_gate(dict(max_ppl_increase=max_ppl_increase, max_kld=max_kld, min_top1=min_top1,
                         max_ppl_delta=max_ppl_delta, max_flips=max_flips, flip_prompts=flip_prompts,
                         flip_tokens=flip_tokens, task_limit=limit,
                         tasks=cli_tasks(tasks, [str(f) for f in task_file], min_recovery)))
    gate = gate_with_task_files(gate)
    if gate.tasks:
        from quantkit.eval.tasks import check_tasks

        progress(f"tasks: {', '.join(check_tasks(gate.tasks))} (data found offline)")
    base = check_model_dir(resolve_model(against or default_base(model)))
    tokenizer = load_tokenizer(base, trust_remote_code)
    windows = eval_windows(tokenizer, data, num_windows, seq_len, seed)
    placement = eval_placement(base, kind, device_map(device), seq_len, len(windows),
                               parse_size(max_memory) if max_memory else None)
    progress(describe_placement(placement, base, seq_len).replace("gate:", "forwards:", 1))
    progress(f"baseline: {base.path} on {len(windows)} windows of {seq_len} tokens")
    baseline = evaluate.compute_baseline(scorers.base_scorer(base, device=device, trust_remote_code=trust_remote_code,
                                                             placement=placement, progress=progress), windows,
                                         spill=placement.spill)
    progress(f"candidate: {model} ({kind})")
    metrics = scorers.evaluate_artifact(model, base.path, windows, baseline, device, trust_remote_code,
                                        placement=placement, progress=progress)
    metrics.flips, task_rows = measure_extras(model, base, tokenizer, windows, gate, device, trust_remote_code,
                                              placement)
    verdict = evaluate.gate_verdict(metrics, gate)
    if task_rows:
        from quantkit.eval.tasks import task_checks

        verdict = evaluate.with_checks(verdict, task_checks(task_rows))
    llama_cpp = llama_cpp_check(model, tokenizer, windows) if llama_perplexity else None
    console = results_console(json_path)
    rows = [(model.name, metrics, verdict)]
    console.print(metrics_table(rows, f"{model} ({kind}) vs. {base.path}"))
    if task_rows:
        console.print(tasks_table([(model.name, task_rows)], f"task accuracy (lm-eval) vs. {base.path}"))
    if any(c.threshold is not None for c in verdict.checks):
        console.print(thresholds_table(rows))
    if llama_cpp:
        console.print(f"llama.cpp llama-perplexity on the same held-out text: PPL {llama_cpp['ppl']:.3f} "
                      f"± {llama_cpp['ppl_stderr']:.3f} ({llama_cpp['chunks']} chunks of {llama_cpp['context']} "
                      "tokens, llama.cpp's own tokenization)", highlight=False)
    write_json(json_path, {"name": model.name, "kind": kind, "base": str(base.path), "metrics": metrics.as_dict(),
                           "gate": verdict.as_dict(),
                           **({"tasks": [r.as_dict() for r in task_rows]} if task_rows else {}),
                           **({"llama_cpp": llama_cpp} if llama_cpp else {})})
    if not verdict.passed:
        raise GateFailedError(f"{model.name} fails the gate: {', '.join(verdict.failed)}",
                              hint="quantize again with --fallback, which raises the precision of the most damaging "
                                   "layers until the gate passes")


def cli_gate(values: dict):
    """The thresholds and measurements given as flags, validated as a recipe's gate is (exit 2)."""
    from pydantic import ValidationError

    from quantkit.errors import InputError
    from quantkit.run.recipe import Gate, format_errors

    try:
        return Gate(**{k: v for k, v in values.items() if v is not None})
    except ValidationError as exc:
        raise InputError(format_errors(exc), hint="quantkit eval --help lists each threshold and its range") from None


def measure_extras(model: Path, base, tokenizer, windows, gate, device: str, trust_remote_code: bool, placement):
    """(flips, task results) of the artifact against the base, when the flags ask for them: greedy
    continuations of held-out prompts (quantkit.eval.generate) and lm-eval tasks (quantkit.eval.tasks)."""
    from quantkit.eval import generate, scorers, tasks

    if not gate.flip_prompts and not gate.tasks:
        return None, []
    base_logits = scorers.base_logits(base, device=device, trust_remote_code=trust_remote_code, placement=placement)
    logits = scorers.artifact_logits(model, base.path, device, trust_remote_code, placement=placement)
    flips = None
    if gate.flip_prompts:
        progress(f"flips: greedy continuations of {gate.flip_prompts} held-out prompts, {gate.flip_tokens} tokens")
        base_flips = generate.base_flips(base_logits, windows, gate.flip_prompts, gate.flip_tokens)
        flips = generate.flips(logits, base_flips, gate.flip_prompts, gate.flip_tokens)
    if not gate.tasks:
        return flips, []
    length = tasks.max_context(base.config)
    progress(f"tasks: scoring the base and {model.name} on {len(gate.tasks)} task(s)"
             + (f", {gate.task_limit} samples each" if gate.task_limit else ""))
    base_scores = tasks.base_scores(base_logits, tokenizer, length, gate.tasks, gate.task_limit)
    return flips, tasks.score_tasks(logits, tokenizer, length, gate.tasks, gate.task_limit, base_scores)


def llama_cpp_check(model: Path, tokenizer, windows) -> dict:
    """llama.cpp's perplexity of the .gguf on the held-out windows' text."""
    from quantkit.eval.artifacts import gguf_file
    from quantkit.eval.llamacpp import perplexity

    text = "\n\n".join(tokenizer.decode(w, skip_special_tokens=True) for w in windows.tolist())
    return perplexity(gguf_file(model), text, context=windows.shape[1])


def default_base(artifact: Path) -> str:
    from quantkit.errors import InputError

    report = (artifact if artifact.is_dir() else artifact.parent) / "quantkit.json"
    if report.is_file():
        from quantkit.io.hub import recorded_base

        return recorded_base(json.loads(report.read_text())["model"])
    raise InputError(f"no base model for {artifact}", hint="pass --against BASE_DIR")


def eval_windows(tokenizer, source: str, num_windows: int, seq_len: int, seed: int):
    """The held-out windows quantize would use with the same source, seq_len and seed."""
    from quantkit.run.calibration import make_windows
    from quantkit.run.recipe import Calibration

    settings = Calibration(source=source, num_samples=0, seq_len=seq_len, seed=seed, eval_windows=num_windows)
    return make_windows(tokenizer, settings).eval
