"""`quantkit plan`: which format of a model fits which device, with which runtime (reads headers and config only)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from quantkit.cli.common import MODEL, RESOURCES, handle_errors, human_bytes, out, write_json
from quantkit.cli.options import CONTEXT, METHOD_NAME, MODEL_DIR, json_flag

SYMBOLS = {"fits": "✅", "tight": "⚠", "too small": "❌", "no runtime": "—"}


@handle_errors
def plan(
    model: str = typer.Argument(..., help=MODEL_DIR, rich_help_panel=MODEL),
    gpu: list[str] = typer.Option([], "--gpu", help="A device to plan for; repeatable: H100, H200, B200, A100-80G, "
                                  "A100-40G, L40S, L4, A10G, RTX4090, RTX3090, T4, V100-32G, M2-Ultra-192G, "
                                  "M4-Max-128G, M3-Max-64G, M3-Pro-36G, M2-16G, cpu (this machine), cpu-64G. "
                                  "Default: H100, A100-80G, L40S, RTX4090, M3-Max-64G, cpu.", rich_help_panel=RESOURCES),
    context: int = CONTEXT.option(decls=("--context",), extra=(("min", 1),), help="Tokens per sequence held in the KV cache."),
    batch: int = typer.Option(1, "--batch", min=1, help="Sequences served at once.", rich_help_panel=RESOURCES),
    kv_cache: str = typer.Option("fp16", "--kv-cache", help="KV cache precision: fp16, fp8, or an engine's KV type "
                                 "as quantize/eval --kv-cache spell it (vllm:turboquant_k3v4_nc, llama.cpp:q8_0/q4_0, "
                                 "mlx:4).", rich_help_panel=RESOURCES),
    kv_report: Optional[Path] = typer.Option(None, "--kv-report", help="A quantize report (quantkit.json) or eval "
                                             "--json written with --kv-cache: per measured type that passed, the "
                                             "largest context per device beside the artifact's weights.",
                                             rich_help_panel=RESOURCES),
    method: list[str] = METHOD_NAME.option(default=[], help="Plan these methods only; repeatable (default: all)."),
    json_path: Optional[str] = json_flag("the plan").option(),
) -> None:
    """For the model as it is and for each format quantkit writes: weights, KV cache and overhead,
    whether that fits each device, the runtime and kernel that serve it there, and the serve command.

    Examples:

      quantkit plan ./my-model

      quantkit plan ./my-model --gpu L4 --gpu T4 --context 8192 --batch 8 --kv-cache fp8

      quantkit plan ./my-model --method gptq --method gguf --json plan.json
    """
    from quantkit.errors import InputError
    from quantkit.io.checkpoint import check_model_dir, resolve_model
    from quantkit.methods import check_method_name
    from quantkit.run.preflight import available_ram, total_ram
    from quantkit.run.serving import DEFAULT_DEVICES, KV_BYTES, device, serving_plan

    for name in method:
        check_method_name(name)
    report = read_kv_report(kv_report) if kv_report else None
    info = check_model_dir(resolve_model(model))
    per_token = kv_type_bytes(kv_cache, info.config) if kv_cache not in KV_BYTES else None
    ram = total_ram() or available_ram()
    devices = [device(name, ram) for name in (gpu or DEFAULT_DEVICES)]
    data = serving_plan(info, devices, context, batch, kv_cache, method or None, per_token)
    if report is not None:
        data["measured_kv"] = measured_kv(report, devices, batch, info)
    if json_path != "-":
        print_plan(data)
    write_json(json_path, data)


def kv_type_bytes(kv_cache: str, config: dict) -> int:
    """KV bytes per token of an engine's KV type on this model (quantkit.eval.kv; exit 2 on an unknown one)."""
    from quantkit.errors import UnsupportedError
    from quantkit.eval import kv
    from quantkit.run.serving import KV_BYTES

    try:
        return round(kv.parse_one(kv_cache, kv.shape_of(config)).bytes_per_token(kv.shape_of(config)))
    except UnsupportedError as exc:
        raise UnsupportedError(f"{exc.message} (or one of {', '.join(KV_BYTES)})", hint=exc.hint) from None


def read_kv_report(path: Path) -> dict:
    import json

    from quantkit.errors import InputError
    from quantkit.run.serving import measured_kv_sections

    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"--kv-report {path}: {exc}", hint="give quantize's quantkit.json or eval's --json") from None
    if not measured_kv_sections(report):
        raise InputError(f"--kv-report {path}: no KV-cache types were measured in it",
                         hint="run quantize or eval with --kv-cache auto first")
    return report


def measured_kv(report: dict, devices, batch: int, info) -> list[dict]:
    """Per target of the report, the largest context per device for each KV type that passed."""
    from quantkit.run.serving import kv_context_rows, measured_kv_sections, source_bytes

    return [{"target": name, "weights_bytes": weights or source_bytes(info),
             "types": kv_context_rows(weights or source_bytes(info), section, devices, batch)}
            for name, weights, section in measured_kv_sections(report)]


def print_plan(data: dict) -> None:
    tokens = data["context"] * data["batch"]
    out.print(f"model: {data['model']}")
    out.print(f"KV cache: {data['kv_cache']}, {human_bytes(data['kv_bytes_per_token'])} per token, "
              f"{data['context']} tokens x {data['batch']} sequence(s) = {human_bytes(data['kv_bytes_per_token'] * tokens)}; "
              f"needs = (weights + KV cache) x {1 + data['overhead']:.2f} for activations and buffers")
    out.print(plan_table(data))
    out.print(f"✅ fits  ⚠ fits, but the weights leave under {data['kv_share']:.0%} of the memory to the KV cache  "
              "❌ too small  — no runtime serves the format there")
    print_measured(data)
    for target in data.get("measured_kv") or []:
        out.print(kv_context_table(target, data["batch"]))
    out.print("Devices: " + "; ".join(f"{d['name']} {human_bytes(d['memory_bytes'])} x {d['usable']:.2f} usable"
                                      for d in data["devices"]))
    out.print("Serve (OUT: the quantize output):")
    for row in data["formats"]:
        if row["serve"]:
            out.print(f"  {row['method']}: {row['serve']}")
    out.print("Sources:")
    for source in data["sources"]:
        out.print(f"  {source}")


def print_measured(data: dict) -> None:
    """Per format, the engines measured to load it and where none was (docs/serving.md)."""
    rows = [row for row in data["formats"] if "measured_summary" in row]
    if rows:
        out.print("Measured in the engines (serve-check; docs/serving.md):", highlight=False)
    for row in rows:
        out.print(f"  {row['method']}: {row['measured_summary']}", highlight=False, markup=False)


def plan_table(data: dict) -> Table:
    table = Table(title="serving plan", title_justify="left")
    for column in ("format", "weights", "needs", *(d["name"] for d in data["devices"])):
        table.add_column(column)
    for row in data["formats"]:
        cells = [f"{SYMBOLS[f['verdict']]} {f['runtime'] or lacks_text(f)}".strip() for f in row["devices"]]
        needs = row["devices"][0]["needs_bytes"] if row["devices"] else 0
        table.add_row(row["method"], human_bytes(row["weights_bytes"]), human_bytes(needs), *cells)
    return table


def kv_context_table(target: dict, batch: int) -> Table:
    """The largest context per sequence each device holds beside the weights, per measured KV type that passed."""
    title = (f"{target['target']}: largest context per sequence ({batch} at once) beside "
             f"{human_bytes(target['weights_bytes'])} of weights, per measured KV type that passed")
    table = Table(title=title, title_justify="left")
    table.add_column("KV type")
    table.add_column("bytes/token", justify="right")
    table.add_column("KLD", justify="right")
    devices = list(target["types"][0]["max_context"]) if target["types"] else []
    for name in devices:
        table.add_column(name, justify="right")
    for row in target["types"]:
        table.add_row(row["type"] + (" (chosen)" if row["chosen"] else ""), f"{row['bytes_per_token']:,.0f}",
                      f"{row['kld_mean']:.5f}", *(f"{row['max_context'][n]:,}" for n in devices))
    return table


def lacks_text(fit: dict) -> str:
    """Where no runtime serves on this CPU for lack of a feature: which one; where none serves this model's
    artifact although one serves its format: why."""
    missing = fit.get("lacks_cpu_features") or []
    return f"needs {', '.join(missing)}, which this CPU lacks" if missing else fit.get("refused", "")
