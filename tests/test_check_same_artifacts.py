"""scripts/check_same_artifacts.py: the manifest of an output directory (volatile fields out, the work
directory's path masked) and the comparison of two manifests (fast: no quantize run)."""

from __future__ import annotations

import json

import pytest

from tests.util import script_module


@pytest.fixture(scope="module")
def check():
    with script_module("check_same_artifacts") as module:
        yield module


def write_output(out, work, total_s=1.5, weights=b"\x00\x01", ppl=2.5):
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(weights)
    report = {"model": {"path": f"{work}/models/micro"}, "timings": {"total_s": total_s},
              "gate_placement": {"resident": True, "why": f"{total_s} GiB free"},
              "targets": [{"name": "t", "timings": {"quantize_s": total_s}, "peak_rss_bytes": int(total_s * 1e6),
                           "metrics": {"ppl": ppl}, "details": {"fallback": {"seconds": total_s, "steps": [1]}}}]}
    (out / "quantkit.json").write_text(json.dumps(report, indent=2))
    (out / "README.md").write_text(f"---\nbase_model: {work}/models/micro\n---\n")
    (out / "sub").mkdir()
    (out / "sub" / "Modelfile").write_text("FROM ./model.gguf\n")


def manifest(check, entries):
    return {"inputs": {"micro": {"model.safetensors": "abc"}}, "runs": entries}


def test_volatile_fields_and_the_work_path_do_not_count(check, tmp_path):
    one, two = tmp_path / "a" / "out", tmp_path / "b" / "out"
    write_output(one, str(tmp_path / "a"), total_s=1.5)
    write_output(two, str(tmp_path / "b"), total_s=9.25)
    first = check.artifact_entry(one, str(tmp_path / "a"))
    second = check.artifact_entry(two, str(tmp_path / "b"))
    assert set(first["files"]) == {"model.safetensors", "quantkit.json", "README.md", "sub/Modelfile"}
    assert first == second
    assert first["report"]["quantkit.json:model.path"] == "$WORK/models/micro"
    assert "quantkit.json:gate_placement.resident" in first["report"]
    assert not any("timings" in key or "peak_rss" in key or key.endswith((".why", ".seconds"))
                   for key in first["report"])
    assert first["report"]["quantkit.json:targets.0.details.fallback.steps.0"] == 1


def test_a_changed_byte_or_field_is_a_difference(check, tmp_path):
    write_output(tmp_path / "a", "/w1")
    write_output(tmp_path / "b", "/w1", weights=b"\x00\x02", ppl=2.75)
    before = manifest(check, {"run": {"exit_code": 0, **check.artifact_entry(tmp_path / "a", "/w1")}})
    after = manifest(check, {"run": {"exit_code": 0, **check.artifact_entry(tmp_path / "b", "/w1")}})
    rows = check.differences(before, after)
    assert [(run, what) for run, what, _one, _two in rows] == [
        ("run", "model.safetensors"), ("run", "quantkit.json:targets.0.metrics.ppl")]
    assert rows[1][2:] == ("2.5", "2.75")
    text = check.table(rows)
    assert "model.safetensors" in text and text.endswith("2 difference(s)")
    assert check.differences(before, before) == []
    assert check.table([]).startswith("same artifacts")


def test_missing_runs_files_inputs_and_exit_codes_are_differences(check, tmp_path):
    write_output(tmp_path / "a", "/w")
    entry = {"exit_code": 0, **check.artifact_entry(tmp_path / "a", "/w")}
    fewer = {**entry, "files": {k: v for k, v in entry["files"].items() if k != "sub/Modelfile"}}
    before = manifest(check, {"kept": entry, "gone": entry})
    after = {"inputs": {"micro": {"model.safetensors": "abd"}},
             "runs": {"kept": {**fewer, "exit_code": 3}, "new": entry}}
    rows = check.differences(before, after)
    assert ("input micro", "model.safetensors", "abc", "abd") in rows
    assert ("gone", "run", "present", "absent") in rows and ("new", "run", "absent", "present") in rows
    assert ("kept", "exit code", "0", "3") in rows
    assert ("kept", "sub/Modelfile", check.short(entry["files"]["sub/Modelfile"]), "absent") in rows


def test_every_run_is_named_once_and_the_cli_refuses_an_unknown_one(check, tmp_path):
    names = [run.name for run in check.RUNS]
    assert len(names) == len(set(names))
    methods = {run.args[run.args.index("--method") + 1] for run in check.RUNS if "--method" in run.args}
    from quantkit.methods import METHODS

    assert methods == set(METHODS)  # every method has at least one run
    with pytest.raises(SystemExit):
        check.main(["--work", str(tmp_path), "--only", "no-such-run"])
