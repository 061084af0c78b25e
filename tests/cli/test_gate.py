"""The quality gate through `quantkit quantize` and `quantkit eval`."""

import json

import pytest

from tests.util import FAST_CALIB, leftovers


def test_impossible_gate_blocks_export(cli, micro_model, tmp_path):
    report_file = tmp_path / "report.json"
    result = cli("quantize", micro_model, "--method", "fp8", "-o", tmp_path / "out", *FAST_CALIB,
                 "--max-kld", "0", "--min-top1", "1.0", "--json", report_file)
    assert result.exit_code == 3, result.output
    assert "quality gate failed" in result.stderr and "FAIL" in result.stdout
    assert leftovers(tmp_path, "out") == []
    report = json.loads(report_file.read_text())
    gate = report["targets"][0]["gate"]
    assert not gate["passed"] and "kld_mean" in gate["failed"]
    assert {c["name"]: c["threshold"] for c in gate["checks"]}["kld_mean"] == 0


def test_loose_gate_passes(cli, micro_model, tmp_path):
    result = cli("quantize", micro_model, "--method", "fp8", "-o", tmp_path / "out", *FAST_CALIB,
                 "--max-kld", "1", "--min-top1", "0.1", "--max-ppl-increase", "1")
    assert result.exit_code == 0, result.output
    assert "PASS" in result.stdout


def test_no_gate_is_recorded_and_warned(cli, micro_model, tmp_path):
    result = cli("quantize", micro_model, "--method", "fp8", "-o", tmp_path / "out", *FAST_CALIB,
                 "--max-kld", "0", "--no-gate")
    assert result.exit_code == 0, result.output
    assert "--no-gate" in result.stderr
    report = json.loads((tmp_path / "out" / "quantkit.json").read_text())
    assert report["gate_enforced"] is False
    assert report["targets"][0]["gate"]["enforced"] is False and not report["targets"][0]["gate"]["passed"]
    assert "not enforced" in (tmp_path / "out" / "README.md").read_text()


def test_baseline_is_computed_once_for_several_targets(cli, micro_model, tmp_path, monkeypatch):
    from quantkit.eval import evaluate

    calls = []
    real = evaluate.compute_baseline

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate, "compute_baseline", counting)
    recipe = tmp_path / "multi.yaml"
    recipe.write_text("targets:\n  - {name: dyn, method: fp8}\n"
                      "  - {name: static, method: fp8, options: {scheme: fp8-static}}\n")
    out = tmp_path / "dist"
    result = cli("quantize", micro_model, "--recipe", recipe, "-o", out, *FAST_CALIB)
    assert result.exit_code == 0, result.output
    assert len(calls) == 1
    report = json.loads((out / "quantkit.json").read_text())
    assert [t["name"] for t in report["targets"]] == ["dyn", "static"]
    for name in ("dyn", "static"):
        assert (out / name / "model.safetensors").is_file() and (out / name / "README.md").is_file()


def test_eval_identical_model_is_exact(cli, micro_model, tmp_path):
    result = cli("eval", micro_model, "--against", micro_model, "--num-windows", "3", "--seq-len", "64",
                 "--json", tmp_path / "m.json")
    assert result.exit_code == 0, result.output
    metrics = json.loads((tmp_path / "m.json").read_text())["metrics"]
    assert metrics["kld_mean"] == 0.0 and metrics["top1"] == 1.0 and metrics["ppl_increase"] == 0.0


def damage(model_dir, factor: float) -> None:
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    state = load_file(path)
    state = {k: (v * factor if "mlp" in k else v) for k, v in state.items()}
    save_file(state, path, metadata={"format": "pt"})


def test_eval_catches_a_damaged_model(cli, micro_model, model_copy):
    damage(model_copy, 1.8)
    result = cli("eval", model_copy, "--against", micro_model, "--num-windows", "3", "--seq-len", "64",
                 "--max-kld", "0.02", "--min-top1", "0.9")
    assert result.exit_code == 3, result.output
    assert "fails the gate" in result.stderr


def test_eval_compressed_tensors_artifact_finds_its_base(cli, micro_model, tmp_path):
    out = tmp_path / "fp8"
    assert cli("quantize", micro_model, "--method", "fp8", "-o", out, *FAST_CALIB).exit_code == 0
    result = cli("eval", out, "--num-windows", "3", "--seq-len", "64", "--json", "-")
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    assert row["kind"] == "compressed-tensors" and 0 < row["metrics"]["kld_mean"] < 0.05


def test_eval_needs_a_base(cli, model_copy):
    result = cli("eval", model_copy)
    assert result.exit_code == 2 and "--against" in result.stderr


@pytest.mark.parametrize("args", [("--against", "/nonexistent/base"), ()])
def test_eval_missing_artifact(cli, tmp_path, args):
    result = cli("eval", tmp_path / "missing", *args)
    assert result.exit_code == 2


# a compressed-tensors artifact evaluated fast: test_eval_compressed_tensors_artifact_finds_its_base
@pytest.mark.parametrize("method,kind", [pytest.param("gptq", "compressed-tensors", marks=pytest.mark.slow),
                                         ("nf4", "bitsandbytes")])
def test_eval_every_artifact_kind(cli, micro_model, tmp_path, method, kind):
    out = tmp_path / method
    result = cli("quantize", micro_model, "--method", method, "-o", out, "--num-samples", "16", "--seq-len", "64",
                 "--eval-windows", "3", "--min-top1", "0")
    assert result.exit_code == 0, result.output
    written = json.loads((out / "quantkit.json").read_text())["targets"][0]["metrics"]
    result = cli("eval", out, "--num-windows", "3", "--seq-len", "64", "--json", "-")
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    assert row["kind"] == kind
    # same held-out windows (same source, seq_len and seed) -> the same numbers as the gate's
    assert row["metrics"]["kld_mean"] == pytest.approx(written["kld_mean"], rel=1e-6)
    assert row["metrics"]["top1"] == written["top1"]
