"""gptq --auto-precision: the size model, the budget, the plan, and the mixed int4/int8/16-bit artifact
reloaded by transformers with its config groups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantkit.methods import gptq
from quantkit.mixed import layers as intmix
from quantkit.mixed.budget import BudgetError, assign, total_bytes
from quantkit.mixed.sensitivity import SensitivityRow, set_gains
from tests.methods.conftest import CALIB_ARGS, LOOSE_TOP1, probe_window_bound, quant_config, report

G64_SYM = gptq.Scheme(group_size=64, symmetric=True, element_bytes=2)


def test_layer_bytes_counts_packed_weights_scales_zero_points_and_shape():
    # (512, 256) int4 g64: 512 rows x 32 int32 words, 512 x 4 bf16 scales, the int64 shape pair
    assert gptq.layer_bytes((512, 256), "int4", 64, True, 2) == 512 * 32 * 4 + 512 * 4 * 2 + 16
    # asymmetric: zero points packed 8 to an int32 along the output rows, one column per group
    assert gptq.layer_bytes((512, 256), "int4", 64, False, 2) == 512 * 32 * 4 + 512 * 4 * 2 + 64 * 4 * 4 + 16
    # int8 is symmetric per channel whatever the int4 scheme: one scale per output row, no zero point
    assert gptq.layer_bytes((512, 256), "int8", 64, True, 2) == 512 * 64 * 4 + 512 * 2 + 16
    assert gptq.layer_bytes((512, 256), "int8", 64, False, 2) == 512 * 64 * 4 + 512 * 2 + 16
    assert gptq.layer_bytes((512, 256), "16-bit", 64, True, 2) == 512 * 256 * 2
    assert gptq.layer_bytes((512, 256), "int4", -1, True, 2) == 512 * 32 * 4 + 512 * 2 + 16  # per channel
    # W4A16 g128 sym is 4 + 16/128 bits per weight, plus the shape pair
    assert gptq.layer_bytes((4096, 4096), "int4", 128, True, 2) * 8 / 4096**2 == pytest.approx(4.125, abs=1e-5)


def test_budget_is_w4a16_plus_headroom_or_bits_per_weight():
    shapes = [(512, 256), (256, 256)]
    int4 = sum(G64_SYM.nbytes(s, "int4") for s in shapes)
    assert gptq.budget_bytes(gptq.AutoPrecision(), shapes, G64_SYM) == (int(int4 * 1.05), int4)
    assert gptq.budget_bytes(gptq.AutoPrecision(headroom=0.5), shapes, G64_SYM)[0] == int(int4 * 1.5)
    weights = 512 * 256 + 256 * 256
    assert gptq.budget_bytes(gptq.AutoPrecision(budget_bpw=6), shapes, G64_SYM) == (weights * 6 // 8, int4)
    with pytest.raises(BudgetError, match="cannot be met"):
        gptq.budget_bytes(gptq.AutoPrecision(budget_bpw=4.1), shapes, G64_SYM)  # int4 g64 is 4.25 bpw


def layer(name: str, int4: float, shape=(256, 256)) -> SensitivityRow:
    """A row whose int8 error is 1/256 of its int4 error (what 4 more bits do to RTN)."""
    return SensitivityRow(name, shape, {"int4": int4, "int8": int4 / 256, "16-bit": 0.0}, "int4", "int4")


def test_plan_stays_within_the_budget_and_raises_the_sensitive_layers_first():
    table = [layer("a", 100.0), layer("b", 1.0), layer("c", 1.0, (512, 256)), layer("d", 5.0)]
    int4 = total_bytes(table, {r.name: "int4" for r in table}, G64_SYM.size)
    one_up = G64_SYM.nbytes((256, 256), "int8") - G64_SYM.nbytes((256, 256), "int4")
    choice = assign(table, int4 + one_up, G64_SYM.size)
    assert choice == {"a": "int8", "b": "int4", "c": "int4", "d": "int4"}
    choice = assign(table, int4 + 2 * one_up, G64_SYM.size)
    assert choice == {"a": "int8", "b": "int4", "c": "int4", "d": "int8"}
    for budget in (int4, int(int4 * 1.05), int(int4 * 1.5), int4 * 3):
        assert total_bytes(table, assign(table, budget, G64_SYM.size), G64_SYM.size) <= budget
    everything = total_bytes(table, {r.name: "16-bit" for r in table}, G64_SYM.size)
    assert set(assign(table, everything, G64_SYM.size).values()) == {"16-bit"}
    assert set(assign(table, int4, G64_SYM.size).values()) == {"int4"}  # the floor: all int4
    with pytest.raises(BudgetError):
        assign(table, int4 - 1, G64_SYM.size)


def test_measured_kld_scales_the_error_curve():
    row = SensitivityRow("a", (256, 256), {"int4": 2.0, "int8": 0.5, "16-bit": 0.0}, "int4")
    set_gains([row], {"a": 0.01})
    assert row.damage("int4") == pytest.approx(0.01)
    assert row.damage("int8") == pytest.approx(0.0025)
    assert row.damage("16-bit") == 0.0


def test_rtn_is_compressed_tensors_rounding():
    """int4 RTN keeps at most 16 levels per group, int8 at most 256 per row, each within half a step."""
    import torch

    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    int4 = intmix.rtn(weight, G64_SYM.args("int4"))
    for group in int4.reshape(64, 2, 64).unbind(1):
        assert max(len(torch.unique(row)) for row in group) <= 16
    step = weight.reshape(64, 2, 64).abs().amax(-1) / 7.5
    assert ((weight - int4).reshape(64, 2, 64).abs() <= step[..., None] / 2 + 1e-6).all()
    int8 = intmix.rtn(weight, G64_SYM.args("int8"))
    assert (weight - int8).abs().max() < (weight - int4).abs().max() / 8


# ------------------------------------------------------------------ end to end


def stored(out: Path) -> dict:
    """{tensor name: (dtype, shape, bytes)} of the artifact's safetensors."""
    from safetensors import safe_open

    tensors = {}
    for file in out.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                tensors[key] = (t.dtype, tuple(t.shape), t.numel() * t.element_size())
    return tensors


def layer_stored_bytes(tensors: dict, name: str) -> int:
    return sum(n for key, (_d, _s, n) in tensors.items() if key.rsplit(".", 1)[0] == name and "bias" not in key)


@pytest.fixture(scope="module")
def auto_out(cli, micro_model, tmp_path_factory) -> Path:
    """+20%: on the micro model a raise of a whole q/k/v or gate/up group to int8 takes more than 5%."""
    root = tmp_path_factory.mktemp("gptq-auto")
    recipe = root / "auto.yaml"
    recipe.write_text("targets:\n  - name: gptq\n    method: gptq\n    options: {auto_precision: {headroom: 0.2}}\n")
    result = cli("quantize", micro_model, "--recipe", recipe, *CALIB_ARGS, *LOOSE_TOP1, "-o", root / "out")
    assert result.exit_code == 0, result.output
    return root / "out"


def test_auto_precision_end_to_end_within_w4a16_plus_headroom(auto_out, micro_model):
    details = report(auto_out)["targets"][0]["details"]
    mixed = details["mixed_precision"]
    assert mixed["budget_bytes"] == int(mixed["plain_bytes"] * 1.2)
    assert mixed["plain_bytes"] < mixed["bytes"] <= mixed["budget_bytes"]
    assert mixed["counts"]["int8"] >= 1 and set(mixed["types"].values()) <= {"int4", "int8"}
    types = mixed["types"]
    for layer in range(2):  # the shards vLLM fuses into one layer share one precision
        prefix = f"model.layers.{layer}."
        assert len({types[prefix + f"self_attn.{p}_proj"] for p in "qkv"}) == 1
        assert types[prefix + "mlp.gate_proj"] == types[prefix + "mlp.up_proj"]
    tensors = stored(auto_out)
    assert sum(layer_stored_bytes(tensors, name) for name in mixed["types"]) == mixed["bytes"]  # the size model
    table = details["sensitivity"]
    assert table["measured"] and table["candidates"] == ["int4", "int8", "16-bit"]
    assert table["windows"] == probe_window_bound(micro_model, table, 8, 16)  # 16 calibration windows
    assert {r["tensor"] for r in table["tensors"]} == set(mixed["types"])
    assert all(r["kld"] > 0 and r["damage"]["int4"] > r["damage"]["int8"] > 0 for r in table["tensors"])
    assert set(table["seconds"]) == {"statistics", "errors", "kld", "total"}


def test_artifact_has_an_int8_config_group_of_exact_names_and_reloads(auto_out):
    from transformers import AutoModelForCausalLM

    types = report(auto_out)["targets"][0]["details"]["mixed_precision"]["types"]
    int8 = sorted(n for n, p in types.items() if p == "int8")
    groups = quant_config(auto_out)["config_groups"]
    assert groups["group_0"]["targets"] == ["Linear"] and groups["group_0"]["weights"]["num_bits"] == 4
    assert groups["group_0"]["weights"]["strategy"] == "group" and groups["group_0"]["weights"]["group_size"] == 128
    assert groups["group_1"]["targets"] == int8
    assert groups["group_1"]["weights"]["num_bits"] == 8 and groups["group_1"]["weights"]["strategy"] == "channel"
    tensors = stored(auto_out)
    for name, precision in types.items():
        _dtype, packed, _n = tensors[name + ".weight_packed"]
        _dtype, scale, _n = tensors[name + ".weight_scale"]
        in_features = {"int4": packed[1] * 8, "int8": packed[1] * 4}[precision]
        assert scale[1] == (1 if precision == "int8" else in_features // 128), name
    model = AutoModelForCausalLM.from_pretrained(auto_out, device_map="cpu")
    for name, precision in types.items():
        scheme = model.get_submodule(name).quantization_scheme
        assert scheme.weights.num_bits == {"int4": 4, "int8": 8}[precision], name


def test_inspect_shows_the_layer_sensitivity_table(cli, auto_out):
    result = cli("inspect", auto_out, "--sensitivity")
    assert result.exit_code == 0, result.output
    assert "per-tensor sensitivity" in result.stdout and "model.layers.1.mlp.down_proj" in result.stdout
    data = json.loads(cli("inspect", auto_out, "--sensitivity", "--json", "-").stdout)
    assert data["gptq"]["types"] and data["gptq"]["sensitivity"]["candidates"] == ["int4", "int8", "16-bit"]
    rho = data["gptq"]["sensitivity"]["rank_correlation"]  # the weighted error against the probes' measured KLD
    assert -1 <= rho <= 1 and f"Spearman's rho {rho:.2f}" in result.stdout.replace("\n", " ")


def test_recipe_budget_bpw_keeps_some_layers_16_bit(cli, micro_model, tmp_path):
    """A recipe's auto_precision options: asymmetric int4 g64, a 12 bits-per-weight budget (room for
    every layer at int8 and some at 16 bits), the weighted error alone (no measured KLD)."""
    import torch
    from compressed_tensors.quantization.utils import is_module_quantized
    from transformers import AutoModelForCausalLM

    recipe = tmp_path / "mixed.yaml"
    recipe.write_text("targets:\n  - name: mixed\n    method: gptq\n    options: {group_size: 64, symmetric: false, "
                      "act_order: none, auto_precision: {budget_bpw: 12, measure_windows: 0}}\n")
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--recipe", recipe, *CALIB_ARGS, *LOOSE_TOP1, "-o", out)
    assert result.exit_code == 0, result.output
    details = report(out)["targets"][0]["details"]
    mixed, table = details["mixed_precision"], details["sensitivity"]
    assert not table["measured"] and all(r["kld"] is None for r in table["tensors"])
    weights = sum(r["shape"][0] * r["shape"][1] for r in table["tensors"])
    assert mixed["budget_bytes"] == int(12 * weights / 8) and mixed["bytes"] <= mixed["budget_bytes"]
    kept = sorted(n for n, p in mixed["types"].items() if p == "16-bit")
    assert kept and mixed["counts"]["int8"] >= 1
    config = quant_config(out)
    assert set(kept) <= set(config["ignore"])
    # int4 with the recipe's zero points; int8 symmetric per channel whatever the int4 scheme
    assert {g["weights"]["num_bits"]: g["weights"]["symmetric"] for g in config["config_groups"].values()} \
        in ({4: False, 8: True}, {8: True})
    tensors = stored(out)
    assert sum(layer_stored_bytes(tensors, name) for name in mixed["types"]) == mixed["bytes"]  # zero points too
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    for name in kept:
        assert tensors[name + ".weight"][0] == torch.bfloat16
        assert not is_module_quantized(model.get_submodule(name))


def test_auto_precision_refuses_bits_8_and_group_act_order(cli, micro_model, tmp_path):
    for extra, message in ((("--bits", "8"), "starts every layer at int4"),
                           (("--act-order", "group"), "act_order=group cannot order")):
        result = cli("quantize", micro_model, "--method", "gptq", "--auto-precision", *extra, *CALIB_ARGS,
                     "-o", tmp_path / "out")
        assert result.exit_code == 2 and message in result.stderr, result.output


def test_a_budget_below_all_int4_is_refused_before_work(cli, micro_model, tmp_path):
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "gptq", "--budget-bpw", "3", *CALIB_ARGS, "-o", out)
    assert result.exit_code == 2 and "budget_bpw=3.0: a budget of" in result.stderr, result.output
    assert "cannot be met" in result.stderr and "quantizing" not in result.stderr
    assert not out.exists()
