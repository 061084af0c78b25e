#!/usr/bin/env python
"""Every quantkit format served by the engine that serves it, measured against quantkit's own reading.

    export QUANTKIT_ENGINES=~/.cache/quantkit/engines    # where scripts/setup_engines.sh installed them
    python scripts/bench_serve.py [--model DIR] [--work DIR] [--formats fp8,gguf-Q4_K_M,...]
                                  [--num-samples 32] [--seq-len 128] [--eval-windows 4] [--num-windows 4]
                                  [--logprobs 20] [--load-tokens 32] [--concurrency 1,8] [--json out.json]

For each format: `quantkit quantize MODEL --no-gate` (the gate measured and recorded in quantkit.json, not
enforced), then `quantkit serve-check` on the artifact in its engine (vLLM's CPU build, llama.cpp's
llama-server, mlx_lm.server; each a real server on 127.0.0.1, stopped when the command ends). One table:
the gate's KL divergence from the base (quantkit's reading, quantkit.json), the engine's KL divergence
from the base and from quantkit's reading (lower bounds from its top-k log-probs, k in the header), the
engine's top-1 agreement with the base, perplexity as the gate read it and as the engine read it, greedy
agreement, the load test (time to first token and prefill / decode tokens per second at each
concurrency), and serve-check's verdict, or the reason the engine refused the format on this device
(serve-check exit 2). The gate's windows are the ones serve-check sends when --eval-windows equals
--num-windows (the default): both columns measure the same positions.

The model: --model DIR, default the width-576 reference model, trained once into WORK/smol576
(`python scripts/train_reference_model.py WORK/smol576 --preset smol576`: about 10 minutes on a 2-core
x86-64 CPU). Artifacts, serve-check JSON and server logs stay under WORK (default
~/.cache/quantkit/bench-serve); a format whose artifact is already there with the same inputs is not
quantized again (quantize --skip-existing), --fresh quantizes everything again.

Defaults are sized for a 2-core CPU: the whole run (after the model exists) takes about 40 minutes there,
most of it vLLM starting (about a minute per server) and AutoRound tuning. After each serve-check, and
when the script ends, no process naming an artifact under WORK/artifacts may be left: one that is (a
server that outlived its command) is stopped, listed in the row and makes the exit code 1. Other
processes (another user of the model, which may live under WORK) are left alone.

Exit code: 0 when every format either served as gated, or was refused by its engine before serving, or
was refused by quantkit for this model (fp8-block on widths that 128 does not divide); the table says
why. 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORK = Path("~/.cache/quantkit/bench-serve")
REFERENCE = "smol576"


@dataclass(frozen=True)
class Format:
    """One artifact: its name in the table, the quantize flags that write it, the engine that serves it."""

    name: str
    flags: tuple[str, ...]
    engine: str


def gguf(kind: str) -> Format:
    return Format(f"gguf-{kind}", ("--method", "gguf", "--gguf-type", kind), "llama.cpp")


FORMATS = (
    Format("fp8", ("--method", "fp8"), "vllm"),
    Format("fp8-kv", ("--method", "fp8", "--kv-cache", "fp8"), "vllm"),
    Format("fp8-static", ("--method", "fp8", "--scheme", "fp8-static"), "vllm"),
    Format("fp8-block", ("--method", "fp8", "--scheme", "fp8-block"), "vllm"),
    Format("gptq", ("--method", "gptq"), "vllm"),
    Format("gptq-sym", ("--method", "gptq", "--symmetric"), "vllm"),
    Format("gptq-w8", ("--method", "gptq", "--bits", "8"), "vllm"),
    Format("awq", ("--method", "awq"), "vllm"),
    Format("autoround-light", ("--method", "autoround", "--preset", "light"), "vllm"),
    Format("w4a8-int8", ("--method", "gptq", "--symmetric", "--activations", "int8"), "vllm"),
    Format("gptq-hadamard", ("--method", "gptq", "--rotate", "hadamard"), "vllm"),
    Format("fp8-spinquant", ("--method", "fp8", "--rotate", "spinquant"), "vllm"),
    Format("smoothquant", ("--method", "smoothquant"), "vllm"),
    Format("nvfp4", ("--method", "nvfp4"), "vllm"),
    Format("nvfp4-a16", ("--method", "nvfp4", "--scheme", "a16"), "vllm"),
    Format("mxfp4", ("--method", "mxfp4"), "vllm"),
    Format("nf4", ("--method", "nf4"), "vllm"),
    gguf("Q8_0"), gguf("Q6_K"), gguf("Q4_K_M"), gguf("IQ4_XS"),
    Format("mlx-4bit", ("--method", "mlx", "--bits", "4"), "mlx"),
    Format("mlx-8bit", ("--method", "mlx", "--bits", "8"), "mlx"),
)
FORMAT_NAMES = tuple(f.name for f in FORMATS)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None,
                        help=f"base checkpoint (default: WORK/{REFERENCE}, trained once if absent)")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="artifacts, JSON and logs (default: %(default)s)")
    parser.add_argument("--formats", default=",".join(FORMAT_NAMES), help="comma-separated, of: %(default)s")
    parser.add_argument("--num-samples", type=int, default=32, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per window")
    parser.add_argument("--eval-windows", type=int, default=4, help="the gate's held-out windows")
    parser.add_argument("--num-windows", type=int, default=4, help="held-out windows serve-check sends (the gate's first)")
    parser.add_argument("--logprobs", type=int, default=20, help="candidates per position asked of the engine (0: all)")
    parser.add_argument("--gen-prompts", type=int, default=4, help="held-out prompts continued greedily")
    parser.add_argument("--load-tokens", type=int, default=32, help="tokens per streamed request of the load test")
    parser.add_argument("--concurrency", default="1,8", help="load test rounds (default: %(default)s)")
    parser.add_argument("--fresh", action="store_true", help="quantize every format again (--overwrite)")
    parser.add_argument("--probe-refused", action="store_true",
                        help="start the engine anyway on each format serve-check refuses, and record its own error")
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON to FILE")
    parser.add_argument("--render", type=Path, default=None,
                        help="print the table of an earlier run's --json FILE and exit (runs nothing)")
    parser.add_argument("--records", type=Path, default=None,
                        help="print an earlier run's --json FILE as quantkit/serve/measured.py's records and exit")
    args = parser.parse_args(argv)
    unknown = sorted(set(names(args.formats)) - set(FORMAT_NAMES))
    if unknown:
        parser.error(f"unknown formats {unknown}; choose from {', '.join(FORMAT_NAMES)}")
    return args


def names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def log(message: str) -> None:
    print(f"· {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- processes


def quantkit_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "quantkit", *args]


def child_env() -> dict:
    """This checkout's quantkit first, whatever is installed."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def run(command: list[str], log_path: Path) -> tuple[int, float, str]:
    """(exit code, wall seconds, stderr) of a command in its own session, its stderr kept in `log_path`.
    The whole session is stopped if this script is interrupted while it runs."""
    started = time.time()
    with open(log_path, "w") as err:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=child_env(),
                                start_new_session=True)
        try:
            code = proc.wait()
        except BaseException:
            stop_group(proc)
            raise
    return code, time.time() - started, log_path.read_text(errors="replace")


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the child's process group (quantkit stops its server on it), SIGKILL after 60 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def live_processes_naming(needle: str) -> dict[int, str]:
    """pid -> command line of live (not zombie) processes other than this one whose command line holds `needle`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if needle in cmdline and state != "Z":
            found[int(entry.name)] = cmdline.strip()
    return found


def stop_leftovers(needle: str) -> list[str]:
    """Stop every process still naming `needle` (SIGTERM, then SIGKILL after 10 s); their command lines."""
    left = live_processes_naming(needle)
    for pid in left:
        signal_quietly(pid, signal.SIGTERM)
    deadline = time.time() + 10
    while time.time() < deadline and any(pid in live_processes_naming(needle) for pid in left):
        time.sleep(0.5)
    for pid in live_processes_naming(needle):
        signal_quietly(pid, signal.SIGKILL)
    return list(left.values())


def signal_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------- one format


def reference_model(work: Path) -> Path:
    """WORK/smol576, trained once (scripts/train_reference_model.py)."""
    model = work / REFERENCE
    if (model / "config.json").is_file():
        return model
    log(f"training the reference model into {model} (about 10 minutes on 2 cores)")
    command = [sys.executable, str(REPO / "scripts" / "train_reference_model.py"), str(model), "--preset", REFERENCE]
    code, _seconds, stderr = run(command, work / f"{REFERENCE}.train.log")
    if code != 0:
        raise SystemExit(f"training the reference model failed (exit {code}): {stderr[-2000:]}")
    return model


def quantize_args(fmt: Format, model: Path, out: Path, args: argparse.Namespace) -> list[str]:
    reuse = "--overwrite" if args.fresh else "--skip-existing"
    return ["quantize", str(model), "-o", str(out), *fmt.flags, "--num-samples", str(args.num_samples),
            "--seq-len", str(args.seq_len), "--eval-windows", str(args.eval_windows), "--no-gate", reuse]


def serve_args(fmt: Format, artifact: Path, out: Path, logs: Path, args: argparse.Namespace) -> list[str]:
    return ["serve-check", str(artifact), "--engine", fmt.engine, "--json", str(out), "--log-dir", str(logs),
            "--num-windows", str(args.num_windows), "--logprobs", str(args.logprobs),
            "--gen-prompts", str(args.gen_prompts), "--load-tokens", str(args.load_tokens),
            "--concurrency", args.concurrency]


def error_line(stderr: str) -> str:
    """The CLI's `error: ...` line without its prefix (else the last line)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line[len("error: "):] for line in lines if line.startswith("error: ")]
    return errors[-1] if errors else (lines[-1] if lines else "")


def gate_numbers(report: dict) -> dict:
    """The gate's reading (quantkit.json's first target's metrics)."""
    metrics = (report.get("targets") or [{}])[0].get("metrics") or {}
    keep = ("kld_mean", "kld_p99", "top1", "ppl", "ppl_base", "ppl_increase", "positions")
    return {name: metrics.get(name) for name in keep}


def load_numbers(load: list[dict]) -> dict[str, dict]:
    """Load test rounds by concurrency."""
    keep = ("ttft_s", "prefill_tok_s", "decode_tok_s", "throughput_tok_s", "prompt_tokens", "tokens")
    return {str(r["concurrency"]): {name: r[name] for name in keep} for r in load}


def serve_numbers(data: dict) -> dict:
    """What the table shows of a serve-check result (its --json)."""
    return {"engine_version": data["engine"]["version"], "device": data["engine"]["device"],
            "logprobs": data["logprobs"], "logprobs_normalized": data["logprobs_normalized"],
            "positions": data["windows"]["scored"],
            "kld_vs_base": data["vs_base"]["kld_lower_bound"], "tail_mass": data["vs_base"]["tail_mass"],
            "top1_vs_base": data["vs_base"]["top1"], "kld_vs_reading": data["vs_reading"]["kld_lower_bound"],
            "top1_vs_reading": data["vs_reading"]["top1"], "reading_vs_base_kld": data["reading_vs_base_kld"],
            "ppl": data["ppl"]["ppl"], "ppl_exact": data["ppl"]["ppl_exact"], "ppl_reading": data["ppl_reading"],
            "ppl_base": data["ppl_base"], "greedy_identical": data["greedy"]["identical_share"],
            "load": load_numbers(data["load"]), "failed": data["failed"],
            "checks": {c["name"]: c["value"] for c in data["checks"]}}


def verdict(code: int, data: dict | None, stderr: str) -> str:
    """serve-check's outcome in words: passes, fails: <checks>, refused: <reason>, error: <message>."""
    if code == 0:
        return "passes"
    if code == 3 and data:
        return "fails: " + ", ".join(data["failed"])
    if code == 2:
        return "refused: " + error_line(stderr)
    return f"error (exit {code}): " + error_line(stderr)


def bench_format(fmt: Format, model: Path, args: argparse.Namespace) -> dict:
    """Quantize, serve-check, and the row of both readings."""
    work = args.work
    artifact, logs = work / "artifacts" / fmt.name, work / "logs"
    for folder in (artifact.parent, logs):
        folder.mkdir(parents=True, exist_ok=True)
    q_args = quantize_args(fmt, model, artifact, args)
    log(f"{fmt.name}: quantkit {' '.join(q_args)}")
    q_code, q_seconds, q_err = run(quantkit_command(*q_args), logs / f"{fmt.name}.quantize.log")
    row = {"format": fmt.name, "engine": fmt.engine, "flags": list(fmt.flags), "artifact": str(artifact),
           "quantize_command": "quantkit " + " ".join(q_args), "quantize_exit": q_code, "quantize_s": round(q_seconds, 1)}
    if q_code != 0:
        said = "quantkit refused" if q_code == 2 else "quantize failed"
        log(f"{fmt.name}: {said} (exit {q_code})")
        return {**row, "verdict": f"{said} (exit {q_code}): {error_line(q_err)}", "leftover_processes": []}
    row["gate"] = gate_numbers(json.loads((artifact / "quantkit.json").read_text()))
    serve_json = work / f"{fmt.name}.serve.json"
    serve_json.unlink(missing_ok=True)
    s_args = serve_args(fmt, artifact, serve_json, logs, args)
    log(f"{fmt.name}: quantkit {' '.join(s_args)}")
    s_code, s_seconds, s_err = run(quantkit_command(*s_args), logs / f"{fmt.name}.serve-check.log")
    data = json.loads(serve_json.read_text()) if serve_json.is_file() else None
    row.update({"serve_command": "quantkit " + " ".join(s_args), "serve_exit": s_code, "serve_s": round(s_seconds, 1),
                "serve": serve_numbers(data) if data else None, "verdict": verdict(s_code, data, s_err)})
    if s_code == 2 and args.probe_refused:
        log(f"{fmt.name}: refused by serve-check; starting {fmt.engine} on it anyway")
        row["engine_says"] = probe(fmt, artifact, logs)
    row["leftover_processes"] = stop_leftovers(str(artifact.resolve()))
    log(f"{fmt.name}: {row['verdict']} ({q_seconds:.0f} s quantize, {s_seconds:.0f} s serve-check)")
    return row


def probe(fmt: Format, artifact: Path, logs: Path) -> str:
    """Start the engine on an artifact serve-check refused (its rule bypassed) and ask for the log-probs of
    one prompt: "serves", or the engine's own error (the server's log, quantkit.serve.process)."""
    from quantkit.errors import QuantkitError
    from quantkit.formats import detect
    from quantkit.serve.check import engine_failures, pick_engine, served_path, serving
    from quantkit.serve.engines import get_engine
    from quantkit.serve.settings import Endpoint, ServeOptions
    from quantkit.serve.support import accelerator

    kind = detect(artifact).kind
    engine = pick_engine(kind, fmt.engine)
    options = ServeOptions(max_model_len=128, logprobs=5, concurrency=1, device=accelerator().kind,
                           start_timeout=600)
    prompt = list(range(1, 33))
    try:
        with serving(engine, served_path(artifact, kind), options, logs, log) as (server_log, url, _command), \
                engine_failures(engine, server_log):
            get_engine(engine.name).prompt_topk(Endpoint(url, None, 0), [prompt], options.logprobs, log)
    except QuantkitError as exc:
        return exc.message
    return "serves"


def row_ok(row: dict) -> bool:
    """Served as gated, or refused by its engine before serving, or refused by quantkit for this model (a
    format whose blocks cannot tile its widths); no server left behind."""
    refused = row["verdict"].startswith(("refused: ", "quantkit refused"))
    return (row["verdict"] == "passes" or refused) and not row.get("leftover_processes")


# ---------------------------------------------------------------- the table


def number(value, digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}g}"


def load_cell(serve: dict, concurrency: str) -> str:
    """'TTFT s · prefill/decode tok/s' of one load round."""
    r = serve["load"].get(concurrency)
    if not r:
        return "–"
    return f"{r['ttft_s']:.3f} · {r['prefill_tok_s']:.0f}/{r['decode_tok_s']:.0f}"


def ppl_cell(gate: dict, serve: dict) -> str:
    bound = "" if serve["ppl_exact"] else " (≥)"
    return f"{gate['ppl']:.2f} / {serve['ppl']:.2f}{bound}"


def table_header(concurrencies: list[str], logprobs: int) -> list[str]:
    k = "all" if logprobs == 0 else str(logprobs)
    return ["format", "engine", "gate KLD", f"engine KLD vs base (≥, k={k})", "engine vs quantkit KLD (≥)",
            "top-1 engine vs base", "ppl gate / engine", "greedy agreement",
            *(f"c={c}: TTFT s · prefill/decode tok/s" for c in concurrencies), "verdict"]


def verdict_cell(row: dict) -> str:
    """The verdict, with what the engine said when started on a format serve-check refused (--probe-refused)."""
    said = row.get("engine_says")
    return row["verdict"] + (f"; started anyway: {engine_reason(said)}" if said else "")


def table_row(row: dict, concurrencies: list[str]) -> list[str]:
    gate, serve = row.get("gate") or {}, row.get("serve")
    head = [row["format"], row["engine"], number(gate.get("kld_mean"))]
    if not serve:
        return [*head, *(["–"] * (5 + len(concurrencies))), verdict_cell(row)]
    return [*head, f"{number(serve['kld_vs_base'])} (tail {serve['tail_mass']:.2f})", number(serve["kld_vs_reading"], 2),
            f"{serve['top1_vs_base']:.3f}", ppl_cell(gate, serve), f"{serve['greedy_identical']:.2f}",
            *(load_cell(serve, c) for c in concurrencies), verdict_cell(row)]


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cell.replace("|", "\\|") for cell in r) + " |" for r in rows])


def render(result: dict) -> str:
    """The table of a run (its --json)."""
    settings = result["settings"]
    concurrencies = names(settings["concurrency"])
    header = table_header(concurrencies, settings["logprobs"])
    return markdown(header, [table_row(r, concurrencies) for r in result["rows"]])


ENGINE_LABELS = {"vllm": "VLLM", "llama.cpp": "LLAMA", "mlx": "MLX"}  # quantkit.serve.measured's names


def record_result(row: dict) -> str | None:
    """A row's result as quantkit.serve.measured states it: "serves", "refused: <the engine's own reason,
    else serve-check's>", or None where quantkit itself refused the format for this model."""
    if row["verdict"] == "passes":
        return "serves"
    said = row.get("engine_says")
    if row["verdict"].startswith("refused: "):
        if said == "serves":
            raise SystemExit(f"{row['format']}: serve-check refuses it, but the engine served it: fix the rule")
        return "refused: " + (engine_reason(said) if said else row["verdict"][len("refused: "):])
    if row["verdict"].startswith("quantkit refused"):
        return None
    raise SystemExit(f"{row['format']}: {row['verdict']}: not a measured result; run it again")


def engine_reason(said: str) -> str:
    """The engine's error in one sentence: after quantkit's account of where it failed ("vllm exited before
    it was ready (exit code 1): ", "vllm failed while serving (POST ...: HTTP 500: ...): ") and before the
    details the engine lists after it ("... layer. Reasons: ...")."""
    reason = said.rsplit("): ", 1)[-1]
    return reason.split(". ", 1)[0].rstrip(".")


def records(result: dict) -> str:
    """The run's rows as quantkit/serve/measured.py's `bench(...)` records (paste them into MEASURED)."""
    lines = []
    for row in result["rows"]:
        outcome = record_result(row)
        if outcome is None:
            continue
        kld = row["serve"]["kld_vs_reading"] if outcome == "serves" else None
        args = [repr(row["format"]), repr(row["flags"][1]), repr(" ".join(row["flags"])),
                ENGINE_LABELS[row["engine"]], repr(outcome)] + ([f"{kld:.2g}"] if kld is not None else [])
        lines.append(f"    bench({', '.join(args)}),")
    return "\n".join(lines)


def machine() -> str:
    """This machine in words: the device the engines ran on, its cores, AVX-512 and AMX."""
    from quantkit.serve.support import accelerator

    device = accelerator()
    if device.kind != "cpu":
        return device.describe()
    avx512 = "AVX-512" if "avx512f" in device.flags else "no AVX-512"
    amx = "AMX" if "amx_tile" in device.flags else "no AMX"
    return f"{device.describe()}, {os.cpu_count()} cores, {avx512}, {amx}, no GPU"


def run_all(args: argparse.Namespace, command: str) -> dict:
    """Every wanted format in turn; the result (as --json writes it) after each one."""
    model = (args.model or reference_model(args.work)).resolve()
    result = {"model": str(model), "machine": machine(), "command": command, "settings": settings(args), "rows": []}
    for fmt in (f for f in FORMATS if f.name in names(args.formats)):
        result["rows"].append(bench_format(fmt, model, args))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return 0
    if args.records:
        print(records(json.loads(args.records.read_text())))
        return 0
    args.work = args.work.expanduser().resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # stopped like Ctrl-C: the running child and its server too
        signal.signal(sig, stop_on_signal)
    try:
        result = run_all(args, "python scripts/bench_serve.py " + " ".join(argv))
    finally:
        left = stop_leftovers(str(args.work / "artifacts"))  # servers of artifacts, not users of the model
        if left:
            log(f"stopped {len(left)} process(es) left serving under {args.work / 'artifacts'}: {left}")
    print(render(result))
    print(f"\n{result['machine']}; model {result['model']}; `{result['command']}`")
    return 0 if all(row_ok(r) for r in result["rows"]) and not left else 1


def stop_on_signal(signum, _frame) -> None:
    """SIGTERM / SIGHUP as an exception, so that the running command's process group and every process
    left serving an artifact are stopped on the way out (run, main's finally)."""
    raise SystemExit(128 + signum)


def settings(args: argparse.Namespace) -> dict:
    keep = ("num_samples", "seq_len", "eval_windows", "num_windows", "logprobs", "gen_prompts", "load_tokens",
            "concurrency")
    return {name: getattr(args, name) for name in keep}


if __name__ == "__main__":
    raise SystemExit(main())
