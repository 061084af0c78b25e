"""scripts/bench_resident.py: what it reads from quantkit's output, and (slow) a run of its rows on a tiny shape."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.util import REPO, subprocess_env

sys.path.insert(0, str(REPO / "scripts"))


def test_the_placement_line_and_its_estimate_are_read_from_the_log(tmp_path):
    import bench_resident

    log = tmp_path / "run.log"
    log.write_text("warning: --no-gate\n· gate: resident on cpu, batch 8, the base scored beside each artifact "
                   "(peak about 1.46 GiB; 21.51 GiB available now, less 10% headroom: 19.36 GiB)\n· baseline: ...\n")
    line = bench_resident.placement_line(log)
    assert line.startswith("gate: resident on cpu") and bench_resident.estimated_peak(line) == pytest.approx(1495.04)
    streamed = "forwards: streamed on cpu, 8.0 MiB per layer (resident the run would peak at about 830.0 MiB; x)"
    assert bench_resident.estimated_peak(streamed) == 830.0
    assert bench_resident.estimated_peak("gate: streamed on cpu") is None


def test_the_reference_run_is_the_one_docs_shows(capsys):
    """docs/benchmarks.md's tables are the rendering of docs/bench_resident_reference.json, row for row."""
    import bench_resident

    for case in json.loads((REPO / "docs" / "bench_resident_reference.json").read_text()):
        bench_resident.print_case(case)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    page = (REPO / "docs" / "benchmarks.md").read_text()
    assert len(rows) > 12 and [row for row in rows if row not in page] == []


@pytest.mark.slow
def test_bench_resident_rows_on_a_tiny_shape(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_resident.py"), "--cases", "t", "--work", str(tmp_path),
           "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| run | wall s | ratio | peak RSS MiB |" in done.stdout
    rows = {r["row"]: r for r in json.loads(out.read_text())[0]["rows"]}
    assert set(rows) == {"two plain transformers forwards", "quantkit eval (after)",
                         "bare llm-compressor fp8 + two plain forwards", "quantkit fp8 (after)"}
    assert all(r["exit_code"] == 0 for r in rows.values())
    assert rows["quantkit eval (after)"]["placement"].startswith("forwards: resident on cpu")
    fp8 = rows["quantkit fp8 (after)"]
    assert fp8["estimated_steps_mib"]["fixed"] > 0 and fp8["written_mb"] <= 1.1 * fp8["artifact_mb"] + 1
