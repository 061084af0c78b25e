"""`quantkit inspect`: what a model is and what a method would do to it (reads headers and config, loads no weights)."""

from __future__ import annotations

import re
from typing import Optional

import typer
from rich.table import Table

from quantkit.cli.common import METHOD, MODEL, handle_errors, human_bytes, human_count, out, write_json
from quantkit.cli.options import (
    CONTEXT,
    IGNORE,
    METHOD_NAME,
    MODEL_DIR,
    OFFLOAD_DIR,
    PROJECTOR,
    RECIPE,
    VISION,
    json_flag,
)

LAYER_INDEX = re.compile(r"\.(\d+)\.")


@handle_errors
def inspect(
    model: str = typer.Argument(..., help=MODEL_DIR, rich_help_panel=MODEL),
    method: str = METHOD_NAME.option(default="fp8", help="Method whose plan to show."),
    recipe: Optional[str] = RECIPE.option(help="Show the plan of this recipe's first target."),
    ignore: list[str] = IGNORE.option(help="Extra modules to keep unquantized; repeatable."),
    vision: Optional[str] = VISION.option(help="Show the plan with the VLM vision encoder at keep | int8 | int4."),
    projector: Optional[str] = PROJECTOR.option(help="Show the plan with the VLM projector at keep | int8 | int4."),
    context: int = CONTEXT.option(),
    offload_dir: Optional[str] = OFFLOAD_DIR.option(help="Estimate the quantize run as with quantize --offload-dir DIR (decoder layers, embeddings and head on disk); nothing is written there."),
    json_path: Optional[str] = json_flag("the plan").option(),
    sensitivity: bool = typer.Option(False, "--sensitivity", help="Show the per-tensor sensitivity table of a quantkit output (MODEL: its directory or its quantkit.json), as --auto-precision / --fallback recorded it.", rich_help_panel=METHOD),
) -> None:
    """Show architecture, parameters, every linear module by role, the precision plan and memory estimates.

    Examples:

      quantkit inspect ./my-model

      quantkit inspect ./my-vlm --method gptq --json plan.json

      quantkit inspect ./my-model --recipe recipes/fp8-dynamic.yaml

      quantkit inspect ./my-model --method gptq --offload-dir /fast-disk/offload

      quantkit inspect ./my-model-gguf --sensitivity
    """
    from quantkit.errors import InputError
    from quantkit.io.checkpoint import check_model_dir, resolve_model
    from quantkit.methods import get_method
    from quantkit.run.auto import AUTO
    from quantkit.run.recipe import Overrides, build_recipe, target_options

    if sensitivity:
        tables = sensitivity_tables(read_report(model))
        if json_path != "-":
            for name, table in tables.items():
                out.print(_sensitivity_table(name, table))
        write_json(json_path, tables)
        return

    info = check_model_dir(resolve_model(model))
    resolved = build_recipe(recipe, None if recipe else method, Overrides(model=model, offload_dir=offload_dir))
    target = resolved.targets[0]  # the recipe's first target, or the --method's
    if target.method == AUTO:
        raise InputError(f"target '{target.name}': inspect plans one method's precision, and method auto chooses "
                         "the method when it runs", hint="quantkit plan MODEL sizes every format on each device; "
                         "quantkit quantize --method auto prints the ladder it measured")
    towers = target.tower_precision()
    towers.update({role: value for role, value in (("vision", vision), ("projector", projector)) if value})
    data = plan_data(info, get_method(target.method), target_options(target), target.ignore + ignore, context, towers)
    data["run"] = run_estimates(info, resolved, offload_dir)
    if json_path == "-":
        write_json("-", data)
        return
    print_plan(data)
    write_json(json_path, data)


def plan_data(info, method, options, ignore: list[str], context: int, towers: dict[str, str] | None = None) -> dict:
    from dataclasses import replace

    from quantkit.arch.vlm import tower_summary
    from quantkit.methods import ignore_patterns, runtimes_for
    from quantkit.run.plan import MEMORY_NOTE, build_plan, role_summary
    from quantkit.run.serving import memory_rows, quantizes_experts, served_runtimes

    towers = {role: value for role, value in (towers or {}).items() if value != "keep"}
    options, choices = method.resolve(info, options)
    patterns = ignore_patterns(info, ignore, method.layers.keeps_lm_head(options), tuple(towers))
    kept = rule_kept(info, method, options, patterns)
    patterns = patterns + sorted(kept)
    entries = [replace(e, precision=f"{e.precision.split(' (')[0]} (kept: {rule_reason(kept[e.name])})")
               if e.name in kept else e for e in build_plan(info, method, options, patterns, towers)]
    runtimes = served_runtimes(runtimes_for(method, options), quantizes_experts(entries))
    return {
        "model": str(info.path),
        "architecture": info.architecture,
        "model_type": info.model_type,
        "parameters": info.num_parameters,
        "dtype": info.dtype,
        "method": method.name,
        "options": options.model_dump(mode="json"),
        "choices": choices,
        "ignore": patterns,
        "towers": tower_summary(info.towers) if info.towers.components else None,
        "roles": role_summary(entries),
        "modules": [{"name": e.name, "role": e.role, "shape": e.shape, "precision": e.precision, "kept": e.kept,
                     "kernels": [] if e.kept else kernels(runtimes, e.shape)} for e in entries],
        "kept_16bit": kept,
        "runtimes": [{"name": r.name, "kinds": list(r.kinds), "min_capability": r.min_capability,
                      "widths": [r.out_multiple, r.in_multiple], "source": r.source} for r in runtimes],
        "memory": memory_rows(info, context),
        "memory_note": MEMORY_NOTE.format(context=context),
    }


def rule_kept(info, method, options, ignore: list[str]) -> dict[str, str]:
    """What `quantize` would keep 16-bit by rule (without --strict-shapes): the layers the model's family keeps,
    those the format cannot tile and the fused partners of any kept shard (quantkit.run.pipeline.resolve_target)."""
    from quantkit.run.pipeline import family_kept, fused_partners_kept

    kept = family_kept(info, method, method.needs_calibration(options)) | method.layers.shape_problems(info, options,
                                                                                                   ignore)
    kept.update(fused_partners_kept(info, method, ignore + sorted(kept)))
    return kept


def rule_reason(why: str) -> str:
    """A rule's reason in a few words, the same for every layer it keeps (the table groups layers)."""
    return "fused with a 16-bit shard" if "fuses it" in why else "widths do not tile"


def kernels(runtimes, shape: list[int]) -> list[str]:
    """The method's runtimes whose kernel takes a Linear of this [out, in] shape, with the compute
    capability each needs on CUDA (quantkit.formats.Runtime: its shape multiples and source)."""
    return [f"{r.name} (sm {r.min_capability:g}+)" if "cuda" in r.kinds else r.name
            for r in runtimes if r.accepts(shape)]


def run_estimates(info, resolved, offload_dir: str | None = None) -> dict:
    """What `quantkit quantize` with this recipe (or method: `resolved`, its targets' options validated),
    default calibration and `offload_dir` would need: peak RAM per step and bytes written (the same
    estimates its preflight checks)."""
    from quantkit.methods import get_method
    from quantkit.run.pipeline import ResolvedTarget
    from quantkit.run.preflight import (
        FIXED_RAM,
        describe_placement,
        gate_placement,
        ram_estimate,
        run_estimate,
        vram_estimate,
    )
    from quantkit.run.recipe import Gate, target_options

    targets = []
    for target in resolved.targets:
        spec = get_method(target.method)
        options, _ = spec.resolve(info, target_options(target))
        targets.append(ResolvedTarget(target, spec, options, Gate(), [], spec.needs_calibration(options),
                                      spec.needs_model(info, options)))
    placement = gate_placement(info, resolved, targets)
    ram = ram_estimate(info, resolved, targets, placement)
    disk = run_estimate(info, resolved, [(t.method, t.options) for t in targets])
    vram = vram_estimate(info, resolved, targets)
    gate = describe_placement(placement, info, resolved.calibration.seq_len) if placement.why else None
    return {"offload_dir": offload_dir, "peak_ram_bytes": ram.peak, "fixed_ram_bytes": FIXED_RAM, "ram_steps": ram.steps,
            "peak_vram_bytes": vram.peak, "vram_steps": vram.steps, "disk_bytes": disk.total, "gate": gate}


def collapse(modules: list[dict]) -> list[tuple[str, str, str, str, int]]:
    """Group decoder modules over layer indices: (name pattern, shape, precision, kernels, count)."""
    groups: dict[tuple[str, str, str, str], list[int]] = {}
    for m in modules:
        pattern = LAYER_INDEX.sub(".{i}.", m["name"], count=1)
        kernel_names = "—" if m.get("kept") else "; ".join(m.get("kernels") or []) or "none"
        key = (pattern, "x".join(map(str, m["shape"])), m["precision"], kernel_names)
        groups.setdefault(key, []).append(1)
    return [(*k, len(v)) for k, v in groups.items()]


def print_plan(data: dict) -> None:
    out.print(f"[bold]{data['architecture']}[/bold] ({data['model_type']}) · {human_count(data['parameters'])} "
              f"parameters · stored as {data['dtype']} · plan for method [bold]{data['method']}[/bold]")
    if data["towers"]:
        out.print(towers_line(data["towers"]), highlight=False)
    for option, why in data["choices"].items():
        out.print(f"{option}: {why}", highlight=False)
    out.print(_roles_table(data))
    out.print(_modules_table(data))
    out.print(_memory_table(data))
    out.print(f"[dim]{data['memory_note']}[/dim]")
    run = data["run"]
    steps = ", ".join(f"{name} {human_bytes(n)}" for name, n in run["ram_steps"].items())
    offload = ", --offload-dir" if run["offload_dir"] else ""
    out.print(f"quantize run (default calibration{offload}): peak RAM about {human_bytes(run['peak_ram_bytes'])} "
              f"({steps}; plus {human_bytes(run['fixed_ram_bytes'])} fixed), writes about "
              f"{human_bytes(run['disk_bytes'])}; on a GPU (--device cuda) peak GPU memory about "
              f"{human_bytes(run['peak_vram_bytes'])}", highlight=False)
    if run["gate"]:
        out.print(f"on this machine, {run['gate']}", highlight=False)


def towers_line(towers: dict) -> str:
    parts = [f"{role}: {', '.join(towers[role])}" for role in ("vision", "projector", "audio", "cross_attention") if towers.get(role)]
    if towers["unknown_towers"]:
        parts.append("UNKNOWN towers found by look (kept 16-bit): " + ", ".join(towers["unknown_towers"]))
    return f"VLM {towers['family'] or '(no table row)'}; towers (16-bit unless the plan below says otherwise): " + "; ".join(parts)


def _roles_table(data: dict) -> Table:
    table = Table(title="modules by role", title_justify="left")
    for column in ("role", "2-D weights", "parameters", "precision"):
        table.add_column(column, overflow="fold")
    for role, row in data["roles"].items():
        precisions = "; ".join(f"{p} ×{n}" for p, n in row["precisions"].items())
        table.add_row(role, str(row["modules"]), human_count(row["params"]), precisions)
    return table


def _modules_table(data: dict) -> Table:
    table = Table(title="linear modules ({i} = every decoder layer index); kernels: the runtimes whose kernels "
                  "take the layer's widths, with the compute capability they need", title_justify="left")
    for column in ("module", "shape", "count", "precision", "kernels"):
        table.add_column(column, overflow="fold")
    for name, shape, precision, kernel_names, count in collapse(data["modules"]):
        table.add_row(name, shape, str(count), precision, kernel_names)
    return table


def _memory_table(data: dict) -> Table:
    table = Table(title="estimated memory", title_justify="left")
    for column in ("method", "format", "weights", "with KV + overhead"):
        table.add_column(column)
    for name, row in data["memory"].items():
        table.add_row(name, row["format"], human_bytes(row["weights_bytes"]), human_bytes(row["with_overhead_bytes"]))
    return table


def read_report(path: str) -> dict:
    """The quantkit.json of an output directory (or the file itself)."""
    import json
    from pathlib import Path

    from quantkit.errors import InputError

    file = Path(path) / "quantkit.json" if Path(path).is_dir() else Path(path)
    if not file.is_file() or file.suffix != ".json":
        raise InputError(f"no quantkit.json at {path}", hint="--sensitivity reads a quantkit output directory")
    return json.loads(file.read_text())


def sensitivity_tables(report: dict) -> dict[str, dict]:
    """{target name: {"sensitivity": ..., "types": {tensor: chosen type}}} of the targets that have one."""
    from quantkit.errors import InputError

    tables = {}
    for target in report.get("targets", []):
        details = target.get("details") or {}
        if "sensitivity" in details:
            types = (details.get("mixed_precision") or {}).get("types", {})
            tables[target["name"]] = {"sensitivity": details["sensitivity"], "types": types}
    if not tables:
        raise InputError("this report has no sensitivity table",
                         hint="quantize with --auto-precision (gguf, gptq, awq) or --fallback (any method; "
                         "recorded once a gate failed)")
    return tables


def _sensitivity_table(name: str, data: dict) -> Table:
    """One row per tensor: its plain and chosen precision, its measured KLD (a probe) or none (its gain
    interpolated), and the predicted damage (KL divergence) at each of its candidates, cheapest first."""
    table_data = data["sensitivity"]
    how = (f"damage = gain x weighted error, gains measured on {table_data.get('probes', '?')} probe tensors "
           f"over {table_data['windows']} windows and interpolated by role and depth"
           if table_data["measured"] else "damage = importance-weighted squared error (not measured)")
    if table_data.get("rank_correlation") is not None:
        how += f"; the weighted error ranks the probes' KLD with Spearman's rho {table_data['rank_correlation']:.2f}"
    # plain: the type llama.cpp's mixture gives the tensor (gguf), the method's one precision (int4 for gptq)
    table = Table(title=f"{name}: per-tensor sensitivity ({how})", title_justify="left")
    for column in ("tensor", "plain", "chosen", "KLD@probe", "damage by candidate"):
        table.add_column(column, overflow="fold")
    for row in table_data["tensors"]:
        kld = "interp." if row["kld"] is None else f"{row['kld']:.3g} @{row['probe']}"
        candidates = row.get("candidates") or list(row["damage"])
        damage = " ".join(f"{c} {row['damage'][c]:.2g}" for c in candidates)
        plain = row.get("plain", row.get("mixture"))
        table.add_row(row["tensor"], plain, data["types"].get(row["tensor"], plain), kld, damage)
    return table
