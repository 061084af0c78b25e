"""scripts/bench_model_free_moe.py: the table it prints from a run's JSON (the run itself is a benchmark)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_model_free_moe.py"


def test_render_prints_each_run_against_the_model(tmp_path):
    run = {"kind": "deepseek_v3", "experts": 8, "model_bytes": 100 * 2**20, "shards": 1, "largest_shard_bytes": 100 * 2**20,
           "cores": 2, "rows": [{"scheme": "mxfp4", "tool": "quantkit", "wall_s": 4.0, "peak_rss": 50 * 2**20,
                                 "artifact_bytes": 30 * 2**20}]}
    (tmp_path / "run.json").write_text(json.dumps(run))
    out = subprocess.run([sys.executable, str(SCRIPT), "--render", str(tmp_path / "run.json")], capture_output=True,
                         text=True, check=True).stdout
    assert "100 MiB of bf16 weights in 1 shard(s)" in out
    assert "| mxfp4 | quantkit | 4.0 | 50 | 0.50 | 30 |" in out
