"""The run report: typed records shared by the table printer, `quantkit.json` and the model card.

`RunReport.to_dict()` is what `quantkit.json` holds (and `--json` prints); `SCHEMA_VERSION`
changes whenever a field is renamed or removed, so CI scripts can check what they read.

Each target has a `status`: "passed" (gate passed, or measured without enforcing, or not
measured), "failed" (an enforced gate, or the artifact did not reload), "error" (the target raised;
`error` holds the message) or "skipped" (--skip-existing: its output was up to date; the entry is
the one that output's quantkit.json holds). `written` says whether this run published it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantkit.methods import get_method

if TYPE_CHECKING:
    from quantkit.eval.evaluate import GateResult, Metrics

SCHEMA_VERSION = 1


@dataclass
class ModelReport:
    path: str
    architecture: str
    model_type: str
    parameters: int
    dtype: str
    sha256: dict[str, str]  # weight file name -> digest
    towers: dict[str, Any] | None = None  # a VLM's towers (quantkit.arch.vlm.tower_summary), kept 16-bit


@dataclass
class TargetReport:
    name: str
    method: str
    format: str
    engine: str
    engine_version: str | None
    options: dict[str, Any]
    ignore: list[str]
    kept: list[str]  # roles kept in 16-bit
    quantized_modules: int
    details: dict[str, Any] = field(default_factory=dict)  # the method's own fields (QuantizeResult.details)
    files: list[str] = field(default_factory=list)
    metrics: Metrics | None = None
    gate: GateResult | None = None
    tasks: list[dict[str, Any]] = field(default_factory=list)  # quantkit.eval.tasks.TaskResult.as_dict() per task
    timings: dict[str, float] = field(default_factory=dict)
    peak_rss_bytes: int = 0  # the larger of the steps below
    peak_rss_by_step: dict[str, int] = field(default_factory=dict)  # "quantize", "eval"
    status: str = "passed"  # passed | failed | error | skipped
    error: str | None = None  # the message, for status "error" (or "failed" by a reload error)
    exit_code: int = 0  # what this target alone would exit with: 0, 3 gate, 1/2 error
    written: bool = False  # published by this run
    fingerprint: dict[str, Any] = field(default_factory=dict)  # what --skip-existing compares (quantkit.run.cache)

    @property
    def failed_enforced_gate(self) -> bool:
        return self.gate is not None and self.gate.enforced and not self.gate.passed

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("metrics", "gate")}
        data["metrics"] = self.metrics.as_dict() if self.metrics else None
        data["gate"] = self.gate.as_dict() if self.gate else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TargetReport":
        """A target entry read back from a quantkit.json (fields it lacks get their defaults)."""
        from quantkit.eval.evaluate import Check, GateResult, Metrics

        names = {f.name for f in fields(cls)} - {"metrics", "gate"}
        entry = cls(**{k: v for k, v in data.items() if k in names})
        if data.get("metrics"):
            entry.metrics = Metrics(**data["metrics"])
        if data.get("gate"):
            gate = data["gate"]
            entry.gate = GateResult(gate["passed"], gate["enforced"], [Check(**c) for c in gate["checks"]])
        return entry


@dataclass
class RunReport:
    quantkit_version: str
    versions: dict[str, str | None]
    recipe: dict[str, Any]
    model: ModelReport
    calibration: dict[str, Any]
    gate_enforced: bool
    inputs: dict[str, str] = field(default_factory=dict)  # "model/…", "lora0/…", "calibration/…" -> sha256
    timings: dict[str, float] = field(default_factory=dict)
    baseline: dict[str, Any] | None = None
    targets: list[TargetReport] = field(default_factory=list)
    passed: bool | None = None  # None: nothing was measured
    merge: dict[str, Any] | None = None  # LoRA merge (quantkit.run.lora.MergeReport) when adapters were merged
    gate_placement: dict[str, Any] | None = None  # where the gate's forwards ran (quantkit.run.preflight.gate_placement)

    def to_dict(self, targets: list[TargetReport] | None = None) -> dict[str, Any]:
        """The JSON form; `targets` restricts it to some targets (a per-target quantkit.json)."""
        data: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        for f in fields(self):
            data[f.name] = getattr(self, f.name)
        data["model"] = asdict(self.model)
        data["targets"] = [t.to_dict() for t in (self.targets if targets is None else targets)]
        return data


# ---------------------------------------------------------------- model card


def kept_summary(kept: dict[str, str]) -> str:
    """One line: how many layers a rule kept 16-bit (a width the format cannot tile, a shard vLLM fuses with a
    16-bit one), why, and the first few."""
    reasons = sorted({"vLLM fuses them with a 16-bit shard" if "fuses it" in why else
                      "their widths do not tile in the format" for why in kept.values()})
    names = sorted(kept)
    return f"{len(kept)} layer(s) ({'; '.join(reasons)}): {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}"


LIBRARIES = {"gguf": "gguf", "mlx": "mlx"}  # the model card's library_name by artifact kind


def model_card(target: TargetReport, report: RunReport) -> str:
    """README.md with YAML front matter (base_model, tags, quantization) and the gate table."""
    import yaml

    base_model = report.model.path
    front = {
        "base_model": base_model,
        "library_name": LIBRARIES.get(get_method(target.method).artifact, "transformers"),
        "tags": ["quantkit", "quantized", target.method, *format_tags(target.format)],
        "quantization": {"method": target.method, "format": target.format, "engine": target.engine,
                         "options": target.options},
    }
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", ""]
    lines += [f"# {Path(base_model).name} — {target.name} ({target.method})", ""]
    lines += [f"Quantized with quantkit {report.quantkit_version} from `{base_model}`.", ""]
    lines += gate_section(target.gate)
    lines += tasks_section(target.tasks)
    lines += ["", "Kept in 16-bit: " + ", ".join(target.kept or ["(none)"]), ""]
    if target.details.get("kept_16bit"):
        lines += [f"Also kept 16-bit: {kept_summary(target.details['kept_16bit'])} (each with its reason in "
                  "quantkit.json, `details.kept_16bit`).", ""]
    lines += [f"Chosen for this model: {option} {why}." for option, why in target.details.get("choices", {}).items()]
    lines += mixed_lines(target.details)
    lines += tower_section(report.model.towers, target.details.get("towers"))
    lines += serving_section(target.details.get("serving"), base_model)
    lines += ["Produced by `quantkit quantize`; the full record is in `quantkit.json`.", ""]
    return "\n".join(lines)


def serving_section(plan: dict | None, base_model: str) -> list[str]:
    """This artifact's line of the serving plan (quantkit.run.serving.artifact_plan) and its serve command."""
    if not plan:
        return []
    by_verdict: dict[str, list[str]] = {}
    for device, fit in plan["devices"].items():
        where = f"{device} ({fit['runtime']})" if fit["runtime"] and fit["verdict"] != "too small" else device
        by_verdict.setdefault(fit["verdict"], []).append(where)
    parts = [f"{verdict}: {', '.join(devices)}" for verdict, devices in by_verdict.items()]
    return ["## Serving", "",
            f"{size_text(plan['weights_bytes'])} on disk, fp16 KV cache {size_text(plan['kv_cache_bytes'])} for "
            f"{plan['context']} tokens; " + "; ".join(parts) + f". Other devices and contexts: `quantkit plan {base_model}`.",
            "", f"From this directory: `{plan['serve']}`", ""]


def size_text(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


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
    return lines + ([""] if lines else [])


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


def format_tags(fmt: str) -> list[str]:
    markers = (("compressed-tensors", "compressed-tensors"), ("GGUF", "gguf"), ("bitsandbytes", "bitsandbytes"),
               ("MLX", "mlx"))
    return [tag for marker, tag in markers if marker in fmt]


def gate_section(gate: GateResult | None) -> list[str]:
    if gate is None or not gate.checks:
        return ["Quality: not measured."]
    verdict = f"Verdict: **{'PASS' if gate.passed else 'FAIL'}**" + ("" if gate.enforced else " (not enforced: --no-gate)")
    lines = ["## Quality gate", "", verdict, "", "| metric | value | threshold | ok |", "|---|---|---|---|"]
    for check in gate.checks:
        lines.append(f"| {check.name} | {check.value:.6g} | {threshold_text(check)} | {'yes' if check.passed else 'NO'} |")
    return lines


def tasks_section(tasks: list[dict]) -> list[str]:
    """Task accuracy of the artifact against the base (lm-evaluation-harness, offline data)."""
    if not tasks:
        return []
    lines = ["", "## Task accuracy", "", "lm-evaluation-harness on local data; recovery = artifact / base.", "",
             "| task | metric | samples | base | artifact | recovery | min | ok |", "|---|---|---|---|---|---|---|---|"]
    for r in tasks:
        lines.append(f"| {r['task']} | {r['metric']} | {r['samples']} | {stat_text(r['base'], r['base_stderr'])} | "
                     f"{stat_text(r['score'], r['stderr'])} | {r['recovery']:.3f} | {r['min_recovery']:g} | "
                     f"{'yes' if r['passed'] else 'NO'} |")
    return lines


def stat_text(value: float, stderr: float | None) -> str:
    return f"{value:.4f}" + ("" if stderr is None else f" ± {stderr:.4f}")


def threshold_text(check) -> str:
    return "—" if check.threshold is None else f"{check.op} {check.threshold:g}"


# ---------------------------------------------------------------- CI job summary


STATUS_TEXT = {"passed": "passed", "failed": "FAILED", "error": "ERROR", "skipped": "skipped (up to date)"}


def summary_markdown(report: RunReport, out: Path) -> str:
    """A Markdown gate table of the run, one row per target (for $GITHUB_STEP_SUMMARY)."""
    lines = [f"### quantkit: {Path(report.model.path).name} → `{out}`", "",
             "| target | method | status | ppl base | ppl | Δppl | KLD mean | top-1 | gate | written |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for t in report.targets:
        lines.append(f"| {t.name} | {t.method} | {STATUS_TEXT.get(t.status, t.status)} | {metric_cells(t)} | "
                     f"{gate_cell(t)} | {written_cell(t)} |")
    errors = [t for t in report.targets if t.error]
    if errors:
        lines += ["", *(f"- **{t.name}**: {markdown_text(t.error)}" for t in errors)]
    return "\n".join(lines) + "\n"


def metric_cells(target: TargetReport) -> str:
    m = target.metrics
    if m is None:
        return " | ".join(["—"] * 5)
    return f"{m.ppl_base:.3f} | {m.ppl:.3f} | {m.ppl_increase:+.2%} | {m.kld_mean:.5f} | {m.top1:.2%}"


def gate_cell(target: TargetReport) -> str:
    gate = target.gate
    if gate is None:
        return "not measured"
    if gate.passed:
        return "PASS" if gate.enforced else "pass (not enforced)"
    return ("FAIL: " if gate.enforced else "fail (not enforced): ") + ", ".join(gate.failed)


def written_cell(target: TargetReport) -> str:
    if target.status == "skipped":
        return "kept"
    return "yes" if target.written else "no"


def markdown_text(text: str) -> str:
    """One line, safe inside a Markdown list item or table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def package_version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None
