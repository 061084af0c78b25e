"""`quantkit serve-check`: load an artifact in the engine that serves it and measure it there."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

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
from quantkit.cli.options import (
    AGAINST,
    DATA,
    DEVICE,
    NUM_WINDOWS,
    SEED,
    SEQ_LEN,
    TRUST_REMOTE_CODE,
    HeldOutFlags,
    Lazy,
    engine_choices,
    flag,
    json_flag,
    takes,
)


@dataclass(frozen=True)
class ServeWindows(HeldOutFlags):
    """The held-out windows sent to the engine: the first of the artifact's gate (its quantkit.json)."""

    data: Optional[str] = DATA.field(help="Evaluation text without quantkit.json (default: the artifact's calibration source).")
    num_windows: int = NUM_WINDOWS.field(default=4, help="Held-out windows to send (the first of the gate's; engines are slow on CPU).")
    seq_len: Optional[int] = SEQ_LEN.field(panel=MEASURED, help="Tokens per window (default: the gate's; shorter windows are the gate's cut).")
    seed: Optional[int] = SEED.field(panel=MEASURED, help="Sampling seed without quantkit.json (default: the artifact's).")


@dataclass(frozen=True)
class GenerationFlags:
    """Greedy continuations and the load test (quantkit.serve.check.Generation)."""

    gen_prompts: int = flag(int, 4, panel=MEASURED, min=1, help="Held-out prompts continued greedily by the engine and by quantkit.").field()
    gen_tokens: int = flag(int, 16, panel=MEASURED, min=1, help="Tokens per greedy continuation.").field()
    load_tokens: int = flag(int, 32, panel=MEASURED, min=2, help="Tokens per streamed request of the load test.").field()
    concurrency: str = flag(str, "1,8", "--concurrency", panel=MEASURED, help="Load test rounds: concurrent requests per round, comma-separated.").field()
    rounds: tuple[int, ...] = field(init=False)  # --concurrency read

    def __post_init__(self) -> None:
        object.__setattr__(self, "rounds", concurrencies(self.concurrency))

    def generation(self):
        from quantkit.serve.check import Generation

        return Generation(self.gen_prompts, self.gen_tokens, self.load_tokens, self.rounds)


# quantkit.serve.check.Tolerances: the verdict's thresholds.
TOLERANCES = Lazy("quantkit.serve.check:Tolerances", {
    "max_reading_kld": flag(float, 0.02, panel=GATE, min=0, help="Verdict: max KL divergence (lower bound from top-k) of the engine from quantkit's reading of the artifact (or that reading's own KLD from the base, where larger)."),
    "max_ppl_drift": flag(float, 0.05, panel=GATE, min=0, help="Verdict: max |ppl engine / ppl quantkit's reading - 1|."),
    "min_reading_top1": flag(Optional[float], None, panel=GATE, min=0, max=1, help="Verdict: min top-1 agreement of the engine with quantkit's reading (not checked by default: near-ties flip under bfloat16)."),
    "max_base_kld": flag(Optional[float], None, panel=GATE, min=0, help="Verdict: max KL divergence (lower bound) of the engine from the base. Default: the gate's max KLD in quantkit.json."),
})


@dataclass(frozen=True)
class ServeRequest:
    """The command line of `quantkit serve-check`, checked before any server starts (parse)."""

    artifact: Path
    base: Path
    windows: object  # int64 (w, L): the held-out windows
    report: dict | None  # the artifact's quantkit.json
    tolerances: object  # quantkit.serve.check.Tolerances, max_base_kld resolved
    options: object  # quantkit.serve.settings.ServeOptions


@handle_errors
@lean_transformers
@takes(windows=ServeWindows, generation=GenerationFlags, tolerances=TOLERANCES)
def serve_check_command(
    artifact: Path = typer.Argument(..., help="Artifact: a compressed-tensors dir (vLLM), a .gguf or a dir with one (llama-server), an mlx-lm dir (mlx_lm.server).", rich_help_panel=MODEL),
    against: str | None = AGAINST.option(),
    engine: str = typer.Option("auto", "--engine", help=f"{engine_choices()} (auto: by the artifact's format).", rich_help_panel=MODEL),
    *, windows: ServeWindows,
    logprobs: int = typer.Option(20, min=0, help="Candidates per position asked of the engine (0: the whole vocabulary where the engine allows it; mlx_lm.server gives at most 11).", rich_help_panel=MEASURED),
    base_from: str = typer.Option("quantkit", "--base-from", help="quantkit: the base's full distributions scored by quantkit | engine: the base served by the same engine.", rich_help_panel=MODEL),
    kv_cache: str | None = typer.Option(None, "--kv-cache", metavar="TYPE", help="Start the engine with this KV-cache type (llama.cpp:q8_0, llama.cpp:q8_0/q4_0, vllm:fp8, ...: the types of quantize --kv-cache) and compare it with quantkit's reading through the same type; the engine is also compared with the reading with a 16-bit cache, so the report shows which cache it used.", rich_help_panel=MODEL),
    engine_base: Path | None = typer.Option(None, "--engine-base", help="With --base-from engine: what the engine serves as the base (default: the base dir; llama-server needs a .gguf).", rich_help_panel=MODEL),
    generation: GenerationFlags,
    tolerances,
    start_timeout: float = typer.Option(900.0, min=1, help="Seconds the server has to become ready.", rich_help_panel=RESOURCES),
    log_dir: Path | None = typer.Option(None, "--log-dir", help="Keep the servers' logs here (default: a temporary directory, removed).", rich_help_panel=RESOURCES),
    device: str = DEVICE.option(default="cpu", help="Where quantkit computes its own readings: cpu | cuda | auto."),
    trust_remote_code: bool = TRUST_REMOTE_CODE.option(help="Allow custom model code from the base and artifact dirs."),
    record: bool = typer.Option(True, "--record/--no-record", help="Write the result into the artifact's quantkit.json (serve_check), when it has one.", rich_help_panel=REPORTS),
    json_path: str | None = json_flag("the numbers").option(),
) -> None:
    """Serve ARTIFACT in its engine on 127.0.0.1 and check that it reads as the gate read it.

    Examples:

      quantkit serve-check ./my-model-fp8

      quantkit serve-check ./gguf/model-Q4_K_M.gguf --against ./my-model --json serve.json

      quantkit serve-check ./my-model-gptq --logprobs 0 --num-windows 8 --concurrency 1,4,16

      quantkit serve-check ./gguf/model-Q4_K_M.gguf --kv-cache llama.cpp:q8_0/q4_0

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
    from quantkit.errors import GateFailedError
    from quantkit.serve.check import failures, serve_check
    from quantkit.serve.record import record_result, report_path

    request = parse(artifact, against, engine, windows, generation, tolerances, logprobs, start_timeout, device,
                    trust_remote_code)
    result = serve_check(
        artifact, request.base, request.windows, engine, options=request.options, tolerances=request.tolerances,
        generation=generation.generation(), base_from=base_from, engine_base=engine_base, log_dir=log_dir,
        device=device, trust_remote_code=trust_remote_code, progress=ProgressLog(err), kv_cache=kv_cache,
        gated_kld=gated_metric(request.report, artifact, "kld_mean"))
    show(result, json_path)
    if record and request.report is not None:
        record_result(report_path(artifact), result.as_dict())
        progress(f"recorded serve_check.{result.engine['name']} in {report_path(artifact)}")
    if not result.passed:
        raise GateFailedError(f"{artifact.name} served by {result.engine['name']} does not read as the gate read "
                              f"it: {failures(result)}",
                              hint="write the artifact again with quantkit quantize (a file edited after the gate "
                                   "reads differently); --log-dir DIR keeps the engine's log")


def parse(artifact: Path, against: str | None, engine: str, windows: ServeWindows, generation: GenerationFlags,
          tolerances, logprobs: int, start_timeout: float, device: str, trust_remote_code: bool) -> ServeRequest:
    """The command line checked before any server starts (exit 2): the artifact, the engine (installed, and
    able to serve this format here), the base and the held-out windows."""
    from dataclasses import replace

    from quantkit.engines.transformers import check_device
    from quantkit.errors import InputError, ModelError
    from quantkit.io.checkpoint import check_model_dir, resolve_model
    from quantkit.serve.check import prepare
    from quantkit.serve.record import report_path
    from quantkit.serve.settings import ServeOptions

    if not artifact.exists():
        raise ModelError(f"artifact not found: {artifact}",
                         hint="give the output directory of quantkit quantize, or a .gguf file")
    check_device(device)
    kind, found, accelerator = prepare(artifact, engine)  # exit 2 now when the engine is missing or refuses
    progress(f"{artifact} ({kind}) in {found.name}: {found.executable} on {accelerator.describe()}")
    report = read_report(report_path(artifact))
    if against is None and report is None:
        raise InputError(f"no base model for {artifact} (it has no quantkit.json)", hint="pass --against BASE_DIR")
    base = check_model_dir(resolve_model(against or base_path(artifact, report)))
    held_out = held_out_windows(base, report, windows, trust_remote_code)
    if tolerances.max_base_kld is None:
        tolerances = replace(tolerances, max_base_kld=gate_threshold(report, artifact, "kld_mean"))
    progress(f"{held_out.shape[0]} held-out windows of {held_out.shape[1]} tokens; base {base.path}")
    options = ServeOptions(logprobs=logprobs, concurrency=max(generation.rounds), start_timeout=start_timeout)
    return ServeRequest(artifact, base.path, held_out, report, tolerances, options)


def show(result, json_path: str | None) -> None:
    """The engine's reading, the load test and the verdict; the JSON."""
    from quantkit.cli.report import load_table, serve_checks_table, serve_table

    console = results_console(json_path)
    console.print(serve_table(result))
    console.print(load_table(result.load))
    console.print(serve_checks_table(result))
    write_json(json_path, result.as_dict())


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


def gated_metric(report: dict | None, artifact: Path, metric: str) -> float | None:
    """The gate's measured value of a metric for this artifact (None when quantkit.json has none)."""
    return (report_target(report, artifact).get("metrics") or {}).get(metric)


def held_out_windows(base, report: dict | None, windows: ServeWindows, trust_remote_code: bool):
    """The first `num_windows` held-out windows of the artifact's calibration (quantkit.json), cut to
    `seq_len` tokens; without quantkit.json, those of --data / --seed at --seq-len (default 512)."""
    from quantkit.engines.transformers import load_tokenizer
    from quantkit.run.calibration import make_windows
    from quantkit.run.recipe import Calibration

    stored = dict((report or {}).get("calibration") or {})
    settings = {k: stored[k] for k in ("source", "seq_len", "seed", "chat_template", "text_field") if k in stored}
    settings.update({k: v for k, v in (("source", windows.data), ("seed", windows.seed)) if v is not None})
    settings.setdefault("seq_len", windows.seq_len or 512)
    count = min(windows.num_windows, stored.get("eval_windows") or windows.num_windows)
    if count < windows.num_windows:
        progress(f"the artifact's gate held out {count} windows; using those")
    calibration = Calibration(**settings, num_samples=0, eval_windows=count)
    held_out = make_windows(load_tokenizer(base, trust_remote_code), calibration).eval
    return held_out[:, :windows.seq_len] if windows.seq_len else held_out
