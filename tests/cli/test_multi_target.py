"""Multi-target control and CI output: --only, --skip-existing, --partial, --quiet, --summary."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from tests.util import FAST_CALIB, leftovers, subprocess_env

TWO_FP8 = "targets:\n  - {name: dyn, method: fp8}\n  - {name: static, method: fp8, options: {scheme: fp8-static}}\n"


def write_recipe(tmp_path, text: str = TWO_FP8):
    recipe = tmp_path / "multi.yaml"
    recipe.write_text(text)
    return recipe


def statuses(report: dict) -> dict[str, tuple[str, bool]]:
    return {t["name"]: (t["status"], t["written"]) for t in report["targets"]}


def test_only_runs_the_named_targets_into_an_existing_out(cli, micro_model, tmp_path):
    """Each --only run publishes its own OUT/<target> and leaves the others (CI fan-out)."""
    recipe, out = write_recipe(tmp_path), tmp_path / "dist"
    result = cli("quantize", micro_model, "--recipe", recipe, "--only", "static", "-o", out, *FAST_CALIB)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["quantkit.json", "static"]
    result = cli("quantize", micro_model, "--recipe", recipe, "--only", "dyn", "-o", out, "--json", "-", *FAST_CALIB)
    assert result.exit_code == 0, result.output
    assert statuses(json.loads(result.stdout)) == {"dyn": ("passed", True)}
    assert (out / "dyn" / "model.safetensors").is_file() and (out / "static" / "model.safetensors").is_file()
    assert json.loads((out / "dyn" / "quantkit.json").read_text())["targets"][0]["name"] == "dyn"
    assert leftovers(tmp_path, "dist") == ["dist"]
    again = cli("quantize", micro_model, "--recipe", recipe, "--only", "dyn", "-o", out, *FAST_CALIB)
    assert again.exit_code == 2 and f"output already exists: {out / 'dyn'}" in again.stderr


def test_only_unknown_name_lists_the_targets_before_work(cli, micro_model, tmp_path, monkeypatch):
    from quantkit.eval import evaluate

    monkeypatch.setattr(evaluate, "compute_baseline", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    result = cli("quantize", micro_model, "--recipe", write_recipe(tmp_path), "--only", "dyn,nope", "-o",
                 tmp_path / "dist", *FAST_CALIB)
    assert result.exit_code == 2, result.output
    assert "no target named nope; the recipe's targets are dyn, static" in result.stderr
    assert leftovers(tmp_path, "dist") == []


@pytest.mark.slow
def test_skip_existing_skips_up_to_date_targets_and_reruns_changed_ones(cli, micro_model, model_copy, tmp_path):
    recipe, out = write_recipe(tmp_path), tmp_path / "dist"
    assert cli("quantize", model_copy, "--recipe", recipe, "-o", out, *FAST_CALIB).exit_code == 0
    weights = out / "dyn" / "model.safetensors"
    first = weights.stat().st_mtime_ns

    result = cli("quantize", model_copy, "--recipe", recipe, "-o", out, "--skip-existing", "--json", "-", *FAST_CALIB)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert statuses(report) == {"dyn": ("skipped", False), "static": ("skipped", False)}
    assert report["targets"][0]["metrics"]["kld_mean"] > 0  # the kept output's own measurements
    assert "dyn: skipped (up to date)" in result.stderr and "up to date: " in result.stderr
    assert weights.stat().st_mtime_ns == first

    # one target's recipe entry changes: only that target runs again, and its stale output is replaced
    recipe.write_text(TWO_FP8.replace("{scheme: fp8-static}}", "{scheme: fp8-static}, ignore: ['re:.*down_proj']}"))
    result = cli("quantize", model_copy, "--recipe", recipe, "-o", out, "--skip-existing", "--json", "-", *FAST_CALIB)
    assert result.exit_code == 0, result.output
    assert statuses(json.loads(result.stdout)) == {"dyn": ("skipped", False), "static": ("passed", True)}
    assert "re:.*down_proj" in json.loads((out / "static" / "quantkit.json").read_text())["targets"][0]["ignore"]

    # an input file changes: every target runs again
    config = model_copy / "generation_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_length": 123}))
    result = cli("quantize", model_copy, "--recipe", recipe, "-o", out, "--skip-existing", "--json", "-", *FAST_CALIB)
    assert result.exit_code == 0, result.output
    assert statuses(json.loads(result.stdout)) == {"dyn": ("passed", True), "static": ("passed", True)}
    assert weights.stat().st_mtime_ns != first
    assert leftovers(tmp_path, "dist") == ["dist"]


def test_skip_existing_single_target(cli, micro_model, tmp_path):
    out = tmp_path / "fp8"
    assert cli("quantize", micro_model, "--method", "fp8", "-o", out, *FAST_CALIB).exit_code == 0
    result = cli("quantize", micro_model, "--method", "fp8", "-o", out, "--skip-existing", *FAST_CALIB)
    assert result.exit_code == 0 and "fp8: skipped (up to date)" in result.stdout
    result = cli("quantize", micro_model, "--method", "fp8", "-o", out, "--skip-existing", *FAST_CALIB,
                 "--min-top1", "0.7")  # another gate: not up to date, replaced
    assert result.exit_code == 0 and "fp8: PASS" in result.stdout
    assert json.loads((out / "quantkit.json").read_text())["targets"][0]["fingerprint"]["gate"]["min_top1"] == 0.7


def test_input_hashes_cover_the_adapter_and_calibration_files(micro_model, tmp_path):
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.cache import input_hashes
    from quantkit.run.recipe import validate

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"one")
    calib = tmp_path / "calib.txt"
    calib.write_text("some text")
    recipe = validate({"lora": [str(adapter)], "calibration": {"source": str(calib)},
                       "targets": [{"name": "a", "method": "fp8"}]})
    info = check_model_dir(micro_model)
    before = input_hashes(info, recipe)
    assert {"model/model.safetensors", "model/config.json", "model/tokenizer.json", "lora0/adapter_model.safetensors",
            "lora0/adapter_config.json", "calibration/calib.txt"} <= set(before)
    (adapter / "adapter_model.safetensors").write_bytes(b"two")
    after = input_hashes(info, recipe)
    assert [k for k in before if before[k] != after[k]] == ["lora0/adapter_model.safetensors"]


PARTIAL = ("targets:\n  - {name: static, method: fp8, options: {scheme: fp8-static}}\n"
           "  - {name: dyn, method: fp8}\n"
           "  - {name: strict, method: fp8, gate: {max_kld: 0}}\n")


def break_static(monkeypatch):
    """fp8-static raises an internal error; fp8-dynamic works."""
    from quantkit.methods import fp8

    real = fp8.METHOD.quantize

    def quantize(job):
        if job.options.scheme == "fp8-static":
            raise ZeroDivisionError("division by zero")
        return real(job)

    monkeypatch.setattr(fp8, "METHOD", dataclasses.replace(fp8.METHOD, quantize=quantize))


def test_partial_publishes_what_passed_and_exits_with_the_worst_code(cli, micro_model, tmp_path, monkeypatch):
    break_static(monkeypatch)
    out, summary = tmp_path / "dist", tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    result = cli("quantize", micro_model, "--recipe", write_recipe(tmp_path, PARTIAL), "-o", out, "--partial",
                 "--json", tmp_path / "r.json", "--summary", summary, *FAST_CALIB)
    assert result.exit_code == 1, result.output  # an internal error outranks a failed gate
    report = json.loads((tmp_path / "r.json").read_text())
    assert statuses(report) == {"static": ("error", False), "dyn": ("passed", True), "strict": ("failed", False)}
    assert report["targets"][0]["error"] == "internal error: ZeroDivisionError: division by zero"
    assert sorted(p.name for p in out.iterdir()) == ["dyn", "quantkit.json"]
    assert statuses(json.loads((out / "quantkit.json").read_text())) == statuses(report)
    assert "static: ERROR: internal error: ZeroDivisionError" in result.stdout
    assert "strict: FAIL: kld_mean" in result.stdout and "dyn: PASS" in result.stdout
    assert "2 of 3 targets failed" in result.stderr and f"written to {out}: dyn" in result.stderr
    text = summary.read_text()
    assert text.startswith("earlier step\n### quantkit: ")
    assert "| target | method | status |" in text
    assert "| static | fp8 | ERROR |" in text and "| strict | fp8 | FAILED |" in text
    assert "| dyn | fp8 | passed |" in text and "| PASS | yes |" in text and "FAIL: kld_mean | no |" in text
    assert "- **static**: internal error: ZeroDivisionError: division by zero" in text
    assert leftovers(tmp_path, "dist") == ["dist"]


def test_partial_gate_failure_only_exits_3(cli, micro_model, tmp_path):
    recipe = write_recipe(tmp_path, "targets:\n  - {name: dyn, method: fp8}\n"
                                    "  - {name: strict, method: fp8, gate: {max_kld: 0}}\n")
    out = tmp_path / "dist"
    result = cli("quantize", micro_model, "--recipe", recipe, "-o", out, "--partial", *FAST_CALIB)
    assert result.exit_code == 3, result.output
    assert "quality gate failed for strict (kld_mean); written to" in result.stderr
    assert (out / "dyn" / "model.safetensors").is_file() and not (out / "strict").exists()


def test_without_partial_a_failure_writes_nothing(cli, micro_model, tmp_path, monkeypatch):
    break_static(monkeypatch)
    recipe = write_recipe(tmp_path, PARTIAL)
    result = cli("quantize", micro_model, "--recipe", recipe, "-o", tmp_path / "dist", *FAST_CALIB)
    assert result.exit_code == 1 and "ZeroDivisionError" in result.stderr
    assert leftovers(tmp_path, "dist") == []


def test_quiet_prints_one_line_per_target_and_json_stays_alone(cli, micro_model, tmp_path):
    out = tmp_path / "dist"
    result = cli("quantize", micro_model, "--recipe", write_recipe(tmp_path), "-o", out, "--quiet", *FAST_CALIB)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["dyn", "static"]
    assert lines[0].startswith("dyn: PASS; Δppl") and lines[0].endswith(f"→ {out / 'dyn'}")
    assert result.stderr == ""
    result = cli("quantize", micro_model, "--recipe", write_recipe(tmp_path), "-o", out, "--quiet", "--json", "-",
                 "--skip-existing", *FAST_CALIB)
    assert result.exit_code == 0, result.output
    assert statuses(json.loads(result.stdout)) == {"dyn": ("skipped", False), "static": ("skipped", False)}
    assert result.stderr.splitlines() == [f"dyn: skipped (up to date) → {out / 'dyn'}",
                                          f"static: skipped (up to date) → {out / 'static'}"]


@pytest.mark.slow
def test_piped_output_has_no_colour_or_progress_bars(micro_model, tmp_path):
    """Through a real process with pipes (not a TTY): no ANSI escapes, no tqdm bars, no carriage returns."""
    recipe = write_recipe(tmp_path, "targets:\n  - {name: dyn, method: fp8}\n"
                                    "  - {name: q8, method: gguf, options: {gguf_type: Q8_0, imatrix: none}}\n")
    env = subprocess_env()
    for name in ("FORCE_COLOR", "CLICOLOR_FORCE", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "quantkit", "quantize", str(micro_model), "--recipe", str(recipe), "-o",
           str(tmp_path / "dist"), *FAST_CALIB]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    for stream in (proc.stdout, proc.stderr):
        assert "\x1b[" not in stream and "\r" not in stream
        assert "it/s]" not in stream and "s/it]" not in stream and "%|" not in stream
    assert "dyn: PASS" in proc.stdout and "q8: PASS" in proc.stdout and "· baseline" in proc.stderr
    assert os.path.isdir(tmp_path / "dist" / "q8")
