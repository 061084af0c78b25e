"""serve-check's result in the artifact's quantkit.json: `serve_check.<engine>`, written atomically."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from quantkit.io.export import replace_json

# The report's fields kept in quantkit.json (the rest: --json).
RECORDED = ("engine", "windows", "base_from", "logprobs", "vs_base", "vs_reading", "reading_vs_base",
            "reading_vs_base_kld", "ppl", "ppl_base", "ppl_reading", "ppl_compared", "greedy", "load", "tolerances", "tokenization",
            "checks", "passed", "failed")


def report_path(artifact: Path) -> Path:
    """quantkit.json beside the artifact: in its directory, or beside a .gguf file."""
    artifact = Path(artifact)
    return (artifact if artifact.is_dir() else artifact.parent) / "quantkit.json"


def entry(result: dict, when: datetime | None = None) -> dict:
    """What is recorded of a result (ServeReport.as_dict()), with the time it was measured."""
    kept = {name: result[name] for name in RECORDED if name in result}
    return {**kept, "checked_at": (when or datetime.now(timezone.utc)).isoformat(timespec="seconds")}


def record_result(path: Path, result: dict) -> bool:
    """Set serve_check[<engine name>] in an existing quantkit.json (temporary file, then os.replace);
    False when there is no quantkit.json."""
    if not path.is_file():
        return False
    data = json.loads(path.read_text())
    checks = data.get("serve_check") if isinstance(data.get("serve_check"), dict) else {}
    data["serve_check"] = {**checks, result["engine"]["name"]: entry(result)}
    replace_json(path, data)
    return True
