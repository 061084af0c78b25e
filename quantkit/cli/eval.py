"""`quantkit eval`: measure any supported artifact against its base, with the gate's metrics."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from quantkit.cli.common import GATE, MEASURED, MODEL, handle_errors, lean_transformers, progress, results_console, write_json
from quantkit.cli.options import (
    AGAINST,
    DATA,
    DEVICE,
    MAX_MEMORY,
    NUM_WINDOWS,
    SEED,
    SEQ_LEN,
    TRUST_REMOTE_CODE,
    GateFlags,
    HeldOutFlags,
    json_flag,
    takes,
)


@dataclass(frozen=True)
class EvalWindows(HeldOutFlags):
    """The held-out windows eval scores: quantize's, given the same source, length and seed."""

    data: str = DATA.field(default="default")
    num_windows: int = NUM_WINDOWS.field(default=16)
    seq_len: int = SEQ_LEN.field(default=512, panel=MEASURED)
    seed: int = SEED.field(default=0, panel=MEASURED,
                           help="Sampling seed (the same as quantize's gives the same held-out windows).")


@dataclass(frozen=True)
class EvalRequest:
    """The command line of `quantkit eval`, validated (parse)."""

    artifact: Path
    kind: str
    against: str | None
    calibration: object  # quantkit.run.recipe.Calibration: the held-out windows
    gate: object  # quantkit.run.recipe.Gate, task files read
    device: str
    max_memory: int | None
    llama_perplexity: bool
    kv_cache: str | None = None
    kv_engine: str | None = None
    kv_context: int | None = None


@handle_errors
@lean_transformers
@takes(windows=EvalWindows, gate=GateFlags)
def eval_command(
    model: Path = typer.Argument(..., help="Artifact: a checkpoint dir (compressed-tensors, bitsandbytes, plain), an mlx-lm dir or a .gguf.", rich_help_panel=MODEL),
    against: Optional[str] = AGAINST.option(),
    *, windows: EvalWindows,
    device: str = DEVICE.option(default="cpu"),
    max_memory: Optional[str] = MAX_MEMORY.option(help="Bound the RAM the forwards may use, e.g. 16GiB: what does not fit under it streams a layer at a time (default: the models stay whole wherever they fit the memory available)."),
    trust_remote_code: bool = TRUST_REMOTE_CODE.option(help="Allow custom model code from the base and artifact dirs."),
    gate: GateFlags,
    llama_perplexity: bool = typer.Option(False, "--llama-perplexity", help="For a .gguf, also score the held-out text with llama.cpp's llama-perplexity (needs a llama.cpp build).", rich_help_panel=GATE),
    kv_cache: Optional[str] = typer.Option(None, "--kv-cache", help="Also measure KV-cache types: TYPE[,TYPE...] "
                                           "(vllm:fp8, vllm:turboquant_k3v4_nc, llama.cpp:q8_0/q4_0, mlx:4, ...), "
                                           "auto (the target engine's types measured smallest first; the first "
                                           "that passes is chosen) or all (every type measured). Per type: KV bytes per token, its own KLD / Δppl / top-1 over "
                                           "the same weights, and the total against the base.", rich_help_panel=GATE),
    kv_engine: Optional[str] = typer.Option(None, "--kv-engine", help="The engine --kv-cache auto targets: vllm, "
                                            "vllm-cpu, llama.cpp or mlx (default: the artifact's engine).",
                                            rich_help_panel=GATE),
    kv_context: Optional[int] = typer.Option(None, "--kv-context", min=8, help="Tokens per window of the KV-cache "
                                             "measurement (KV damage grows with context; default: --seq-len). The "
                                             "base is scored again on these windows, streamed a layer at a time.",
                                             rich_help_panel=GATE),
    json_path: Optional[str] = json_flag("the metrics").option(),
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
    from quantkit.errors import GateFailedError

    from dataclasses import replace

    request = replace(parse(model, against, windows, device, max_memory, gate, llama_perplexity),
                      kv_cache=kv_cache, kv_engine=kv_engine, kv_context=kv_context)
    if (kv_engine is not None or kv_context is not None) and kv_cache is None:
        from quantkit.errors import InputError

        raise InputError("--kv-engine and --kv-context apply to --kv-cache", hint="add --kv-cache auto")
    base, metrics, verdict, task_rows, llama_cpp, kv_rows = measure(request, trust_remote_code)
    show(request, base, metrics, verdict, task_rows, llama_cpp, json_path, kv_rows)
    if not verdict.passed:
        raise GateFailedError(f"{model.name} fails the gate: {', '.join(verdict.failed)}",
                              hint="quantize again with --fallback, which raises the precision of the most damaging "
                                   "layers until the gate passes")


def parse(model: Path, against: str | None, windows: EvalWindows, device: str, max_memory: str | None,
          flags: GateFlags, llama_perplexity: bool) -> EvalRequest:
    """The command line checked before any work (exit 2): the artifact, its flags, the gate, the tasks' data."""
    from quantkit.engines.transformers import check_device
    from quantkit.errors import InputError, ModelError
    from quantkit.formats import detect
    from quantkit.formats import gguf as gguf_format
    from quantkit.run.pipeline import gate_with_task_files
    from quantkit.run.recipe import Calibration
    from quantkit.units import parse_size

    if not model.exists():
        raise ModelError(f"artifact not found: {model}",
                         hint="give the output directory of quantkit quantize, or a .gguf file")
    kind = detect(model).kind
    if llama_perplexity and kind != gguf_format.FORMAT.kind:  # llama.cpp's own perplexity reads a .gguf
        raise InputError("--llama-perplexity applies to .gguf artifacts only",
                         hint="drop --llama-perplexity, or give the .gguf file itself")
    if flags.limit is not None and not (flags.tasks or flags.task_file):
        raise InputError("--limit bounds the samples of --tasks / --task-file", hint="add --tasks or --task-file")
    check_device(device)
    gate = gate_with_task_files(cli_gate(flags.gate_fields()))
    if gate.tasks:
        from quantkit.eval.tasks import check_tasks

        progress(f"tasks: {', '.join(check_tasks(gate.tasks))} (data found offline)")
    calibration = Calibration(source=windows.data, num_samples=0, seq_len=windows.seq_len, seed=windows.seed,
                              eval_windows=windows.num_windows)
    return EvalRequest(model, kind, against, calibration, gate, device, parse_size(max_memory) if max_memory else None,
                       llama_perplexity)


def measure(request: EvalRequest, trust_remote_code: bool) -> tuple:
    """(the base, the metrics, the verdict, task rows, llama.cpp's check) of the artifact on the windows."""
    from quantkit.engines.transformers import device_map, load_tokenizer
    from quantkit.eval import evaluate, scorers
    from quantkit.io.checkpoint import check_model_dir, resolve_model
    from quantkit.run.calibration import make_windows
    from quantkit.formats import gate as reading
    from quantkit.formats import get_format
    from quantkit.run.preflight import describe_placement, eval_placement

    r, seq_len = request, request.calibration.seq_len
    base = check_model_dir(resolve_model(r.against or default_base(r.artifact)))
    kv_kinds = kv_types(r, base)  # checked before any work
    tokenizer = load_tokenizer(base, trust_remote_code)
    windows = make_windows(tokenizer, r.calibration).eval
    reads = reading.artifact_reading(r.artifact, base.path, trust_remote_code) is not None
    placement = eval_placement(base, get_format(r.kind), device_map(r.device), seq_len, len(windows), r.max_memory,
                               reads)
    progress(describe_placement(placement, base, seq_len, len(windows)).replace("gate:", "forwards:", 1))
    progress(f"baseline: {base.path} on {len(windows)} windows of {seq_len} tokens"
             + (", scored beside the candidate" if placement.lockstep else ""))
    baseline = scorers.base_baseline(base, windows, device=r.device, trust_remote_code=trust_remote_code,
                                     placement=placement, progress=progress)
    progress(f"candidate: {r.artifact} ({r.kind})")
    longer_kv = bool(r.kv_context and r.kv_context != seq_len)
    keeper = evaluate.Keeper(evaluate.positions(windows)) if kv_kinds and not longer_kv else None
    alone = keeper is not None and reading.holds_artifact(r.gate) and not r.llama_perplexity
    held = reading.held_artifact(r.artifact, base.path, r.device, placement, trust_remote_code, progress) \
        if alone else None
    metrics = reading.evaluate_artifact(r.artifact, base.path, windows, baseline, r.device, trust_remote_code,
                                        placement=placement, progress=progress, keep=keeper, held=held)
    metrics.flips, task_rows = measure_extras(r.artifact, base, tokenizer, windows, r.gate, r.device,
                                              trust_remote_code, placement)
    verdict = evaluate.gate_verdict(metrics, r.gate)
    if task_rows:
        from quantkit.eval.tasks import task_checks

        verdict = evaluate.with_checks(verdict, task_checks(task_rows))
    llama_cpp = llama_cpp_check(r.artifact, tokenizer, windows) if r.llama_perplexity else None
    kv_rows = None
    if kv_kinds:
        from quantkit.eval.kv import stops_at_first_pass
        from quantkit.eval.kv.measure import measure_types
        from quantkit.formats.gate import opened_for_kv

        kv_windows, kv_baseline = windows, baseline
        if longer_kv:
            longer = r.calibration.model_copy(update={"seq_len": r.kv_context})
            kv_windows = make_windows(tokenizer, longer).eval
            progress(f"KV cache: the base on {len(kv_windows)} windows of {r.kv_context} tokens (streamed)")
            kv_baseline = scorers.base_baseline(base, kv_windows, device=r.device,
                                                trust_remote_code=trust_remote_code, progress=progress)
        artifact, model = (held.reading, None) if held else opened_for_kv(r.artifact, base.path, r.device,
                                                                           trust_remote_code)
        kv_rows = measure_types(artifact, model, kv_windows, kv_baseline, kv_kinds, kv_shape(base), r.gate, r.device,
                                progress, until_pass=stops_at_first_pass(r.kv_cache),
                                placement=placement if kv_windows is windows else None,
                                own=keeper.baseline if keeper else None, held=held)
    return base, metrics, verdict, task_rows, llama_cpp, kv_rows


def kv_shape(base):
    from quantkit.eval.kv import shape_of

    return shape_of(base.config)


def kv_types(request: EvalRequest, base) -> list:
    """The --kv-cache types for this artifact and model (exit 2 before work on a type the target lacks)."""
    if request.kv_cache is None:
        return []
    from quantkit.eval import kv
    from quantkit.formats import get_format

    return kv.for_artifact(request.kv_cache, kv_shape(base), get_format(request.kind).engines, request.kv_engine)


def show(request: EvalRequest, base, metrics, verdict, task_rows, llama_cpp, json_path: str | None,
         kv_rows=None) -> None:
    """The tables on stdout (stderr with --json -), and the JSON."""
    from quantkit.cli.report import metrics_table, tasks_table, thresholds_table

    model, kind = request.artifact, request.kind
    console = results_console(json_path)
    rows = [(model.name, metrics, verdict)]
    console.print(metrics_table(rows, f"{model} ({kind}) vs. {base.path}"))
    if task_rows:
        console.print(tasks_table([(model.name, task_rows)], f"task accuracy (lm-eval) vs. {base.path}"))
    if any(c.threshold is not None for c in verdict.checks):
        console.print(thresholds_table(rows))
    if kv_rows:
        from quantkit.cli.report import kv_table

        console.print(kv_table(kv_report(kv_rows, kv_shape(base)), f"KV cache of {model.name} (own: over the same "
                                                                   f"weights; total: vs. {base.path})"))
    if llama_cpp:
        console.print(f"llama.cpp llama-perplexity on the same held-out text: PPL {llama_cpp['ppl']:.3f} "
                      f"± {llama_cpp['ppl_stderr']:.3f} ({llama_cpp['chunks']} chunks of {llama_cpp['context']} "
                      "tokens, llama.cpp's own tokenization)", highlight=False)
    write_json(json_path, {"name": model.name, "kind": kind, "base": str(base.path), "metrics": metrics.as_dict(),
                           "gate": verdict.as_dict(),
                           **({"tasks": [r.as_dict() for r in task_rows]} if task_rows else {}),
                           **({"llama_cpp": llama_cpp} if llama_cpp else {}),
                           **({"kv_cache": kv_report(kv_rows, kv_shape(base))} if kv_rows else {})})


def kv_report(rows, shape) -> dict:
    """The report's KV-cache section: every type measured, and the smallest that passes."""
    from quantkit.eval.kv.measure import smallest_passing

    chosen = smallest_passing(rows)
    return {"types": [r.as_dict(shape) for r in rows], "chosen": chosen.kind.name if chosen else None,
            "serve_flags": list(chosen.kind.flag) if chosen else []}


def cli_gate(values: dict):
    """The thresholds and measurements given as flags, validated as a recipe's gate is (exit 2)."""
    from pydantic import ValidationError

    from quantkit.errors import InputError
    from quantkit.run.recipe import Gate, format_errors

    try:
        return Gate(**values)
    except ValidationError as exc:
        raise InputError(format_errors(exc), hint="quantkit eval --help lists each threshold and its range") from None


def measure_extras(model: Path, base, tokenizer, windows, gate, device: str, trust_remote_code: bool, placement):
    """(flips, task results) of the artifact against the base, when the flags ask for them: greedy
    continuations of held-out prompts (quantkit.eval.generate) and lm-eval tasks (quantkit.eval.tasks)."""
    from quantkit.eval import generate, scorers, tasks
    from quantkit.formats.gate import artifact_logits

    if not gate.flip_prompts and not gate.tasks:
        return None, []
    base_logits = scorers.base_logits(base, device=device, trust_remote_code=trust_remote_code, placement=placement)
    logits = artifact_logits(model, base.path, device, trust_remote_code, placement=placement)
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
    from quantkit.formats.gguf import gguf_file
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
