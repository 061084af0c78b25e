"""The run report: typed records shared by the table printer, `quantkit.json` and the model card.

`RunReport.to_dict()` is what `quantkit.json` holds (and `--json` prints); `SCHEMA_VERSION`
changes whenever a field is renamed or removed, so CI scripts can check what they read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quantkit.evaluate import GateResult, Metrics

SCHEMA_VERSION = 1


@dataclass
class ModelReport:
    path: str
    architecture: str
    model_type: str
    parameters: int
    dtype: str
    sha256: dict[str, str]  # weight file name -> digest


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
    timings: dict[str, float] = field(default_factory=dict)
    peak_rss_bytes: int = 0  # the larger of the steps below
    peak_rss_by_step: dict[str, int] = field(default_factory=dict)  # "quantize", "eval"

    @property
    def failed_enforced_gate(self) -> bool:
        return self.gate is not None and self.gate.enforced and not self.gate.passed

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("metrics", "gate")}
        data["metrics"] = self.metrics.as_dict() if self.metrics else None
        data["gate"] = self.gate.as_dict() if self.gate else None
        return data


@dataclass
class RunReport:
    quantkit_version: str
    versions: dict[str, str | None]
    recipe: dict[str, Any]
    model: ModelReport
    calibration: dict[str, Any]
    gate_enforced: bool
    timings: dict[str, float] = field(default_factory=dict)
    baseline: dict[str, Any] | None = None
    targets: list[TargetReport] = field(default_factory=list)
    passed: bool | None = None  # None: nothing was measured
    merge: dict[str, Any] | None = None  # LoRA merge (quantkit.lora.MergeReport) when adapters were merged

    def to_dict(self, targets: list[TargetReport] | None = None) -> dict[str, Any]:
        """The JSON form; `targets` restricts it to some targets (a per-target quantkit.json)."""
        data: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        for f in fields(self):
            data[f.name] = getattr(self, f.name)
        data["model"] = asdict(self.model)
        data["targets"] = [t.to_dict() for t in (self.targets if targets is None else targets)]
        return data


# ---------------------------------------------------------------- model card


def model_card(target: TargetReport, report: RunReport) -> str:
    """README.md with YAML front matter (base_model, tags, quantization) and the gate table."""
    import yaml

    base_model = report.model.path
    front = {
        "base_model": base_model,
        "library_name": "gguf" if target.method == "gguf" else "transformers",
        "tags": ["quantkit", "quantized", target.method, *format_tags(target.format)],
        "quantization": {"method": target.method, "format": target.format, "engine": target.engine,
                         "options": target.options},
    }
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", ""]
    lines += [f"# {Path(base_model).name} — {target.name} ({target.method})", ""]
    lines += [f"Quantized with quantkit {report.quantkit_version} from `{base_model}`.", ""]
    lines += gate_section(target.gate)
    lines += ["", "Kept in 16-bit: " + ", ".join(target.kept or ["(none)"]), ""]
    lines += ["Produced by `quantkit quantize`; the full record is in `quantkit.json`.", ""]
    return "\n".join(lines)


def format_tags(fmt: str) -> list[str]:
    markers = (("compressed-tensors", "compressed-tensors"), ("GGUF", "gguf"), ("bitsandbytes", "bitsandbytes"))
    return [tag for marker, tag in markers if marker in fmt]


def gate_section(gate: GateResult | None) -> list[str]:
    if gate is None or not gate.checks:
        return ["Quality: not measured."]
    verdict = f"Verdict: **{'PASS' if gate.passed else 'FAIL'}**" + ("" if gate.enforced else " (not enforced: --no-gate)")
    lines = ["## Quality gate", "", verdict, "", "| metric | value | threshold | ok |", "|---|---|---|---|"]
    for check in gate.checks:
        lines.append(f"| {check.name} | {check.value:.6g} | {threshold_text(check)} | {'yes' if check.passed else 'NO'} |")
    return lines


def threshold_text(check) -> str:
    return "—" if check.threshold is None else f"{check.op} {check.threshold:g}"
