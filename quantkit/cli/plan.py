"""`quantkit plan`: which format of a model fits which device, with which runtime (reads headers and config only)."""

from __future__ import annotations

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
    kv_cache: str = typer.Option("fp16", "--kv-cache", help="KV cache precision: fp16 or fp8.", rich_help_panel=RESOURCES),
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

    if kv_cache not in KV_BYTES:
        raise InputError(f"--kv-cache {kv_cache}: choose one of " + ", ".join(KV_BYTES), hint="e.g. --kv-cache fp8")
    for name in method:
        check_method_name(name)
    info = check_model_dir(resolve_model(model))
    ram = total_ram() or available_ram()
    devices = [device(name, ram) for name in (gpu or DEFAULT_DEVICES)]
    data = serving_plan(info, devices, context, batch, kv_cache, method or None)
    if json_path != "-":
        print_plan(data)
    write_json(json_path, data)


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
        cells = [f"{SYMBOLS[f['verdict']]} {f['runtime'] or ''}".strip() for f in row["devices"]]
        needs = row["devices"][0]["needs_bytes"] if row["devices"] else 0
        table.add_row(row["method"], human_bytes(row["weights_bytes"]), human_bytes(needs), *cells)
    return table
