"""awq --fallback: a fallback step (quantkit.mixed.budget.raise_plan on awq's ladder) over AWQ's raise units (a
mapping's balance layers raised together; a quantized smooth layer's balance layers at most int8), and
end to end a failing gate turned into a passing mixed int4/int8 artifact, or stopped with exit 3 when
max_size is spent."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantkit.methods import QuantizeJob, QuantizeResult, awq
from quantkit.mixed import layers as intmix
from quantkit.mixed.budget import Fallback, raise_plan
from quantkit.mixed.sensitivity import SensitivityRow
from tests.methods.conftest import CALIB_ARGS, quant_config, report
from tests.methods.test_gptq_fallback import (  # noqa: F401
    SPIKED,
    assert_fallback_passed,
    fixed_steps_recipe,
    spent_budget_run,
    spiky,  # spiky: the module fixture
)

ATTENTION, MLP = "model.layers.0.self_attn.", "model.layers.0.mlp."
SHAPES = {ATTENTION + "q_proj": (256, 256), ATTENTION + "k_proj": (64, 256), ATTENTION + "v_proj": (64, 256),
          ATTENTION + "o_proj": (256, 256), MLP + "gate_proj": (512, 256), MLP + "up_proj": (512, 256),
          MLP + "down_proj": (256, 512)}  # one decoder layer of a GQA Llama: no v -> o row, up -> down stays
QKV = [ATTENTION + p for p in ("q_proj", "k_proj", "v_proj")]
GATE_UP, UP, DOWN = [MLP + "gate_proj", MLP + "up_proj"], MLP + "up_proj", MLP + "down_proj"


def llama(path: Path):
    from quantkit.io.checkpoint import ModelInfo

    return ModelInfo(path, {"torch_dtype": "bfloat16"}, [], "LlamaForCausalLM", "llama")


def table(int4: dict[str, float]) -> list[SensitivityRow]:
    """Every layer's damage: `int4` at int4 (default 1), half of it at int8 (so a raised layer can stay
    the worst), none at 16-bit."""
    return [SensitivityRow(name, shape, {"int4": int4.get(name, 1.0), "int8": int4.get(name, 1.0) / 2,
                                         "16-bit": 0.0}, "int4", "int4") for name, shape in SHAPES.items()]


def test_fallback_units_tie_balance_layers_and_cap_a_smoothed_down_proj_at_int8(tmp_path):
    info, rows = llama(tmp_path), table({})
    units = {u.name: u for u in awq.fallback_units(info, rows, {name: "int4" for name in SHAPES})}
    assert sorted(sorted(m.name for m in u.members) for u in units.values()) == sorted(
        [sorted(QKV), [ATTENTION + "o_proj"], sorted(GATE_UP), [DOWN]])
    assert units[DOWN].candidates == ["int4", "int8"]  # up_proj quantized: down_proj may not go 16-bit
    assert units[QKV[0]].candidates == units[ATTENTION + "o_proj"].candidates == ["int4", "int8", "16-bit"]
    assert units[QKV[0]].damage("int4") == 3.0  # a unit's damage: its members' together
    up_kept = {name: "16-bit" if name in GATE_UP else "int8" for name in SHAPES}
    down = next(u for u in awq.fallback_units(info, rows, up_kept) if u.name == DOWN)
    assert down.candidates == ["int4", "int8", "16-bit"]  # nothing left to smooth against: no cap


def plan_job(tmp_path: Path, tensors_per_step: int) -> QuantizeJob:
    options = awq.Options(group_size=128, fallback=Fallback(max_size="10MB", tensors_per_step=tensors_per_step))
    return QuantizeJob(llama(tmp_path), options, None, [], tmp_path, tmp_path)


def ladder_for(tmp_path: Path, rows: list[SensitivityRow]):
    job = plan_job(tmp_path, tensors_per_step=1)
    details = {"sensitivity": intmix.LayerTable(rows, False).as_dict()}
    return awq.fallback_ladder(job, QuantizeResult(tmp_path, details))


def test_a_step_raises_tied_groups_together_and_never_a_smoothed_down_proj_to_16_bit(tmp_path):
    """down_proj does the most damage at int4 and at int8, but at int8 it stays while up_proj is quantized:
    the next step raises q/k/v, together."""
    ladder = ladder_for(tmp_path, table({DOWN: 1000.0, QKV[0]: 10.0}))
    first, raised = raise_plan(ladder, ladder.plan, 1, 10**9)
    assert first == {**{name: "int4" for name in SHAPES}, DOWN: "int8"} and raised == {DOWN: ("int4", "int8")}
    second, raised = raise_plan(ladder, first, 1, 10**9)
    assert second == {**first, **{name: "int8" for name in QKV}}
    assert raised == {name: ("int4", "int8") for name in QKV}


def test_every_fallback_step_keeps_awq_constraints_until_nothing_is_left_to_raise(tmp_path):
    """Step after step, two units at a time, from plain int4 to the top: each plan gives a tied group one
    precision and keeps a quantized balance layer under a quantized up_proj; one layer stays quantized."""
    ladder = ladder_for(tmp_path, table({DOWN: 1000.0, MLP + "gate_proj": 50.0}))
    rows = awq.linear_rows(llama(tmp_path), SHAPES)
    plan, plans = ladder.plan, []
    while (step := raise_plan(ladder, plan, 2, 10**9))[1]:
        plan = step[0]
        plans.append(plan)
        assert len({plan[n] for n in QKV}) == 1 and len({plan[n] for n in GATE_UP}) == 1
        assert awq.keep_balance_quantized(plan, rows) == plan
        assert len(plans) < 20
    assert len(plans) >= 3 and set(plans[-1].values()) != {"16-bit"}
    assert plans[-1][DOWN] == "16-bit" and plans[-1][UP] == "16-bit"  # once up_proj was 16-bit, down_proj went


def test_recipe_fallback_is_accepted_for_awq(tmp_path):
    from quantkit.run.recipe import target_options, validate

    recipe = validate({"targets": [{"name": "a", "method": "awq", "options": {"fallback": {"max_size": "+10%"}}}]})
    options = target_options(recipe.targets[0])
    assert options.fallback == Fallback(max_size="+10%") and "fallback" in awq.precision("decoder", options, "x", [1, 1])


def test_fallback_refuses_bits_8_before_work(cli, micro_model, tmp_path):
    result = cli("quantize", micro_model, "--method", "awq", "--fallback", "--bits", "8", *CALIB_ARGS,
                 "-o", tmp_path / "out")
    assert result.exit_code == 2 and "awq: fallback starts every layer at int4" in result.stderr, result.output


# ------------------------------------------------------------------ end to end

# measured on the spiky model (plain AWQ W4A16 asymmetric g128, KLD 1.31e-3): layers.1 down_proj at int8
# 1.03e-3, then layers.1 gate/up at int8 together 6.0e-4 (then q/k/v of layer 0, 5.6e-4; layer 0's
# down_proj, 1.6e-4)
GATE = ("--max-kld", "0.0008", "--min-top1", "0", "--max-ppl-increase", "10")


@pytest.mark.slow
def test_fallback_turns_a_failing_gate_into_a_passing_artifact(cli, spiky, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    result = cli("quantize", spiky, "--recipe", fixed_steps_recipe(tmp_path, "awq"), *CALIB_ARGS, *GATE, "-o", out)
    assert result.exit_code == 0, result.output
    target = report(out)["targets"][0]
    details = target["details"]
    fallback, steps = details["fallback"], details["fallback"]["steps"]
    assert_fallback_passed(target, 0.0008)
    # then its smooth layer up_proj, which shares AWQ's scale with gate_proj: raised together
    assert steps[2]["raised"] == {f"model.layers.1.mlp.{p}": "int4->int8" for p in ("gate_proj", "up_proj")}
    assert details["sensitivity"]["measured"]
    types = details["mixed_precision"]["types"]
    assert fallback["types"] == types and types[SPIKED] == "int8"
    for i in (0, 1):  # AWQ's constraints hold in the final plan
        assert len({types[f"model.layers.{i}.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj")}) == 1
        assert len({types[f"model.layers.{i}.mlp.{p}"] for p in ("gate_proj", "up_proj")}) == 1
        assert not (types[f"model.layers.{i}.mlp.up_proj"] != "16-bit" and types[f"model.layers.{i}.mlp.down_proj"]
                    == "16-bit")
    # the artifact: a symmetric int8 group of exact names, reloaded by transformers
    groups = quant_config(out)["config_groups"]
    assert groups["group_1"]["targets"] == sorted(n for n, p in types.items() if p == "int8")
    assert groups["group_1"]["weights"]["num_bits"] == 8 and groups["group_1"]["weights"]["symmetric"] is True
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    for name, precision in types.items():
        assert model.get_submodule(name).quantization_scheme.weights.num_bits == {"int4": 4, "int8": 8}[precision]


@pytest.mark.slow
def test_fallback_stops_with_exit_3_when_max_size_is_spent(cli, spiky, tmp_path):
    """+4% of the first artifact holds layers.1 down_proj at int8 (+3.7%), not gate/up after it: the gate
    still fails, exit 3, nothing written, both steps in the JSON report."""
    target = spent_budget_run(cli, spiky, tmp_path,
                              "  - name: awq\n    method: awq\n"
                              "    options: {fallback: {max_size: '+4%', tensors_per_step: 1}}\n", *GATE)
    fallback = target["details"]["fallback"]
    steps = fallback["steps"]
    assert not fallback["passed"] and not target["gate"]["passed"] and len(steps) == 2
    assert steps[1]["raised"] == {SPIKED: "int4->int8"} and not steps[1]["passed"]
    assert steps[0]["bytes"] < steps[1]["bytes"] <= int(steps[0]["bytes"] * 1.04)
