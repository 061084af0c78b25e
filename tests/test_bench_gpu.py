"""scripts/bench_gpu.py --device cpu on a tiny model (slow): every row runs, quantkit and the bare peer write
the same scheme (artifacts of the same size), and the gate rows time the same work three ways."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.util import REPO, subprocess_env


@pytest.mark.slow
def test_bench_gpu_on_the_cpu(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_gpu.py"), "--device", "cpu", "--methods", "gptq,fp8",
           "--num-samples", "16", "--seq-len", "64", "--eval-windows", "4", "--work", str(tmp_path / "work"),
           "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| method | tool | wall s | phases s | peak GPU MiB |" in done.stdout
    rows = json.loads(out.read_text())
    assert [(r["method"], r["tool"]) for r in rows] == [
        ("gptq", "bare llm-compressor"), ("gptq", "quantkit"), ("fp8", "bare llm-compressor"), ("fp8", "quantkit"),
        ("gate", "two plain transformers forwards"), ("gate", "quantkit gate, resident"),
        ("gate", "quantkit gate, streamed")]
    assert all(r["exit_code"] == 0 and r["ratio"] > 0 for r in rows)
    by = {(r["method"], r["tool"]): r for r in rows}
    for method in ("gptq", "fp8"):
        ours, bare = by[(method, "quantkit")], by[(method, "bare llm-compressor")]
        assert abs(ours["bytes"] - bare["bytes"]) / bare["bytes"] < 0.01  # the same scheme on both sides
        assert set(ours["phases"]) == {"baseline_s", "quantize_s", "eval_s"}
        assert set(bare["phases"]) == {"load_s", "oneshot_s", "save_s"}
    assert by[("fp8", "quantkit")]["gate"] is True  # resident on the CPU for a model this small
    for mode in ("resident", "streamed"):
        assert set(by[("gate", f"quantkit gate, {mode}")]["phases"]) == {"baseline_s", "eval_s", "gate_s"}
