"""gate.serve (recipe) / --serve-check (quantize): the staged artifact checked in its serving engine before it
is published; a failed check is a failed gate (exit 3, nothing written); a missing engine is exit 2 before
any work. The engine is faked here (tests/serve/test_serve_check_slow.py runs the real ones)."""

from __future__ import annotations

import json

import pytest

from quantkit.errors import UnsupportedError
from quantkit.eval.evaluate import Check
from tests.util import FAST_CALIB, leftovers


class FakeReport:
    def __init__(self, passed: bool):
        self.passed, self.engine = passed, {"name": "vllm", "version": "0.32.0"}
        self.checks = [Check("reading_kld", 0.001 if passed else 0.5, 0.02, "<=", passed)]
        self.failed = [] if passed else ["reading_kld"]

    def as_dict(self) -> dict:
        return {"engine": self.engine, "passed": self.passed, "failed": self.failed}


@pytest.fixture
def fake_engine(monkeypatch):
    """serve_check returns FakeReport(passed) and records what it was given; every engine is 'installed'."""
    from quantkit.serve import check

    calls, verdict = [], {"passed": True}

    def fake_check(artifact, base_dir, windows, engine="auto", **kwargs):
        calls.append({"artifact": artifact, "windows": tuple(windows.shape), "engine": engine, **kwargs})
        assert (artifact / "config.json").is_file()  # the staged artifact, before it is published
        return FakeReport(verdict["passed"])

    monkeypatch.setattr(check, "serve_check", fake_check)
    monkeypatch.setattr(check, "prepare", lambda artifact, engine="auto": ("compressed-tensors", None, None))
    monkeypatch.setattr(check, "pick_engine", lambda kind, name: None)
    return calls, verdict


def test_a_passing_serving_check_is_recorded(cli, micro_model, tmp_path, fake_engine):
    calls, _ = fake_engine
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "fp8", "-o", out, *FAST_CALIB, "--serve-check", "vllm")
    assert result.exit_code == 0, result.output
    assert calls[0]["engine"] == "vllm" and calls[0]["windows"] == (4, 64)  # the gate's 4 held-out windows
    assert calls[0]["tolerances"].max_base_kld == 0.01  # the gate's own max_kld for fp8
    entry = json.loads((out / "quantkit.json").read_text())["targets"][0]
    assert entry["details"]["serve_check"]["passed"] is True
    assert any(c["name"] == "serve" and c["passed"] for c in entry["gate"]["checks"])
    assert "serving check: vllm agrees with the gate" in result.stderr


def test_a_failed_serving_check_fails_the_gate(cli, micro_model, tmp_path, fake_engine):
    _, verdict = fake_engine
    verdict["passed"] = False
    result = cli("quantize", micro_model, "--method", "fp8", "-o", tmp_path / "out", *FAST_CALIB, "--serve-check", "auto")
    assert result.exit_code == 3, result.output
    assert "reading_kld 0.5 (needs <= 0.02)" in result.stderr and "serve" in result.stderr
    assert leftovers(tmp_path, "out") == []


def test_the_recipe_serve_block_sets_the_tolerances(cli, micro_model, tmp_path, fake_engine):
    calls, _ = fake_engine
    recipe = tmp_path / "r.yaml"
    recipe.write_text("targets:\n  - {name: fp8, method: fp8}\n"
                      "gate:\n  serve: {engine: vllm, windows: 2, max_reading_kld: 0.05, max_base_kld: 0.2}\n")
    result = cli("quantize", micro_model, "--recipe", recipe, "-o", tmp_path / "out", *FAST_CALIB)
    assert result.exit_code == 0, result.output
    assert calls[0]["windows"] == (2, 64)
    assert calls[0]["tolerances"].max_reading_kld == 0.05 and calls[0]["tolerances"].max_base_kld == 0.2


def test_a_missing_engine_is_refused_before_any_work(cli, micro_model, tmp_path, monkeypatch):
    from quantkit.serve import check

    def missing(kind, name):
        raise UnsupportedError("vLLM is not installed", hint="scripts/setup_engines.sh")

    monkeypatch.setattr(check, "pick_engine", missing)
    result = cli("quantize", micro_model, "--method", "fp8", "-o", tmp_path / "out", *FAST_CALIB, "--serve-check", "vllm")
    assert result.exit_code == 2 and "vLLM is not installed" in result.stderr
    assert "baseline" not in result.stderr and leftovers(tmp_path, "out") == []


def test_an_unknown_engine_in_a_recipe_names_the_field(cli, micro_model, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("targets:\n  - {name: fp8, method: fp8}\ngate:\n  serve: {engine: tgi}\n")
    result = cli("quantize", micro_model, "--recipe", recipe, "-o", tmp_path / "out")
    assert result.exit_code == 2 and "gate.serve.engine" in result.stderr


def test_a_serving_check_without_held_out_windows_is_refused_before_any_work(cli, micro_model, tmp_path, fake_engine):
    calls, _ = fake_engine
    result = cli("quantize", micro_model, "--method", "fp8", "-o", tmp_path / "out", "--num-samples", "4",
                 "--seq-len", "64", "--eval-windows", "0", "--serve-check", "vllm")
    assert result.exit_code == 2, result.output
    assert "eval_windows is 0" in result.stderr and "--eval-windows" in result.stderr
    assert calls == [] and "baseline" not in result.stderr and leftovers(tmp_path, "out") == []


def test_a_serving_check_runs_under_no_gate_when_the_gate_fails(cli, micro_model, tmp_path, fake_engine):
    """--no-gate writes an artifact whose gate failed, so the check it asked for runs on it."""
    calls, _ = fake_engine
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "fp8", "-o", out, *FAST_CALIB, "--max-kld", "0",
                 "--no-gate", "--serve-check", "vllm")
    assert result.exit_code == 0, result.output
    entry = json.loads((out / "quantkit.json").read_text())["targets"][0]
    assert entry["gate"]["passed"] is False and len(calls) == 1
    assert entry["details"]["serve_check"]["passed"] is True


def test_a_serving_check_after_an_enforced_failed_gate_says_it_did_not_run(cli, micro_model, tmp_path, fake_engine):
    calls, _ = fake_engine
    result = cli("quantize", micro_model, "--method", "fp8", "-o", tmp_path / "out", *FAST_CALIB, "--max-kld", "0",
                 "--serve-check", "vllm", "--json", tmp_path / "r.json")
    assert result.exit_code == 3, result.output
    assert calls == [] and "serving check not run: the gate failed (kld_mean" in result.stderr
    entry = json.loads((tmp_path / "r.json").read_text())["targets"][0]
    assert entry["details"]["serve_check"]["skipped"].startswith("not run: the gate failed")
