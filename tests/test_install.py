"""Installed like a user would: the wheel in a fresh virtual environment (no editable install)
finds its bundled recipes and calibration text."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_runs_bundled_recipe_and_text(micro_model, tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
                   check=True, capture_output=True, text=True)
    venv = tmp_path / "venv"
    # system site packages: the dependencies (torch, transformers, ...) are reused, not reinstalled;
    # quantkit itself comes only from the wheel
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    wheel = next(wheels.glob("quantkit-*.whl"))
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True, capture_output=True)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(py), *args], capture_output=True, text=True, cwd=tmp_path, timeout=600)

    where = run("-c", "import quantkit; print(quantkit.__file__)")
    assert str(venv) in where.stdout, where.stdout + where.stderr  # not the source checkout
    listed = run("-m", "quantkit", "recipes", "list")
    assert listed.returncode == 0 and "fp8-dynamic" in listed.stdout, listed.stderr
    out = tmp_path / "fp8"
    result = run("-m", "quantkit", "quantize", str(micro_model), "--recipe", "fp8-dynamic", "-o", str(out),
                 "--calib", "prose", "--seq-len", "64", "--eval-windows", "2", "--min-top1", "0.5")
    assert result.returncode == 0, result.stderr
    assert (out / "quantkit.json").is_file()
