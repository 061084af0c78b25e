"""End to end through the CLI: FP8 on a tiny local model, and every bad input of issue 2."""

import json
import os
import subprocess

import pytest
from safetensors import safe_open

from tests.util import FAST_CALIB, leftovers


def test_fp8_dynamic_end_to_end(cli, micro_model, tmp_path):
    out = tmp_path / "fp8"
    result = cli("quantize", micro_model, "--method", "fp8", "-o", out, "--json", tmp_path / "r.json", *FAST_CALIB)
    assert result.exit_code == 0, result.output
    assert "PASS" in result.stdout
    report = json.loads((out / "quantkit.json").read_text())
    target = report["targets"][0]
    assert target["gate"]["passed"] and target["metrics"]["positions"] == 4 * 63
    assert report["model"]["sha256"]["model.safetensors"]
    assert json.loads((tmp_path / "r.json").read_text())["passed"] is True
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers") and "compressed-tensors" in card  # local: no base_model
    assert "from a local checkpoint (config.json sha256" in card
    for name in ("tokenizer.json", "generation_config.json", "config.json"):
        assert (out / name).is_file()
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qconfig["quant_method"] == "compressed-tensors"
    assert qconfig["config_groups"]["group_0"]["format"] == "float-quantized"
    assert "lm_head" in qconfig["ignore"]
    with safe_open(out / "model.safetensors", "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys() if k.endswith("q_proj.weight")}
    assert {str(d) for d in dtypes} == {"torch.float8_e4m3fn"}
    assert leftovers(tmp_path, "fp8") == ["fp8"]


def test_fp8_reloads_in_transformers_close_to_base(cli, micro_model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "fp8"
    assert cli("quantize", micro_model, "--method", "fp8", "-o", out, *FAST_CALIB).exit_code == 0
    ids = torch.randint(0, 500, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        base = AutoModelForCausalLM.from_pretrained(micro_model, dtype=torch.float32)(ids).logits
        quant = AutoModelForCausalLM.from_pretrained(out)(ids).logits.float()
    rel = (quant - base).norm() / base.norm()
    assert rel < 0.05, rel


def test_fp8_static_uses_calibration(cli, micro_model, tmp_path):
    out = tmp_path / "static"
    result = cli("quantize", micro_model, "--method", "fp8", "--scheme", "fp8-static", "-o", out, *FAST_CALIB)
    assert result.exit_code == 0, result.output
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["input_activations"]["dynamic"] is False
    assert group["input_activations"]["strategy"] == "tensor"


def test_recipe_with_model_option_and_overrides(cli, micro_model, tmp_path):
    out = tmp_path / "r"
    result = cli("quantize", "--recipe", "fp8-dynamic", "--model", micro_model, "-o", out, *FAST_CALIB,
                 "--min-top1", "0.5")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "quantkit.json").read_text())
    assert report["recipe"]["calibration"]["seq_len"] == 64
    assert report["recipe"]["gate"]["min_top1"] == 0.5


def test_output_exists_needs_overwrite(cli, micro_model, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    result = cli("quantize", micro_model, "--method", "fp8", "-o", out, *FAST_CALIB)
    assert result.exit_code == 2
    assert "already exists" in result.stderr and "--overwrite" in result.stderr
    assert (out / "keep.txt").read_text() == "precious"
    result = cli("quantize", micro_model, "--method", "fp8", "-o", out, "--overwrite", *FAST_CALIB)
    assert result.exit_code == 0, result.output
    assert not (out / "keep.txt").exists() and (out / "quantkit.json").is_file()
    assert leftovers(tmp_path, "out") == ["out"]


def _expect_bad_input(result, tmp_path, needle: str):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert "Traceback" not in result.output
    assert leftovers(tmp_path, "out") == []


def test_nonexistent_model_dir(cli, tmp_path):
    _expect_bad_input(cli("quantize", tmp_path / "nope", "--method", "fp8", "-o", tmp_path / "out"), tmp_path,
                      "not found")


def test_dir_without_config(cli, tmp_path):
    (tmp_path / "empty").mkdir()
    _expect_bad_input(cli("quantize", tmp_path / "empty", "--method", "fp8", "-o", tmp_path / "out"), tmp_path,
                      "no config.json")


def test_truncated_weights(cli, model_copy, tmp_path):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    _expect_bad_input(cli("quantize", model_copy, "--method", "fp8", "-o", tmp_path / "out"), tmp_path, "truncated")


def test_unsupported_architecture(cli, model_copy, tmp_path):
    config = json.loads((model_copy / "config.json").read_text())
    config["architectures"] = ["LlamaForSequenceClassification"]
    (model_copy / "config.json").write_text(json.dumps(config))
    _expect_bad_input(cli("quantize", model_copy, "--method", "fp8", "-o", tmp_path / "out"), tmp_path,
                      "unsupported architecture")


def test_unknown_recipe_key(cli, micro_model, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("targets:\n  - name: a\n    method: fp8\n    optoins: {}\n")
    _expect_bad_input(cli("quantize", micro_model, "--recipe", recipe, "-o", tmp_path / "out"), tmp_path,
                      "targets.0.optoins: unknown field")


def test_wrong_type_in_recipe(cli, micro_model, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("calibration: {seq_len: long}\ntargets: [{name: a, method: fp8}]\n")
    _expect_bad_input(cli("quantize", micro_model, "--recipe", recipe, "-o", tmp_path / "out"), tmp_path,
                      "calibration.seq_len")


def test_unknown_method(cli, micro_model, tmp_path):
    _expect_bad_input(cli("quantize", micro_model, "--method", "magic", "-o", tmp_path / "out"), tmp_path,
                      "unknown method")


def test_flag_for_another_method(cli, micro_model, tmp_path):
    _expect_bad_input(cli("quantize", micro_model, "--method", "fp8", "--gguf-type", "Q4_K_M", "-o",
                          tmp_path / "out"), tmp_path, "--gguf-type does not apply to method fp8")


@pytest.mark.parametrize("content,needle", [(None, "not found"), ("", "empty"), ("just a few words\n", "are needed")])
def test_bad_calibration_file(cli, micro_model, tmp_path, content, needle):
    calib = tmp_path / "calib.txt"
    if content is not None:
        calib.write_text(content)
    _expect_bad_input(cli("quantize", micro_model, "--method", "fp8", "--calib", calib, "-o", tmp_path / "out",
                          *FAST_CALIB), tmp_path, needle)


def test_hub_id_not_cached_offline(cli, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))  # read from HF_HUB_CACHE at import
    monkeypatch.chdir(tmp_path)
    _expect_bad_input(cli("quantize", "meta-llama/Llama-3.2-1B", "--method", "fp8", "-o", tmp_path / "out",
                          "--offline"), tmp_path, "meta-llama/Llama-3.2-1B@main is not in the Hugging Face cache")


def test_output_parent_not_writable(cli, micro_model, tmp_path, monkeypatch):
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real_access(p, mode))
    _expect_bad_input(cli("quantize", micro_model, "--method", "fp8", "-o", tmp_path / "out"), tmp_path,
                      "not writable")


def test_output_parent_missing(cli, micro_model, tmp_path):
    result = cli("quantize", micro_model, "--method", "fp8", "-o", tmp_path / "no" / "out")
    assert result.exit_code == 2 and "does not exist" in result.stderr


def test_ctrl_c_during_export_leaves_nothing(cli, micro_model, tmp_path, monkeypatch):
    from quantkit.io import export

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "publish", interrupted)
    result = cli("quantize", micro_model, "--method", "fp8", "-o", tmp_path / "out", *FAST_CALIB)
    assert result.exit_code == 130
    assert "interrupted" in result.stderr
    assert leftovers(tmp_path, "out") == []


def test_internal_error_is_one_line_exit_1(cli, micro_model, tmp_path, monkeypatch):
    import dataclasses

    from quantkit.methods import fp8

    monkeypatch.setattr(fp8, "METHOD", dataclasses.replace(fp8.METHOD, quantize=lambda job: 1 / 0))
    result = cli("quantize", micro_model, "--method", "fp8", "-o", tmp_path / "out", *FAST_CALIB)
    assert result.exit_code == 1
    assert "internal error: ZeroDivisionError" in result.stderr and "Traceback" not in result.stderr
    assert leftovers(tmp_path, "out") == []


def test_json_to_stdout_is_only_json(cli, micro_model, tmp_path):
    """`--json -`: stdout parses as JSON; the tables and 'wrote' go to stderr."""
    out = tmp_path / "fp8"
    result = cli("quantize", micro_model, "--method", "fp8", "-o", out, "--json", "-", *FAST_CALIB)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["schema_version"] == 1 and report["passed"] is True
    assert report["targets"][0]["engine_version"]
    assert "PASS" in result.stderr and f"wrote {out}" in result.stderr


def test_no_calibration_windows_for_methods_that_need_none(cli, micro_model, tmp_path):
    """fp8-dynamic uses no calibration data: a source with only enough text for the held-out
    windows is fine, and no calibration windows are cut."""
    text = (tmp_path / "small.txt")
    text.write_text(" ".join(f"word{i % 50}" for i in range(600)))
    out = tmp_path / "fp8"
    result = cli("quantize", micro_model, "--method", "fp8", "-o", out, "--calib", text,
                 "--num-samples", "512", "--seq-len", "64", "--eval-windows", "2", "--min-top1", "0.5")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "quantkit.json").read_text())
    assert report["calibration"]["calib_windows"] == 0 and report["calibration"]["eval_windows"] == 2


def test_calibrated_method_refuses_zero_samples(cli, micro_model, tmp_path):
    out = tmp_path / "static"
    result = cli("quantize", micro_model, "--method", "fp8", "--scheme", "fp8-static", "-o", out,
                 "--num-samples", "0", "--seq-len", "64", "--eval-windows", "2")
    assert result.exit_code == 2 and "num_samples is 0" in result.stderr
    assert leftovers(tmp_path, "static") == []


def test_offload_dir_keeps_decoder_layers_on_disk(cli, micro_model, tmp_path):
    """--offload-dir: llm-compressor quantizes a model whose decoder layers are offloaded to disk
    (fp8-static: it loads the model, fp8-dynamic reads the checkpoint itself); the artifact reloads
    and passes the gate, and the offload folder is removed afterwards."""
    offload = tmp_path / "offload"
    offload.mkdir()
    out = tmp_path / "fp8"
    result = cli("quantize", micro_model, "--method", "fp8", "--scheme", "fp8-static", "--offload-dir", offload,
                 "-o", out, *FAST_CALIB)
    assert result.exit_code == 0, result.output
    assert "offloaded to" in result.stderr
    assert json.loads((out / "quantkit.json").read_text())["targets"][0]["gate"]["passed"]
    assert list(offload.iterdir()) == []


def test_offload_dir_must_be_writable(cli, micro_model, tmp_path):
    result = cli("quantize", micro_model, "--method", "fp8", "--offload-dir", tmp_path / "missing",
                 "-o", tmp_path / "out", *FAST_CALIB)
    assert result.exit_code == 2 and "offload directory" in result.stderr
    assert leftovers(tmp_path, "out") == []


def test_offload_device_map_puts_every_decoder_layer_on_disk(micro_model):
    from quantkit.engines.transformers import offload_device_map
    from quantkit.io.checkpoint import check_model_dir

    mapping = offload_device_map(check_model_dir(micro_model), "cpu")
    assert mapping["model.layers.0"] == mapping["model.layers.1"] == "disk"
    assert mapping["model.embed_tokens"] == mapping["lm_head"] == "disk"  # vocabulary-sized, not changed
    assert mapping["model.norm"] == "cpu"
    assert not any(".layers.0." in key for key in mapping)


@pytest.mark.slow
def test_gptq_with_offload_dir_writes_the_same_tensors_as_in_memory(cli, micro_model, tmp_path):
    """Layers, embeddings and head on disk (--offload-dir), the tables alone (the default) or nothing
    (the model whole in RAM) change where the weights wait, not what GPTQ computes."""
    import torch
    from safetensors.torch import load_file

    offload = tmp_path / "offload"
    offload.mkdir()
    tensors = {}
    for name, extra in (("ram", ()), ("disk", ("--offload-dir", offload))):
        result = cli("quantize", micro_model, "--method", "gptq", "-o", tmp_path / name, "--eval-windows", "0",
                     "--num-samples", "16", "--seq-len", "64", *extra)
        assert result.exit_code == 0, result.output
        tensors[name] = load_file(tmp_path / name / "model.safetensors")
    tensors["whole"] = whole_model_gptq(micro_model, tmp_path)
    for name in ("disk", "whole"):
        assert tensors["ram"].keys() == tensors[name].keys()
        assert all(torch.equal(tensors["ram"][k], tensors[name][k]) for k in tensors["ram"]), name
    assert list(offload.iterdir()) == []


def whole_model_gptq(model_dir, tmp_path):
    """The same gptq target with the model loaded whole in RAM (no table on disk), through the method
    itself: the tensors it saves."""
    from safetensors.torch import load_file

    from quantkit.engines.transformers import load_model, load_tokenizer
    from quantkit.methods import ModelHandle, QuantizeJob
    from quantkit.run.pipeline import RunOptions, make_windows, prepare, window_settings
    from quantkit.run.recipe import Overrides, build_recipe

    calibration = dict(num_samples=16, seq_len=64, eval_windows=0)
    recipe = build_recipe(None, "gptq", Overrides(model=str(model_dir), calibration=calibration))
    info, targets, _placement = prepare(recipe, RunOptions(model=str(model_dir), out=tmp_path / "whole"))
    tokenizer = load_tokenizer(info)
    windows = make_windows(tokenizer, window_settings(recipe, targets), lambda message: None)
    (tmp_path / "whole").mkdir()
    job = QuantizeJob(info, targets[0].options, windows, targets[0].ignore, tmp_path / "whole", tmp_path,
                      handle=ModelHandle(load_model(info), tokenizer))
    targets[0].method.quantize(job)
    return load_file(tmp_path / "whole" / "model.safetensors")


def test_under_torchrun_a_one_process_method_is_refused_before_work(cli, micro_model, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    result = cli("quantize", micro_model, "--method", "nf4", "-o", tmp_path / "out", *FAST_CALIB, "--num-samples", "16")
    assert result.exit_code == 2
    assert "nf4 runs in one process only (" in result.stderr and "but this is one of 2 torchrun ranks" in result.stderr
    assert leftovers(tmp_path, "out") == []


@pytest.mark.slow
def test_two_torchrun_ranks_give_the_one_process_artifact(cli, micro_model, tmp_path):
    """gloo on CPU: each rank calibrates on half of the windows, rank 0 alone gates and writes;
    the Hessians are summed in another order, so a few int4 values may differ."""
    import sys

    from safetensors.torch import load_file

    from tests.util import subprocess_env

    args = ("quantize", micro_model, "--method", "gptq", *FAST_CALIB, "--num-samples", "16", "--no-gate")
    assert cli(*args, "-o", tmp_path / "one").exit_code == 0
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    loopback = {"GLOO_SOCKET_IFNAME": "lo"} if os.path.exists("/sys/class/net/lo") else {}  # not the hostname's
    run = subprocess.run([*launcher, "quantkit", *map(str, args), "-o", str(tmp_path / "two")], capture_output=True,
                         text=True, env=subprocess_env(OMP_NUM_THREADS="1", **loopback), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"rank 1 of 2: calibration and gate shares done; rank 0 writes {tmp_path / 'two'}" in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # no rank's work directory left
    one, two = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert one.keys() == two.keys()
    packed = [name for name in one if name.endswith("weight_packed")]
    same = sum(int((one[n] == two[n]).sum()) for n in packed) / sum(one[n].numel() for n in packed)
    assert same > 0.98
    metrics = [json.loads((tmp_path / d / "quantkit.json").read_text())["targets"][0]["metrics"] for d in ("one", "two")]
    # the few int4 values that differ move a KLD of ~2e-4 by up to ~15% on this model
    assert metrics[1]["kld_mean"] == pytest.approx(metrics[0]["kld_mean"], rel=0.3)
    assert metrics[1]["top1"] == pytest.approx(metrics[0]["top1"], abs=0.02)
    report = json.loads((tmp_path / "two" / "quantkit.json").read_text())
    assert report["calibration"]["calib_windows"] == 16


def test_flip_flags_gate_greedy_generations(cli, micro_model, tmp_path):
    """--flip-prompts / --flip-tokens / --max-flips: greedy continuations of held-out prompts, base vs.
    artifact, in the report and the gate; --max-flips alone is refused before work."""
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "fp8", "-o", out, *FAST_CALIB, "--flip-prompts", "2",
                 "--flip-tokens", "4", "--max-flips", "1")
    assert result.exit_code == 0, result.output
    target = json.loads((out / "quantkit.json").read_text())["targets"][0]
    assert 0 <= target["metrics"]["flips"] <= 1
    assert "flips" in [c["name"] for c in target["gate"]["checks"]]
    refused = cli("quantize", micro_model, "--method", "fp8", "-o", tmp_path / "no", *FAST_CALIB, "--max-flips", "0.1")
    assert refused.exit_code == 2 and "flip_prompts" in refused.stderr
    assert "baseline" not in refused.stderr
