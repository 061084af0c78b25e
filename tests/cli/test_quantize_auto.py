"""`quantkit quantize --method auto --for ENGINE[:DEVICE]` end to end on the micro model: the ladder measured, the
smallest passing artifact written with its ladder in quantkit.json and the model card; nothing written when none
passes (exit 3); bad input refused before any work (exit 2)."""

from __future__ import annotations

import json

import pytest

LOOSE = ("--max-kld", "1", "--min-top1", "0", "--max-ppl-increase", "10")  # every candidate passes on this model


def test_one_artifact_per_destination_each_the_smallest_that_passes(cli, micro_model, tmp_path):
    out = tmp_path / "auto"
    result = cli("quantize", micro_model, "--method", "auto", "--for", "mlx:cpu", "--for", "transformers", *LOOSE,
                 "-o", out, "--json", tmp_path / "report.json")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    targets = {t["name"]: t for t in report["targets"]}
    assert set(targets) == {"auto-mlx-cpu", "auto-transformers"}
    mlx = targets["auto-mlx-cpu"]
    ladder = mlx["details"]["auto"]
    assert mlx["method"] == "mlx" and ladder["chosen"] == "mlx 2-bit" and ladder["device"] == "cpu"
    statuses = {r["candidate"]: r["status"] for r in ladder["ladder"]}
    assert statuses["mlx 2-bit"] == "passed"
    assert sum(r["seconds"] is not None for r in ladder["ladder"]) < len(ladder["ladder"])  # not every rung built
    assert targets["auto-transformers"]["details"]["auto"]["chosen"] == "bitsandbytes nf4"
    for name in targets:
        files = {p.name for p in (out / name).iterdir()}
        assert "quantkit.json" in files and ".quantkit-work" not in files
        assert "How this artifact was chosen" in (out / name / "README.md").read_text()
    assert (out / "auto-mlx-cpu" / "model.safetensors").is_file()
    assert "chose mlx 2-bit" in result.output


def test_none_passing_writes_nothing_and_prints_the_ladder(cli, micro_model, tmp_path):
    out = tmp_path / "auto"
    result = cli("quantize", micro_model, "--method", "auto", "--for", "transformers", "--max-kld", "0",
                 "--max-size", "1.8MB", "-o", out, "--json", tmp_path / "report.json")
    assert result.exit_code == 3, result.output
    assert not out.exists()
    assert "none passed" in result.output and "guide: raised bitsandbytes int8" in result.output
    target = json.loads((tmp_path / "report.json").read_text())["targets"][0]
    ladder = target["details"]["auto"]
    assert ladder["chosen"] is None and target["status"] == "failed"
    assert [r["status"] for r in ladder["ladder"]] == ["failed", "failed", "failed"]
    assert ladder["ladder"][-1]["candidate"] == "bitsandbytes int8 + guide"


@pytest.mark.parametrize("args, message", [
    (("--method", "auto"), "method auto needs `for: ENGINE[:DEVICE]`"),
    (("--method", "gguf", "--for", "llama.cpp"), "--for: where and how method auto serves its choice"),
    (("--method", "auto", "--for", "llama.cpp", "--group-size", "64"), "--group-size: method auto chooses"),
    (("--method", "auto", "--for", "llama.cpp", "--fallback"), "--fallback: method auto chooses"),
    (("--method", "auto", "--for", "tgi"), "unknown engine 'tgi'"),
    (("--method", "auto", "--for", "vllm:L5"), "unknown device 'L5'"),
    (("--method", "auto", "--for", "llama.cpp", "--max-size", "10KB"), "no format of llama.cpp on cpu fits; the smallest"),
    (("--method", "auto", "--for", "llama.cpp", "--max-size", "+10%"), "takes a size"),
    (("--method", "auto", "--for", "mlx:H100"), "mlx serves none of its formats on H100"),
    (("--method", "auto", "--for", "llama.cpp", "--no-gate"), "method auto chooses by the quality gate"),
    (("--method", "auto", "--for", "llama.cpp", "--resume"), "method auto does not resume"),
    (("--method", "gptq", "--context", "8192"), "--context / --batch: where and how method auto"),
])
def test_bad_input_is_refused_before_work(cli, micro_model, tmp_path, args, message):
    result = cli("quantize", micro_model, *args, "-o", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not (tmp_path / "out").exists()


def test_a_recipe_names_the_destination(cli, micro_model, tmp_path):
    recipe = tmp_path / "auto.yaml"
    recipe.write_text("targets:\n  - name: small\n    method: auto\n    for: llama.cpp\n"
                      "    options: {max_size: 10KB, context: 2048}\n")
    result = cli("quantize", micro_model, "--recipe", recipe, "-o", tmp_path / "out")
    assert result.exit_code == 2 and "--max-size 10KB" in " ".join(result.output.split())
    recipe.write_text("targets:\n  - name: q4\n    method: gguf\n    for: llama.cpp\n")
    result = cli("recipes", "validate", recipe)
    assert result.exit_code == 2 and "method gguf is already chosen" in " ".join(result.output.split())


@pytest.mark.slow
def test_the_choice_is_the_smallest_candidate_that_passes_alone(cli, micro_model, tmp_path):
    """Every GGUF candidate run alone under the same bar: the smallest that passes is the ladder's choice."""
    bar = ("--max-kld", "3e-5", "--min-top1", "0", "--max-ppl-increase", "10")
    result = cli("quantize", micro_model, "--method", "auto", "--for", "llama.cpp", *bar, "-o", tmp_path / "auto",
                 "--json", tmp_path / "auto.json")
    assert result.exit_code in (0, 3), result.output
    ladder = json.loads((tmp_path / "auto.json").read_text())["targets"][0]["details"]["auto"]
    alone = {}
    for row in ladder["ladder"]:
        gguf_type = row["options"]["gguf_type"]
        run = cli("quantize", micro_model, "--method", "gguf", "--gguf-type", gguf_type, *bar,
                  "-o", tmp_path / gguf_type, "--json", tmp_path / f"{gguf_type}.json")
        alone[row["candidate"]] = run.exit_code == 0
    smallest = next((row["candidate"] for row in ladder["ladder"] if alone[row["candidate"]]), None)
    assert ladder["chosen"] == smallest, (ladder, alone)


# engine -> (--for, its KV flag, its serve module, its name, its variable, candidates measured at least: vLLM's CPU
# kernels start at W4A16, whose first candidate passes the loose bar)
ENGINES = {"mlx": ("mlx:cpu", "--kv-bits ", "mlx_server", "mlx-lm", "QUANTKIT_MLX_PYTHON", 2),
           "llama.cpp": ("llama.cpp", "-ctk ", "llama_server", "llama.cpp's llama-server", "QUANTKIT_LLAMA_CPP", 2),
           "vllm": ("vllm:cpu", "--kv-cache-dtype ", "vllm_server", "vLLM", "QUANTKIT_VLLM", 1)}


@pytest.mark.slow
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_the_chosen_one_alone_is_served_and_gets_its_kv_type(cli, micro_model, tmp_path, engine):
    """--serve-check and --kv-cache auto run on the chosen candidate only: the engine's server loads it, and the
    smallest passing KV type goes into its serve command and model card."""
    import importlib

    from tests.serve.test_serve_check_slow import require

    destination, flag, server, name, variable, least = ENGINES[engine]
    require(importlib.import_module(f"quantkit.serve.{server}").find, name, variable)
    recipe = tmp_path / "auto.yaml"
    recipe.write_text("calibration: {seq_len: 32, eval_windows: 4}\n"
                      "gate: {max_kld: 1, min_top1: 0, max_ppl_increase: 10, kv_cache: auto,"
                      f" serve: {{engine: {engine}, windows: 1}}}}\n"
                      f"targets: [{{name: auto, method: auto, for: '{destination}'}}]\n")
    out = tmp_path / "auto"
    result = cli("quantize", micro_model, "--recipe", recipe, "-o", out, "--json", tmp_path / "report.json")
    assert result.exit_code == 0, result.output
    target = json.loads((tmp_path / "report.json").read_text())["targets"][0]
    assert target["details"]["serve_check"]["passed"]
    measured = [r for r in target["details"]["auto"]["ladder"] if r["seconds"] is not None]
    assert len(measured) >= least and result.output.count("serving check: the artifact") == 1
    kv = target["details"]["kv_cache_types"]["chosen"]
    served = flag + kv.split(":")[1].split("/")[0]
    assert kv and served in target["details"]["serving"]["serve"] and served in (out / "README.md").read_text()
    if engine != "mlx":  # mlx_lm.server's prompt log-probs read raw keys: served with a 16-bit cache
        assert target["details"]["serve_check"]["kv_cache"]["type"] == kv
