"""gptq --fallback: one fallback step's plan (most damaging layer first, int4 -> int8 -> 16-bit, within
max_size), and end to end a failing gate turned into a passing mixed int4/int8 artifact, or stopped with
exit 3 when max_size is spent."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from quantkit.methods import QuantizeJob, QuantizeResult, gptq
from quantkit.mixed import layers as intmix
from quantkit.mixed.budget import Fallback, raise_plan, raise_step
from quantkit.mixed.sensitivity import SensitivityRow
from tests.methods.conftest import CALIB_ARGS, assert_nothing_written, quant_config, report

G64_SYM = gptq.Scheme(group_size=64, symmetric=True, element_bytes=2)


def layer(name: str, int4: float, shape=(256, 256), kld: float | None = None) -> SensitivityRow:
    return SensitivityRow(name, shape, {"int4": int4, "int8": int4 / 256, "16-bit": 0.0}, "int4", "int4", kld,
                          None if kld is None else kld / int4)


def test_raise_step_takes_the_most_damaging_layer_one_precision_up_within_room():
    table = [layer("a", 100.0), layer("b", 1.0), layer("c", 5.0)]
    choice = {"a": "int4", "b": "int4", "c": "int4"}
    up = G64_SYM.nbytes((256, 256), "int8") - G64_SYM.nbytes((256, 256), "int4")
    assert raise_step(table, choice, 1, 10**9, G64_SYM.size) == {"a": ("int4", "int8")}
    assert raise_step(table, choice, 2, 10**9, G64_SYM.size) == {"a": ("int4", "int8"), "c": ("int4", "int8")}
    assert raise_step(table, choice, 3, up, G64_SYM.size) == {"a": ("int4", "int8")}  # room for one
    assert raise_step(table, choice, 1, up - 1, G64_SYM.size) == {}  # room for none
    # a at int8 predicts 100/256 < 1: b and c now do more damage; a 16-bit layer has nowhere to go
    assert raise_step(table, {"a": "int8", "b": "int4", "c": "int4"}, 1, 10**9, G64_SYM.size) == {"c": ("int4", "int8")}
    assert raise_step(table, {"a": "16-bit", "b": "int8", "c": "int8"}, 1, 10**9, G64_SYM.size) == {
        "c": ("int8", "16-bit")}
    assert raise_step(table, {n: "16-bit" for n in "abc"}, 3, 10**9, G64_SYM.size) == {}


def test_sensitivity_table_round_trips_through_the_report():
    table = intmix.LayerTable([layer("a", 2.0, kld=0.01), layer("b", 1.0)], True, 8, {"kld": 1.5})
    again = intmix.LayerTable.from_dict(json.loads(json.dumps(table.as_dict())))
    assert again == table and again.layers[0].candidates == ["int4", "int8", "16-bit"]


def plan_job(tmp_path: Path, tensors_per_step: int = 1) -> QuantizeJob:
    """A job for fallback_ladder, a bfloat16 checkpoint (the ladder reads the recorded table: no model)."""
    from quantkit.io.checkpoint import ModelInfo

    info = ModelInfo(tmp_path, {"torch_dtype": "bfloat16"}, [], "LlamaForCausalLM", "llama")
    options = gptq.Options(group_size=64, fallback=Fallback(tensors_per_step=tensors_per_step))
    return QuantizeJob(info, options, None, [], tmp_path, tmp_path)


def test_the_ladder_raises_within_the_room_and_keeps_the_plan(tmp_path):
    table = intmix.LayerTable([layer("a", 100.0), layer("b", 1.0)], False)
    first = QuantizeResult(tmp_path, {"sensitivity": table.as_dict()})
    ladder = gptq.fallback_ladder(plan_job(tmp_path), first)
    assert ladder.plan == {"a": "int4", "b": "int4"} and ladder.keep_one
    up = G64_SYM.nbytes((256, 256), "int8") - G64_SYM.nbytes((256, 256), "int4") + intmix.METADATA_BYTES
    plan, raised = raise_plan(ladder, ladder.plan, 1, up)
    assert plan == {"a": "int8", "b": "int4"} and raised == {"a": ("int4", "int8")}
    assert raise_plan(ladder, ladder.plan, 1, up - 1)[1] == {}  # no raise fits: the budget is spent


def test_the_ladder_keeps_one_layer_quantized(tmp_path):
    """GPTQ has nothing to do without a quantized layer: the last raise to 16-bit is held back."""
    table = intmix.LayerTable([layer("a", 100.0), layer("b", 1.0)], False)
    details = {"sensitivity": table.as_dict(), "mixed_precision": {"types": {"a": "int8", "b": "int8"}}}
    ladder = gptq.fallback_ladder(plan_job(tmp_path), QuantizeResult(tmp_path, details))
    plan, raised = raise_plan(ladder, ladder.plan, 2, 10**9)
    assert plan == {"a": "16-bit", "b": "int8"} and raised == {"a": ("int8", "16-bit")}


def test_fallback_refuses_bits_8_before_work(cli, micro_model, tmp_path):
    result = cli("quantize", micro_model, "--method", "gptq", "--fallback", "--bits", "8", *CALIB_ARGS,
                 "-o", tmp_path / "out")
    assert result.exit_code == 2 and "fallback starts every layer at int4" in result.stderr, result.output


# ------------------------------------------------------------------ end to end


def spike(src: Path, dst: Path) -> Path:
    """A copy of a model whose layer 1 down_proj has one 200-sigma weight every 64 input columns: int4
    groups of 128 then round every other weight of the row to zero (KLD ~1e-3 on this model), while
    GPTQ at int8 per channel brings the artifact back to the rest's int4 damage (~1e-4)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(src / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    weight = state[name].float()
    columns = torch.arange(0, weight.shape[1], 64)
    weight[:, columns] = weight.std() * 200 * torch.sign(weight[:, columns] + 1e-9)
    state[name] = weight.to(state[name].dtype)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def spiky(micro_model, tmp_path_factory) -> Path:
    from tests.gguf.test_autoprecision import sharpen

    root = tmp_path_factory.mktemp("spiky")
    return spike(sharpen(micro_model, root / "sharp"), root / "spiky")


# first artifact (plain W4A16) KLD ~9.6e-4; with layers.1.mlp.down_proj at int8 ~8e-5
GATE = ("--max-kld", "0.0003", "--min-top1", "0", "--max-ppl-increase", "10")
SPIKED = "model.layers.1.mlp.down_proj"


def assert_fallback_passed(target: dict, max_kld: float) -> None:
    """A fallback report that turned a failing gate (kld_mean above max_kld) into a passing artifact:
    every later step raised something, only the last passed, the measured worst layer went first, and
    the size cost is the last step's bytes over the first's, within the default max_size (+25%)."""
    fallback = target["details"]["fallback"]
    steps = fallback["steps"]
    assert not steps[0]["passed"] and steps[0]["metrics"]["kld_mean"] > max_kld
    assert steps[-1]["passed"] and target["gate"]["passed"] and target["metrics"] == steps[-1]["metrics"]
    assert steps[1]["raised"] == {SPIKED: "int4->int8"}  # the measured worst layer first
    assert all(s["raised"] for s in steps[1:]) and not any(s["passed"] for s in steps[:-1])
    assert fallback["size_cost_bytes"] == steps[-1]["bytes"] - steps[0]["bytes"] > 0
    assert steps[-1]["bytes"] <= int(steps[0]["bytes"] * 1.25)


def fixed_steps_recipe(tmp_path, method: str) -> Path:
    """A recipe of one `method` target whose fallback takes fixed steps of one raise (tensors_per_step: 1;
    the default search is tested in tests/methods/test_fallback.py)."""
    recipe = tmp_path / "fixed.yaml"
    recipe.write_text(f"targets:\n  - name: {method}\n    method: {method}\n"
                      "    options: {fallback: {tensors_per_step: 1}}\n")
    return recipe


def spent_budget_run(cli, model, tmp_path, target_yaml: str, *args) -> dict:
    """Run a one-target recipe (`target_yaml`: its name, method and options lines) whose fallback runs
    out of max_size: exit 3, said on stderr, nothing written. Returns the target's JSON report."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("targets:\n" + target_yaml)
    out, json_path = tmp_path / "out", tmp_path / "report.json"
    result = cli("quantize", model, "--recipe", recipe, *CALIB_ARGS, *args, "-o", out, "--json", json_path)
    assert result.exit_code == 3, result.output
    assert "no raise fits in --max-size" in result.stderr
    assert_nothing_written(out)
    return json.loads(json_path.read_text())["targets"][0]


@pytest.mark.slow
def test_fallback_turns_a_failing_gate_into_a_passing_artifact(cli, spiky, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    result = cli("quantize", spiky, "--recipe", fixed_steps_recipe(tmp_path, "gptq"), *CALIB_ARGS, *GATE, "-o", out)
    assert result.exit_code == 0, result.output
    target = report(out)["targets"][0]
    details = target["details"]
    fallback, steps = details["fallback"], details["fallback"]["steps"]
    assert_fallback_passed(target, 0.0003)
    from quantkit.run.card import FIGURE

    card = ("quantkit.json", "README.md", FIGURE)  # the report and the model card, written after the plan's bytes
    assert sum(f.stat().st_size for f in out.rglob("*") if f.is_file() and f.name not in card) == steps[-1]["bytes"]
    # the sensitivity table measured at the first step, and the final plan
    assert details["sensitivity"]["measured"] and SPIKED in {r["tensor"] for r in details["sensitivity"]["tensors"]}
    types = details["mixed_precision"]["types"]
    assert fallback["types"] == types and types[SPIKED] != "int4"
    # the artifact: an int8 group of exact names, 16-bit layers ignored, reloaded by transformers
    config = quant_config(out)
    int8 = sorted(n for n, p in types.items() if p == "int8")
    assert config["config_groups"]["group_1"]["targets"] == int8
    assert config["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    assert {n for n, p in types.items() if p == "16-bit"} <= set(config["ignore"])
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    for name, precision in types.items():
        scheme = getattr(model.get_submodule(name), "quantization_scheme", None)
        assert (scheme.weights.num_bits if scheme else "16-bit") == {"int4": 4, "int8": 8}.get(precision, "16-bit")


@pytest.mark.slow
def test_auto_precision_with_fallback_stops_when_max_size_is_spent(cli, spiky, tmp_path):
    """An unreachable gate: auto_precision's own table drives the raises until no raise fits in +4%
    of the first artifact (measured: one step, KLD 9.8e-4 -> 7.5e-5); exit 3, nothing written, every
    step in the JSON report."""
    target = spent_budget_run(cli, spiky, tmp_path, "  - name: mixed\n    method: gptq\n"
                              "    options: {auto_precision: {}, fallback: {max_size: '+4%', tensors_per_step: 1}}\n",
                              "--max-kld", "0.000001", "--min-top1", "0")
    fallback = target["details"]["fallback"]
    steps = fallback["steps"]
    assert not fallback["passed"] and not target["gate"]["passed"] and len(steps) >= 2
    assert all(s["raised"] and not s["passed"] for s in steps[1:])
    assert steps[-1]["bytes"] <= int(steps[0]["bytes"] * 1.04)
    # the fallback starts from auto_precision's plan (at +5% it raised a small attention layer, the
    # spiked down_proj did not fit) and raises the table's worst layer first
    assert target["details"]["sensitivity"]["measured"]
    assert steps[1]["raised"] == {SPIKED: "int4->int8"}
    changed = target["details"]["mixed_precision"]["changed"]
    assert changed[SPIKED] == "int4->int8" and len(changed) >= 2
