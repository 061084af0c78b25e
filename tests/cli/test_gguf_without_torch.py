"""A GGUF conversion without imatrix and without evaluation imports neither torch nor transformers:
the whole CLI run, in a fresh interpreter, on the tiny local models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = """
import json, sys
from quantkit.cli.app import main
sys.argv = ["quantkit", *json.loads(sys.argv[1])]
try:
    main()
    code = 0
except SystemExit as exc:
    code = exc.code
print("LOADED", json.dumps({"exit": code, "heavy": [m for m in ("torch", "transformers") if m in sys.modules]}))
"""


def run_cli(*args) -> dict:
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps([str(a) for a in args])], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("LOADED ")), None)
    assert line is not None, done.stdout + done.stderr
    return json.loads(line[len("LOADED "):])


@pytest.mark.parametrize("fixture", [pytest.param("micro_model", marks=pytest.mark.slow), "odd_model"])
def test_gguf_conversion_imports_no_torch(fixture, request, tmp_path):
    model = request.getfixturevalue(fixture)
    out = tmp_path / "gguf"
    result = run_cli("quantize", model, "--method", "gguf", "--gguf-type", "Q4_K_M", "--imatrix", "none",
                     "--eval-windows", "0", "-o", out, "--quiet")
    assert result == {"exit": 0, "heavy": []}
    assert len(list(out.glob("*-Q4_K_M.gguf"))) == 1 and (out / "quantkit.json").is_file()
