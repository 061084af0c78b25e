"""Same inputs, options and seed give byte-identical artifacts (the model card and quantkit.json carry
timings and are left out)."""

from __future__ import annotations

import hashlib

import pytest

CALIB = ("--num-samples", "16", "--seq-len", "64", "--eval-windows", "4", "--no-gate")


def digests(out) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())
            if p.is_file() and p.name not in ("quantkit.json", "README.md")}


@pytest.mark.parametrize("method, options", [  # fp8 in the fast suite; the longer two with -m slow
    pytest.param("gguf", ("--gguf-type", "Q4_K_M", "--auto-precision"), marks=pytest.mark.slow),
    pytest.param("gptq", (), marks=pytest.mark.slow), ("fp8", ())])
def test_two_runs_write_the_same_bytes(cli, odd_model, tmp_path, method, options):
    runs = []
    for name in ("first", "second"):
        result = cli("quantize", odd_model, "--method", method, *options, *CALIB, "-o", tmp_path / name)
        assert result.exit_code == 0, result.output
        runs.append(digests(tmp_path / name))
    assert runs[0] and runs[0] == runs[1]
    assert any(name.endswith((".gguf", ".safetensors")) for name in runs[0])
