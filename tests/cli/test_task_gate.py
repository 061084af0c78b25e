"""Task accuracy in the gate (lm-evaluation-harness, offline) through `quantkit quantize` and `quantkit eval`,
on the micro model's artifacts and a local multiple-choice task built from the bundled text."""

from __future__ import annotations

import json

import pytest

from tests.util import FAST_CALIB, leftovers

pytest.importorskip("lm_eval", reason="task accuracy runs through lm-eval (pip install 'quantkit[eval]')")

LIMIT = ("--limit", "4")


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    from quantkit.toy import make_continuation_task

    return make_continuation_task(tmp_path_factory.mktemp("task"), samples=40)


def test_task_regression_blocks_export(cli, micro_model, task_file, tmp_path):
    """An impossible recovery (1.5 x the base's accuracy) fails the gate: exit 3, nothing written,
    the scores in the report."""
    report_file = tmp_path / "report.json"
    result = cli("quantize", micro_model, "--method", "fp8", "-o", tmp_path / "out", *FAST_CALIB, "--max-kld", "1",
                 "--min-top1", "0", "--task-file", task_file, *LIMIT, "--min-recovery", "1.5", "--json", report_file)
    assert result.exit_code == 3, result.output
    assert "task:quantkit_continuation/acc" in result.stderr
    assert leftovers(tmp_path, "out") == []
    target = json.loads(report_file.read_text())["targets"][0]
    (task,) = target["tasks"]
    assert task["samples"] == 4 and task["metric"] == "acc" and task["min_recovery"] == 1.5 and not task["passed"]
    assert task["recovery"] == pytest.approx(task["score"] / task["base"] if task["base"] else 1.0)
    assert "task accuracy" in result.stdout


def test_missing_task_data_is_exit_2_before_any_work(cli, micro_model, tmp_path):
    from quantkit.toy import make_continuation_task

    path = make_continuation_task(tmp_path / "task", samples=4)
    path.with_suffix(".jsonl").unlink()
    result = cli("quantize", micro_model, "--method", "fp8", "-o", tmp_path / "out", *FAST_CALIB,
                 "--task-file", path)
    assert result.exit_code == 2, result.output
    assert "task 'quantkit_continuation': its data is not available offline" in result.stderr
    assert "baseline" not in result.stderr and leftovers(tmp_path, "out") == []


def test_limit_needs_tasks(cli, micro_model, tmp_path):
    result = cli("eval", micro_model, "--against", micro_model, "--limit", "3")
    assert result.exit_code == 2 and "--limit" in result.stderr


@pytest.mark.slow
def test_task_gate_passes_into_report_and_model_card(cli, micro_model, task_file, tmp_path):
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "fp8", "-o", out, *FAST_CALIB, "--max-kld", "1",
                 "--min-top1", "0", "--task-file", task_file, *LIMIT, "--min-recovery", "0")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "quantkit.json").read_text())
    (task,) = report["targets"][0]["tasks"]
    assert task["passed"] and task["samples"] == 4
    assert "task:quantkit_continuation/acc" in [c["name"] for c in report["targets"][0]["gate"]["checks"]]
    assert report["baseline"]["tasks"] and report["timings"]["baseline_tasks_s"] > 0
    assert "## Task accuracy" in (out / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("method,args,artifact", [
    ("gptq", ("--bits", "4", "--num-samples", "16"), ""),  # GPTQ needs 1024 calibration tokens
    ("gguf", ("--gguf-type", "Q4_K_M"), "gguf"),
    ("nf4", (), ""),
])
def test_eval_scores_tasks_on_every_artifact_kind(cli, micro_model, task_file, tmp_path, method, args, artifact):
    """`quantkit eval --task-file` on compressed-tensors, .gguf (streamed) and bitsandbytes artifacts."""
    if method == "nf4":
        pytest.importorskip("bitsandbytes", reason="nf4 needs bitsandbytes")
    out = tmp_path / method
    made = cli("quantize", micro_model, "--method", method, "-o", out, *FAST_CALIB, *args, "--no-gate")
    assert made.exit_code == 0, made.output
    path = next(out.glob("*.gguf")) if artifact == "gguf" else out
    report_file = tmp_path / "eval.json"
    result = cli("eval", path, "--against", micro_model, "--num-windows", "1", "--seq-len", "32",
                 "--task-file", task_file, *LIMIT, "--min-recovery", "0", "--flip-prompts", "2", "--flip-tokens",
                 "4", "--json", report_file)
    assert result.exit_code == 0, result.output
    report = json.loads(report_file.read_text())
    (task,) = report["tasks"]
    assert task["samples"] == 4 and 0 <= task["score"] <= 1 and task["passed"]
    assert 0 <= report["metrics"]["flips"] <= 1


@pytest.mark.slow
def test_fallback_treats_a_failed_task_like_any_failed_metric(cli, micro_model, task_file, tmp_path):
    report_file = tmp_path / "report.json"
    result = cli("quantize", micro_model, "--method", "fp8", "--fallback", "--max-size", "+5%", "-o",
                 tmp_path / "out", *FAST_CALIB, "--max-kld", "1", "--min-top1", "0", "--task-file", task_file,
                 *LIMIT, "--min-recovery", "1.5", "--json", report_file)
    assert result.exit_code == 3, result.output
    fallback = json.loads(report_file.read_text())["targets"][0]["details"]["fallback"]
    assert len(fallback["steps"]) >= 2 and all("tasks" in step for step in fallback["steps"])


@pytest.mark.slow
def test_a_named_task_without_cached_data_is_exit_2(cli, micro_model, tmp_path, monkeypatch):
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty-cache")  # read at import
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    result = cli("eval", micro_model, "--against", micro_model, "--tasks", "arc_easy")
    assert result.exit_code == 2, result.output
    assert "task 'arc_easy': its data is not available offline" in result.stderr


def test_a_recipe_finds_a_task_of_a_task_file_by_name(cli, micro_model, task_file, tmp_path):
    """gate.tasks names `quantkit_continuation`, the `task:` of the file given with --task-file: one task,
    read from the file, with the recipe's metric and recovery rule."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("targets:\n  - {name: fp8, method: fp8}\n"
                      "gate:\n  tasks: [{name: quantkit_continuation, metric: acc, min_recovery: 1.5}]\n")
    report_file = tmp_path / "report.json"
    result = cli("quantize", micro_model, "--recipe", recipe, "-o", tmp_path / "out", *FAST_CALIB, "--max-kld", "1",
                 "--min-top1", "0", "--task-file", task_file, *LIMIT, "--json", report_file)
    assert result.exit_code == 3, result.output  # the recipe's impossible recovery: the named entry's rule
    (task,) = json.loads(report_file.read_text())["targets"][0]["tasks"]
    assert task["metric"] == "acc" and task["min_recovery"] == 1.5


def test_eval_finds_a_task_of_a_task_file_by_name(cli, micro_model, task_file):
    result = cli("eval", micro_model, "--against", micro_model, "--num-windows", "2", "--seq-len", "64",
                 "--tasks", "quantkit_continuation:acc", "--task-file", task_file, *LIMIT, "--json", "-")
    assert result.exit_code == 0, result.output
    (task,) = json.loads(result.stdout)["tasks"]
    assert task["metric"] == "acc" and task["samples"] == 4
