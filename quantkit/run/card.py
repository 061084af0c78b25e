"""The model card (README.md) an artifact carries and the Hub reads: YAML front matter (base_model as a Hub
id with base_model_relation quantized, library_name, pipeline_tag, the base's license, quantized_by, tags,
quantization) and a body: the gate's table (base against quantized), the KL divergence figure, task
accuracy, what was kept 16-bit and why, the VLM towers, the serving check, how to run it in its engine,
and the recipe that reproduces it. Everything comes from the run's report (`quantkit.json`), so a card
can be rendered again for a Hub repo (quantkit.run.push) from an artifact's own files.

A model from a local directory names no base_model (a path on the machine that made it means nothing
on the Hub): the card says "from a local checkpoint" and gives the sha256 of its config.json.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from quantkit.methods import get_method
from quantkit.run.report import RunReport, TargetReport, stat_text, threshold_text
from quantkit.units import size_text

if TYPE_CHECKING:
    from quantkit.eval.evaluate import GateResult

FIGURE = "kld.png"  # the KL divergence figure beside the card
LICENSE_KEYS = ("license", "license_name", "license_link")


@dataclass(frozen=True)
class Place:
    """Where an artifact is (or will be) on the Hub: its repo, and its folder there for a recipe that
    pushes its targets into one repo's subfolders."""

    repo: str
    subfolder: str | None = None


def write_card(out_dir: Path, target: TargetReport, report: RunReport, place: Place | None = None) -> None:
    """README.md and its figure (FIGURE, when the target was measured) into OUT_DIR."""
    from quantkit.run.figure import kld_figure

    figure = kld_figure(target, out_dir / FIGURE) if target.metrics is not None else None
    (out_dir / "README.md").write_text(model_card(target, report, place, figure is not None))


def model_card(target: TargetReport, report: RunReport, place: Place | None = None, figure: bool = False) -> str:
    """The card's text: front matter, then the body."""
    lines = ["---", front_text(front_matter(target, report)), "---", ""]
    lines += [f"# {base_name(report)} — {target.name} ({target.method})", "", source_line(report), ""]
    lines += gate_section(target, figure)
    lines += auto_section(target.details.get("auto"))
    lines += tasks_section(target.tasks)
    lines += kept_section(target)
    lines += tower_section(report.model.towers, target.details.get("towers"))
    lines += serve_check_section(target.details.get("serve_check"))
    lines += run_section(target, report, place)
    lines += recipe_section(target, report)
    lines += ["Produced by `quantkit quantize`; the full record is in `quantkit.json`.", ""]
    return "\n".join(lines)


def read_license(model_dir: Path) -> dict[str, str] | None:
    """The license fields of the base's own card (README.md front matter), copied onto the artifact's card."""
    import yaml

    card = model_dir / "README.md"
    text = card.read_text(errors="replace") if card.is_file() else ""
    if not text.startswith("---"):
        return None
    try:
        front = yaml.safe_load(text.split("---", 2)[1])
    except (yaml.YAMLError, IndexError):
        return None
    found = {k: str(front[k]) for k in LICENSE_KEYS if isinstance(front, dict) and front.get(k)}
    return found or None


def front_matter(target: TargetReport, report: RunReport) -> dict:
    """The card's metadata as the Hub reads it (https://huggingface.co/docs/hub/model-cards)."""
    front: dict = {}
    hub = report.model.hub
    if hub:
        front.update(base_model=hub["repo_id"], base_model_relation="quantized")
    front.update(library_name=library_name(target), pipeline_tag=pipeline_tag(report))
    front.update({k: v for k, v in (report.model.license or {}).items() if k in LICENSE_KEYS})
    front.update(quantized_by="quantkit", tags=["quantkit", "quantized", target.method, artifact_format(target).kind],
                 quantization={"method": target.method, "format": target.format, "engine": target.engine,
                               "options": target.options})
    return front


def front_text(front: dict) -> str:
    import yaml

    return yaml.safe_dump(front, sort_keys=False).strip()


def artifact_format(target: TargetReport):
    """The format the target's method writes (quantkit.formats.Format)."""
    return get_method(target.method).format


def library_name(target: TargetReport) -> str:
    return artifact_format(target).library


def pipeline_tag(report: RunReport) -> str:
    return "image-text-to-text" if report.model.towers else "text-generation"


def base_name(report: RunReport) -> str:
    hub = report.model.hub
    return hub["repo_id"].split("/")[-1] if hub else Path(report.model.path).name


def source_line(report: RunReport) -> str:
    """Where the base came from: its Hub id and commit, or a local checkpoint named by its config's sha256."""
    hub = report.model.hub
    if hub:
        return (f"Quantized with quantkit {report.quantkit_version} from [{hub['repo_id']}]({hub['endpoint']}/"
                f"{hub['repo_id']}) at commit `{hub['sha']}` (asked as `{hub['revision']}`).")
    config = report.inputs.get("model/config.json", "unknown")
    return (f"Quantized with quantkit {report.quantkit_version} from a local checkpoint (config.json sha256 "
            f"`{config}`).")


# ---------------------------------------------------------------- quality


def gate_section(target: TargetReport, figure: bool) -> list[str]:
    """The verdict, the base against the quantized model, every check of the gate, and the figure."""
    gate, m = target.gate, target.metrics
    if gate is None or not gate.checks or m is None:
        return ["Quality: not measured.", ""]
    lines = ["## Quality gate", "", verdict_line(gate), "",
             f"Measured on {m.positions} held-out positions against the base:", "",
             "| | base | quantized |", "|---|---|---|",
             f"| perplexity | {m.ppl_base:.4f} | {m.ppl:.4f} ({m.ppl_increase:+.2%}) |",
             f"| KL divergence mean / p99 | 0 | {m.kld_mean:.6f} / {m.kld_p99:.6f} |",
             f"| top-1 agreement | 100% | {m.top1:.2%} |", "",
             "| check | value | threshold | ok |", "|---|---|---|---|"]
    lines += [f"| {c.name} | {c.value:.6g} | {threshold_text(c)} | {'yes' if c.passed else 'NO'} |"
              for c in gate.checks]
    if figure:
        lines += ["", f"![KL divergence per position, base to quantized]({FIGURE})"]
    return lines + [""]


def auto_section(ladder: dict | None) -> list[str]:
    """How `--method auto` chose this artifact: the destination, and each smaller candidate and why it was not
    chosen (the whole ladder is in quantkit.json, details.auto)."""
    if not ladder or not ladder["chosen"]:
        return []
    rows = ladder["ladder"]
    measured = sum(1 for r in rows if r["seconds"] is not None)
    lines = ["## How this artifact was chosen", "",
             f"`quantkit quantize --method auto --for {ladder['for']}` ({ladder['engine']} on {ladder['device']}, "
             f"{ladder['context']} tokens x {ladder['batch']} of KV cache) measured {measured} of {len(rows)} "
             f"candidates and chose the smallest that passed the gate: **{ladder['chosen']}**.", ""]
    before = rows[:next(i for i, r in enumerate(rows) if r["candidate"] == ladder["chosen"])]
    lines += [f"- {r['candidate']}: {r['status']}, {r['why']}" for r in before if r["status"] != "unneeded"]
    return lines + ([""] if before else [])


def verdict_line(gate: GateResult) -> str:
    return f"Verdict: **{'PASS' if gate.passed else 'FAIL'}**" + ("" if gate.enforced else " (not enforced: --no-gate)")


def verdict_word(target: TargetReport) -> str:
    """PASS, FAIL or not measured: what the push's commit message says of the gate."""
    if target.gate is None or not target.gate.checks:
        return "not measured"
    return "PASS" if target.gate.passed else "FAIL"


def tasks_section(tasks: list[dict]) -> list[str]:
    """Task accuracy of the artifact against the base (lm-evaluation-harness, offline data)."""
    if not tasks:
        return []
    lines = ["## Task accuracy", "", "lm-evaluation-harness on local data; recovery = artifact / base.", "",
             "| task | metric | samples | base | artifact | recovery | min | ok |", "|---|---|---|---|---|---|---|---|"]
    for r in tasks:
        lines.append(f"| {r['task']} | {r['metric']} | {r['samples']} | {stat_text(r['base'], r['base_stderr'])} | "
                     f"{stat_text(r['score'], r['stderr'])} | {r['recovery']:.3f} | {r['min_recovery']:g} | "
                     f"{'yes' if r['passed'] else 'NO'} |")
    return lines + [""]


# ---------------------------------------------------------------- what was kept


ROLE_REASONS = {
    "lm_head": "the output head: the method keeps it 16-bit, its rounding reaching every token's probability",
    "router": "MoE routers: rounding them changes which experts run",
    "embeddings": "the embeddings: a table lookup, not a matrix product the format's kernels run",
    "vision": "the vision encoder: the text-only gate cannot measure image understanding",
    "projector": "the projector between the vision encoder and the language model",
    "audio": "the audio encoder: the text-only gate cannot measure it",
    "tower": "a modality tower: the text-only gate cannot measure it",
    "cross_attention": "cross-attention to the image features",
}


def kept_section(target: TargetReport) -> list[str]:
    """What stayed 16-bit, and why: by role, by the recipe's ignore list, and by the format's shape rules."""
    lines = ["## Kept in 16-bit", ""]
    lines += [f"- {role}: {ROLE_REASONS.get(role, 'kept by the method or the ignore list')}" for role in target.kept]
    if not target.kept:
        lines.append("- nothing: every linear layer of the decoder is quantized")
    if target.details.get("kept_16bit"):
        lines.append(f"- Also kept 16-bit: {kept_summary(target.details['kept_16bit'])} (each with its reason in "
                     "quantkit.json, `details.kept_16bit`)")
    lines.append("")
    lines += [f"Chosen for this model: {option} {why}." for option, why in target.details.get("choices", {}).items()]
    lines += mixed_lines(target.details)
    return lines + ([""] if lines[-1] else [])


def kept_summary(kept: dict[str, str]) -> str:
    """One line: how many layers a rule kept 16-bit (a width the format cannot tile, a shard vLLM fuses with a
    16-bit one), why, and the first few."""
    reasons = sorted({"vLLM fuses them with a 16-bit shard" if "fuses it" in why else
                      "their widths do not tile in the format" for why in kept.values()})
    names = sorted(kept)
    return f"{len(kept)} layer(s) ({'; '.join(reasons)}): {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}"


def mixed_lines(details: dict) -> list[str]:
    """Per-layer precision chosen by --auto-precision or raised by --fallback, in two lines."""
    lines = []
    mixed = details.get("mixed_precision")
    if mixed and mixed.get("changed"):
        lines.append(f"Mixed precision: {len(mixed['changed'])} of {len(mixed['types'])} layers differ from the plain "
                     "plan (the list is in `quantkit.json`, details.mixed_precision).")
    fallback = details.get("fallback")
    if fallback:
        lines.append(f"Gate-driven fallback: {len(fallback['steps']) - 1} step(s), {fallback['size_cost_bytes']:+,} "
                     f"bytes; {fallback['stopped']}.")
    return lines


def tower_section(towers: dict | None, proof: dict | None) -> list[str]:
    """The VLM's towers kept in 16-bit (unknown ones named), and what the gate proved about them."""
    if not towers:
        return []
    family = towers["family"] or "unknown VLM (towers found by look)"
    lines = ["## Vision-language model", "", f"Family: {family}. Towers (16-bit unless listed as quantized):"]
    lines += [f"- {role}: " + ", ".join(f"`{c}`" for c in towers[role])
              for role in ("vision", "projector", "audio", "cross_attention") if towers.get(role)]
    if towers["unknown_towers"]:
        lines.append("- unknown towers (no table row; found by convolution weights, names or config): "
                     + ", ".join(f"`{c}`" for c in towers["unknown_towers"]))
    if proof and proof.get("tower_precision"):
        forced = " (4-bit towers allowed with --force)" if proof.get("forced") else ""
        lines.append("- quantized on request, round-to-nearest weights: "
                     + ", ".join(f"{role} {value}" for role, value in proof["tower_precision"].items()) + forced)
    if proof:
        lines += ["", *proof_lines(proof)]
    return lines + [""]


def proof_lines(proof: dict) -> list[str]:
    """What the gate proved about the towers: a checkpoint's after reload, or a .gguf's mmproj file."""
    if "tower_tensors_identical" in proof:
        rounded = proof.get("tower_weights_quantized", 0)
        lines = [f"After reload: {proof['tower_tensors_identical']} tower tensors bit-identical to the source"
                 + (f", {rounded} quantized tower weights within half a step of it" if rounded else "")
                 + f"; image+text forward: {proof['image_forward']}."]
        if proof.get("mmproj", "") is None:
            lines.append("No mmproj was written (`mmproj: none`): this .gguf cannot read images.")
        return lines
    lines = [f"Vision tower and projector: `{proof['mmproj']}` (as {proof['converter']} writes it). Read back, its "
             f"{proof['tensors']} tensors equal the source towers byte for byte after the converter's changes; "
             f"{proof['source_values_exact']} hold the source values exactly."]
    if proof["rounded_to_stored_type"]:
        lines.append("Rounded to their stored type: " + ", ".join(f"`{n}`" for n in proof["rounded_to_stored_type"]) + ".")
    if proof["stored_plus_one"]:
        lines.append("Stored as w + 1 (llama.cpp's RMSNorm): " + ", ".join(f"`{n}`" for n in proof["stored_plus_one"]) + ".")
    if proof["left_out"]:
        lines.append(f"Left out as llama.cpp does: {len(proof['left_out'])} tensors ("
                     + "; ".join(sorted(set(proof["left_out"].values()))) + ").")
    return lines


def serve_check_section(check: dict | None) -> list[str]:
    """The serving check's verdict (quantkit.serve.check): the staged artifact in its engine, before publishing."""
    if not check:
        return []
    if "skipped" in check:
        return ["## Serving check", "", f"Asked for, {check['skipped']}.", ""]
    engine = check["engine"]
    lines = ["## Serving check", "", f"Loaded by {engine['name']} {engine.get('version') or ''} as a server and "
             f"measured from its own log-probabilities: **{'PASS' if check['passed'] else 'FAIL'}**.", "",
             "| check | value | threshold | ok |", "|---|---|---|---|"]
    lines += [f"| {c['name']} | {c['value']:.6g} | {c['op']} {c['threshold']:g} | {'yes' if c['passed'] else 'NO'} |"
              for c in check["checks"]]
    return lines + [""]


# ---------------------------------------------------------------- how to run and reproduce


HERE = re.compile(r"(?<= )\.(?=[ )]|$)")  # "." as the artifact's directory in a serve command


def run_section(target: TargetReport, report: RunReport, place: Place | None) -> list[str]:
    """How to run the artifact in its engine ("## Serving"): from the Hub repo when it is pushed, and from
    its directory with the serving plan's line (quantkit.run.serving)."""
    lines = ["## Serving", ""]
    if place is not None:
        lines += [f"From the Hub: `{hub_command(target, place)}`", ""]
    plan = target.details.get("serving")
    if plan:
        lines += [f"From this directory: `{plan['serve']}`", "", serving_line(plan, report), ""]
    return lines if len(lines) > 2 else []


def hub_command(target: TargetReport, place: Place) -> str:
    """The command that runs the artifact from its Hub repo: the format's own where its engine fetches from the
    Hub itself (llama.cpp: one .gguf of a repo), else the repo read as the directory (a subfolder downloaded
    first)."""
    own = artifact_format(target).hub_serve_command(place.repo, place.subfolder, target.files)
    if own:
        return own
    local = (target.details.get("serving") or {}).get("serve", "vllm serve .")
    if place.subfolder:
        return (f"hf download {place.repo} --include '{place.subfolder}/*' --local-dir . && "
                + HERE.sub(f"./{place.subfolder}", local))
    return HERE.sub(place.repo, local)


def serving_line(plan: dict, report: RunReport) -> str:
    """This artifact's line of the serving plan: its size, the KV cache, and where it fits."""
    by_verdict: dict[str, list[str]] = {}
    for device, fit in plan["devices"].items():
        where = f"{device} ({fit['runtime']})" if fit["runtime"] and fit["verdict"] != "too small" else device
        by_verdict.setdefault(fit["verdict"], []).append(where)
    parts = [f"{verdict}: {', '.join(devices)}" for verdict, devices in by_verdict.items()]
    base = report.model.hub["repo_id"] if report.model.hub else "BASE"
    return (f"{size_text(plan['weights_bytes'])} on disk, fp16 KV cache {size_text(plan['kv_cache_bytes'])} for "
            f"{plan['context']} tokens; " + "; ".join(parts) + f". Other devices and contexts: `quantkit plan {base}`.")


RECIPE_FILE = "quantkit-recipe.yaml"  # the card's name for it (an artifact may hold an engine's own recipe.yaml)


def recipe_section(target: TargetReport, report: RunReport) -> list[str]:
    """The recipe that reproduces this artifact (this target alone, the model pinned to its commit, the
    fields left at their defaults left out) and the command that runs it."""
    hub = report.model.hub
    entry = [t for t in report.recipe.get("targets", []) if t.get("name") == target.name]
    data = {**{k: v for k, v in report.recipe.items() if k not in ("push", "offline")}, "targets": entry}
    data = {k: v for k, v in as_written(data).items() if k != "model"}
    data = {**({"model": f"{hub['repo_id']}@{hub['sha']}"} if hub else {}), **data}
    model = "" if hub else "./base "
    return ["## Reproduce", "", f"Saved as `{RECIPE_FILE}`:", "", "```yaml", front_text(data), "```", "",
            f"`quantkit quantize {model}--recipe {RECIPE_FILE} -o ./{target.name}`"
            + ("" if hub else " (with the same local checkpoint as `./base`)"), ""]


def as_written(data: dict) -> dict:
    """A recorded recipe without the fields at their defaults (as a person would write it); a record this
    quantkit cannot read back is shown without its empty fields."""
    from pydantic import ValidationError

    from quantkit.run.recipe import Recipe

    try:
        return Recipe.model_validate(data).model_dump(mode="json", exclude_defaults=True)
    except ValidationError:
        return compact(data)


def compact(value):
    """VALUE without None, empty lists and empty mappings (a recipe as a person would write it)."""
    if isinstance(value, dict):
        items = {k: compact(v) for k, v in value.items()}
        return {k: v for k, v in items.items() if v not in (None, [], {})}
    if isinstance(value, list):
        return [compact(v) for v in value]
    return value


# ---------------------------------------------------------------- a repo of several targets


def repo_card(entries: list[tuple[TargetReport, RunReport]], repo: str) -> str:
    """The card at the root of a repo whose targets sit in subfolders: the first target's front matter with
    every target's tags, and one row per target linking its folder (each folder has its own card)."""
    first, report = entries[0]
    front = front_matter(first, report)
    front["tags"] = sorted({tag for target, r in entries for tag in front_matter(target, r)["tags"]})
    front.pop("quantization")
    lines = ["---", front_text(front), "---", "", f"# {base_name(report)} — quantized by quantkit", "",
             source_line(report), "", "| folder | method | format | gate | KLD mean | Δppl |",
             "|---|---|---|---|---|---|"]
    for target, _ in entries:
        m = target.metrics
        metrics = f"{m.kld_mean:.6f} | {m.ppl_increase:+.2%}" if m else "— | —"
        lines.append(f"| [{target.name}]({target.name}/README.md) | {target.method} | {target.format} | "
                     f"{verdict_word(target)} | {metrics} |")
    lines += ["", f"Each folder holds one artifact with its card and `quantkit.json`; e.g. "
              f"`{hub_command(first, Place(repo, first.name))}`.", ""]
    return "\n".join(lines)
