"""scripts/bench_auto.py: the docs' tables are the rendering of its reference run, and (slow) a run of the script."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.util import REPO, subprocess_env

sys.path.insert(0, str(REPO / "scripts"))


def test_the_reference_run_is_the_one_docs_shows():
    """docs/benchmarks.md's tables are the rendering of docs/bench_auto_reference.json and bench_auto_262k.json."""
    import bench_auto

    page = (REPO / "docs" / "benchmarks.md").read_text()
    for name in ("bench_auto_reference.json", "bench_auto_262k.json"):
        data = json.loads((REPO / "docs" / name).read_text())
        rows = [line for line in bench_auto.render(data).splitlines() if line.startswith("| ") and "---" not in line]
        assert len(rows) > 30 and [row for row in rows if row not in page] == []


@pytest.mark.slow
def test_bench_auto_on_the_micro_model(micro_model, tmp_path):
    import shutil

    model = shutil.copytree(micro_model, tmp_path / "micro")  # --pad-vocab writes its padded copy beside it
    out = tmp_path / "auto.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_auto.py"), str(model), "--for", "transformers",
           "--num-samples", "4", "--eval-windows", "4", "--seq-len", "32", "--max-kld", "1", "--pad-vocab", "1024",
           "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env())
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(out.read_text())["rows"][0]
    assert row["chosen"] == "bitsandbytes nf4" == row["smallest_passing_alone"]
    assert [a["candidate"] for a in row["alone"]] == ["bitsandbytes nf4", "bitsandbytes int8"]
    assert "| `transformers` |" in done.stdout
    assert json.loads((tmp_path / "micro-vocab1024" / "config.json").read_text())["vocab_size"] == 1024
