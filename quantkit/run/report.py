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
    hub: dict[str, Any] | None = None  # fetched from the Hub: repo_id, revision, sha, endpoint, files (quantkit.io.hub)
    license: dict[str, str] | None = None  # the base's card: license (license_name, license_link for "other")


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
    push: dict[str, Any] | None = None  # pushed by this run: repo, subfolder, commit_url, commit (quantkit.run.push)

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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunReport":
        """A report read back from a quantkit.json (fields it lacks get their defaults)."""
        names = {f.name for f in fields(cls)} - {"model", "targets"}
        model_names = {f.name for f in fields(ModelReport)}
        report = cls(**{k: v for k, v in data.items() if k in names},
                     model=ModelReport(**{k: v for k, v in data["model"].items() if k in model_names}))
        report.targets = [TargetReport.from_dict(t) for t in data.get("targets", [])]
        return report


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
