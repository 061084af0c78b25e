"""`quantkit serve-check`: load an artifact in the engine that serves it and measure it there."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from quantkit.cli.common import (
    GATE,
    MEASURED,
    MODEL,
    REPORTS,
    RESOURCES,
    ProgressLog,
    err,
    handle_errors,
    lean_transformers,
    progress,
    results_console,
    write_json,
)


@handle_errors
@lean_transformers
def serve_check_command(
    artifact: Path = typer.Argument(..., help="Artifact: a compressed-tensors dir (vLLM), a .gguf or a dir with one (llama-server), an mlx-lm dir (mlx_lm.server).", rich_help_panel=MODEL),
    against: str | None = typer.Option(None, "--against", "-a", help="Base checkpoint. Default: the base named in the artifact's quantkit.json.", rich_help_panel=MODEL),
    engine: str = typer.Option("auto", "--engine", help="auto | vllm | llama.cpp | mlx (auto: by the artifact's format).", rich_help_panel=MODEL),
    num_windows: int = typer.Option(4, min=1, help="Held-out windows to send (the first of the gate's; engines are slow on CPU).", rich_help_panel=MEASURED),
    seq_len: int | None = typer.Option(None, min=8, help="Tokens per window (default: the gate's; shorter windows are the gate's cut).", rich_help_panel=MEASURED),
    data: str | None = typer.Option(None, "--data", help="Evaluation text without quantkit.json (default: the artifact's calibration source).", rich_help_panel=MEASURED),
    seed: int | None = typer.Option(None, help="Sampling seed without quantkit.json (default: the artifact's).", rich_help_panel=MEASURED),
    logprobs: int = typer.Option(20, min=0, help="Candidates per position asked of the engine (0: the whole vocabulary where the engine allows it; mlx_lm.server gives at most 11).", rich_help_panel=MEASURED),
    base_from: str = typer.Option("quantkit", "--base-from", help="quantkit: the base's full distributions scored by quantkit | engine: the base served by the same engine.", rich_help_panel=MODEL),
    engine_base: Path | None = typer.Option(None, "--engine-base", help="With --base-from engine: what the engine serves as the base (default: the base dir; llama-server needs a .gguf).", rich_help_panel=MODEL),
    gen_prompts: int = typer.Option(4, min=1, help="Held-out prompts continued greedily by the engine and by quantkit.", rich_help_panel=MEASURED),
    gen_tokens: int = typer.Option(16, min=1, help="Tokens per greedy continuation.", rich_help_panel=MEASURED),
    load_tokens: int = typer.Option(32, min=2, help="Tokens per streamed request of the load test.", rich_help_panel=MEASURED),
    concurrency: str = typer.Option("1,8", "--concurrency", help="Load test rounds: concurrent requests per round, comma-separated.", rich_help_panel=MEASURED),
    max_reading_kld: float = typer.Option(0.02, min=0, help="Verdict: max KL divergence (lower bound from top-k) of the engine from quantkit's reading of the artifact.", rich_help_panel=GATE),
    max_ppl_drift: float = typer.Option(0.05, min=0, help="Verdict: max |ppl engine / ppl quantkit's reading - 1|.", rich_help_panel=GATE),
    min_reading_top1: float | None = typer.Option(None, min=0, max=1, help="Verdict: min top-1 agreement of the engine with quantkit's reading (not checked by default: near-ties flip under bfloat16).", rich_help_panel=GATE),
    max_base_kld: float | None = typer.Option(None, min=0, help="Verdict: max KL divergence (lower bound) of the engine from the base. Default: the gate's max KLD in quantkit.json.", rich_help_panel=GATE),
    start_timeout: float = typer.Option(900.0, min=1, help="Seconds the server has to become ready.", rich_help_panel=RESOURCES),
    log_dir: Path | None = typer.Option(None, "--log-dir", help="Keep the servers' logs here (default: a temporary directory, removed).", rich_help_panel=RESOURCES),
    device: str = typer.Option("cpu", help="Where quantkit computes its own readings: cpu | cuda | auto.", rich_help_panel=RESOURCES),
    trust_remote_code: bool = typer.Option(False, help="Allow custom model code from the base and artifact dirs.", rich_help_panel=MODEL),
    record: bool = typer.Option(True, "--record/--no-record", help="Write the result into the artifact's quantkit.json (serve_check), when it has one.", rich_help_panel=REPORTS),
    json_path: str | None = typer.Option(None, "--json", help="Write the numbers as JSON to FILE ('-' = stdout).", rich_help_panel=REPORTS),
) -> None:
    """Serve ARTIFACT in its engine on 127.0.0.1 and check that it reads as the gate read it.

    Examples:

      quantkit serve-check ./my-model-fp8

      quantkit serve-check ./gguf/model-Q4_K_M.gguf --against ./my-model --json serve.json

      quantkit serve-check ./my-model-gptq --logprobs 0 --num-windows 8 --concurrency 1,4,16

    The engine (vLLM, llama.cpp's llama-server, mlx-lm's server; installed by scripts/setup_engines.sh)
    runs as a real server, always stopped on exit. On the gate's held-out windows it is asked for the
    top-k log-probs of every position; from those alone: the KL divergence from the base and from
    quantkit's own reading of the artifact (lower bounds: the candidates plus one cell for the rest;
    the tail mass says how tight), top-1 agreement, perplexity. Also greedy continuations (engine vs
    quantkit, reported) and a short load test (time to first token, prefill and decode tokens/s at each
    concurrency, reported).

    Verdict, exit 0 when all hold: engine vs quantkit's reading KLD <= --max-reading-kld (0.02) and
    |ppl ratio - 1| <= --max-ppl-drift (0.05); engine vs base KLD <= --max-base-kld (default: the
    gate's max KLD from quantkit.json); top-1 >= --min-reading-top1 when given. Measured on small
    Llama models: correct artifacts 0.0004-0.0023 KLD from quantkit's reading and < 1% ppl drift
    (vLLM CPU bf16, llama-server, mlx_lm.server), a config edited after the gate 0.19 or more. Exit 3
    when one fails (both readings printed), exit 2 when the engine is missing or cannot serve this
    format on this device.
    """
    from quantkit.cli.report import load_table, serve_checks_table, serve_table
    from quantkit.engines.transformers import check_device
    from quantkit.errors import GateFailedError, InputError, ModelError
    from quantkit.io.checkpoint import check_model_dir, resolve_model
    from quantkit.serve.check import Generation, Tolerances, prepare, serve_check
    from quantkit.serve.record import record_result, report_path
    from quantkit.serve.settings import ServeOptions

    if not artifact.exists():
        raise ModelError(f"artifact not found: {artifact}",
                         hint="give the output directory of quantkit quantize, or a .gguf file")
    check_device(device)
    rounds = concurrencies(concurrency)
    kind, found, accelerator = prepare(artifact, engine)  # exit 2 now when the engine is missing or refuses
    progress(f"{artifact} ({kind}) in {found.name}: {found.executable} on {accelerator.describe()}")
    report = read_report(report_path(artifact))
    if against is None and report is None:
        raise InputError(f"no base model for {artifact} (it has no quantkit.json)", hint="pass --against BASE_DIR")
    base = check_model_dir(resolve_model(against or base_path(artifact, report)))
    windows = held_out_windows(base, report, num_windows, seq_len, data, seed, trust_remote_code)
    gate_kld = max_base_kld if max_base_kld is not None else gate_threshold(report, artifact, "kld_mean")
    progress(f"{windows.shape[0]} held-out windows of {windows.shape[1]} tokens; base {base.path}")
    result = serve_check(
        artifact, base.path, windows, engine,
        options=ServeOptions(logprobs=logprobs, concurrency=max(rounds), start_timeout=start_timeout),
        tolerances=Tolerances(max_reading_kld, max_ppl_drift, min_reading_top1, gate_kld),
        generation=Generation(gen_prompts, gen_tokens, load_tokens, rounds),
        base_from=base_from, engine_base=engine_base, log_dir=log_dir, device=device,
        trust_remote_code=trust_remote_code, progress=ProgressLog(err))
    data_out = result.as_dict()
    console = results_console(json_path)
    console.print(serve_table(result))
    console.print(load_table(result.load))
    console.print(serve_checks_table(result))
    write_json(json_path, data_out)
    if record and report is not None:
        record_result(report_path(artifact), data_out)
        progress(f"recorded serve_check.{result.engine['name']} in {report_path(artifact)}")
    if not result.passed:
        failed = "; ".join(f"{c.name} {c.value:.4g} (needs {c.op} {c.threshold:g})" for c in result.checks
                           if not c.passed)
        raise GateFailedError(f"{artifact.name} served by {result.engine['name']} does not read as the gate read "
                              f"it: {failed}",
                              hint="write the artifact again with quantkit quantize (a file edited after the gate "
                                   "reads differently); --log-dir DIR keeps the engine's log")


def concurrencies(text: str) -> tuple[int, ...]:
    """'1,8' -> (1, 8); exit 2 on anything but positive integers."""
    from quantkit.errors import InputError

    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise InputError(f"--concurrency takes positive integers separated by commas, not '{text}'",
                         hint="e.g. --concurrency 1,8")
    return values


def read_report(path: Path) -> dict | None:
    """The artifact's quantkit.json, None without one."""
    from quantkit.errors import ModelError

    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path} is not valid JSON: {exc}",
                         hint="the artifact's quantkit.json is damaged: write the artifact again, or pass --against "
                              "BASE and --data TEXT") from None


def base_path(artifact: Path, report: dict) -> str:
    """The base named in quantkit.json: as written, else relative to the artifact's directory, else its Hub id."""
    from quantkit.io.hub import recorded_base

    named = Path(recorded_base(report["model"]))
    beside = (artifact if artifact.is_dir() else artifact.parent).parent / named
    return str(named if named.is_absolute() or named.exists() or not beside.exists() else beside)


def report_target(report: dict | None, artifact: Path) -> dict:
    """The target of quantkit.json this artifact is: the one named like it, else the only one."""
    targets = (report or {}).get("targets") or []
    names = (artifact.name, artifact.stem, artifact.parent.name if artifact.is_file() else artifact.name)
    named = [t for t in targets if t.get("name") in names]
    return named[0] if named else targets[0] if len(targets) == 1 else {}


def gate_threshold(report: dict | None, artifact: Path, metric: str) -> float | None:
    """The gate's threshold of a metric for this artifact (None when quantkit.json has none)."""
    checks = (report_target(report, artifact).get("gate") or {}).get("checks") or []
    return next((c.get("threshold") for c in checks if c.get("name") == metric), None)


def held_out_windows(base, report: dict | None, num_windows: int, seq_len: int | None, data: str | None,
                     seed: int | None, trust_remote_code: bool):
    """The first `num_windows` held-out windows of the artifact's calibration (quantkit.json), cut to
    `seq_len` tokens; without quantkit.json, those of --data / --seed at --seq-len (default 512)."""
    from quantkit.engines.transformers import load_tokenizer
    from quantkit.run.calibration import make_windows
    from quantkit.run.recipe import Calibration

    stored = dict((report or {}).get("calibration") or {})
    settings = {k: stored[k] for k in ("source", "seq_len", "seed", "chat_template", "text_field") if k in stored}
    settings.update({k: v for k, v in (("source", data), ("seed", seed)) if v is not None})
    settings.setdefault("seq_len", seq_len or 512)
    count = min(num_windows, stored.get("eval_windows") or num_windows)
    if count < num_windows:
        progress(f"the artifact's gate held out {count} windows; using those")
    calibration = Calibration(**settings, num_samples=0, eval_windows=count)
    windows = make_windows(load_tokenizer(base, trust_remote_code), calibration).eval
    return windows[:, :seq_len] if seq_len else windows
