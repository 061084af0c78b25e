"""awq --auto-precision: gptq's per-layer int4/int8/16-bit plan (quantkit.mixed.layers) through
llm-compressor's AWQModifier, with the constraints AWQ puts on a plan (one precision per mapping's
quantized balance layers; a quantized smooth Linear keeps a quantized balance layer), and the mixed
artifact reloaded by transformers with its config groups."""

from __future__ import annotations

import pytest

from quantkit.methods import awq, gptq
from quantkit.mixed.sensitivity import SensitivityRow
from tests.methods.conftest import CALIB_ARGS, LOOSE_TOP1, quant_config, report
from tests.methods.test_gptq_auto import layer_stored_bytes, stored

DOWN = ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
UP = ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"]


def test_linear_rows_are_the_up_down_pairs_under_grouped_query_attention(micro_model):
    """The micro model's v_proj is narrower than o_proj's input (GQA): llm-compressor skips v -> o,
    and so does the constraint; up_proj -> down_proj stays, per decoder layer."""
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.methods.gptq import quantized_linears

    info = check_model_dir(micro_model)
    rows = awq.linear_rows(info, {name: tuple(shape) for name, shape in quantized_linears(info).items()})
    assert rows == [(UP[0], [DOWN[0]]), (UP[1], [DOWN[1]])]


def test_balance_layers_of_one_mapping_are_grouped_per_decoder_layer(micro_model):
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.methods.gptq import quantized_linears

    info = check_model_dir(micro_model)
    groups = awq.balance_groups(info, list(quantized_linears(info)))
    as_sets = sorted(sorted(g) for g in groups)
    for i in (0, 1):
        attention, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        assert sorted(attention + p for p in ("q_proj", "k_proj", "v_proj")) in as_sets
        assert sorted(mlp + p for p in ("gate_proj", "up_proj")) in as_sets
        assert [attention + "o_proj"] in as_sets and [mlp + "down_proj"] in as_sets
    assert sorted(n for g in groups for n in g) == sorted(quantized_linears(info))  # each layer once


def test_tied_plan_gives_a_group_one_precision_within_the_budget():
    """q alone is worth raising, but it shares AWQ's scale with k and v: the three move together."""
    scheme = gptq.Scheme(group_size=128, symmetric=False, element_bytes=2)
    rows = [SensitivityRow(n, (256, 256), {"int4": e, "int8": e / 256, "16-bit": 0.0}, "int4", "int4")
            for n, e in (("q", 100.0), ("k", 0.1), ("v", 0.1), ("o", 1.0))]
    int4 = sum(scheme.nbytes(r.shape, "int4") for r in rows)
    up = scheme.nbytes((256, 256), "int8") - scheme.nbytes((256, 256), "int4")
    groups = [["q", "k", "v"], ["o"]]
    assert awq.tied_plan(rows, groups, int4 + 2 * up, scheme) == {"q": "int4", "k": "int4", "v": "int4", "o": "int8"}
    assert awq.tied_plan(rows, groups, int4 + 3 * up, scheme) == {"q": "int8", "k": "int8", "v": "int8", "o": "int4"}
    assert awq.tied_plan(rows, groups, int4 + 4 * up, scheme) == {"q": "int8", "k": "int8", "v": "int8", "o": "int8"}


def test_a_quantized_smooth_layer_keeps_one_balance_layer_quantized():
    rows = [(UP[0], [DOWN[0]]), (UP[1], [DOWN[1]])]
    plan = {UP[0]: "int4", DOWN[0]: "16-bit", UP[1]: "16-bit", DOWN[1]: "16-bit"}
    # layer 0: down_proj back to int8 (AWQ divides by the quantized balance layers' count); layer 1:
    # nothing to smooth against, both stay 16-bit
    assert awq.keep_balance_quantized(plan, rows) == {**plan, DOWN[0]: "int8"}
    unchanged = {UP[0]: "int8", DOWN[0]: "int4", UP[1]: "16-bit", DOWN[1]: "int8"}
    assert awq.keep_balance_quantized(unchanged, rows) == unchanged
    both = [("v", ["o1", "o2"])]
    assert awq.keep_balance_quantized({"v": "int4", "o1": "16-bit", "o2": "16-bit"}, both) == {
        "v": "int4", "o1": "int8", "o2": "int8"}  # a row's balance layers go back together


def test_auto_precision_refuses_bits_8(cli, micro_model, tmp_path):
    result = cli("quantize", micro_model, "--method", "awq", "--auto-precision", "--bits", "8", *CALIB_ARGS,
                 "-o", tmp_path / "out")
    assert result.exit_code == 2 and "awq: auto_precision starts every layer at int4" in result.stderr, result.output


@pytest.mark.slow
def test_auto_precision_end_to_end_within_the_budget(cli, micro_model, tmp_path):
    """4.6 bits per weight: about W4A16 (asymmetric g128, 4.16 bits per weight) +10%. (At the default
    +5% no group fits on this tiny model: q/k/v raised together, or one 256 x 256 layer, adds more.)"""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "awq", "--auto-precision", "--budget-bpw", "4.6", *CALIB_ARGS,
                 *LOOSE_TOP1, "-o", out)
    assert result.exit_code == 0, result.output
    details = report(out)["targets"][0]["details"]
    mixed = details["mixed_precision"]
    weights = sum(r["shape"][0] * r["shape"][1] for r in details["sensitivity"]["tensors"])
    assert mixed["budget_bytes"] == int(4.6 * weights / 8)
    assert mixed["plain_bytes"] < mixed["bytes"] <= mixed["budget_bytes"]
    assert mixed["counts"]["int8"] >= 1 and set(mixed["types"].values()) <= {"int4", "int8"}
    assert details["sensitivity"]["measured"] and {r["tensor"] for r in details["sensitivity"]["tensors"]} == set(
        mixed["types"])
    tensors = stored(out)
    assert sum(layer_stored_bytes(tensors, name) for name in mixed["types"]) == mixed["bytes"]  # zero points too
    groups = quant_config(out)["config_groups"]
    int8 = sorted(n for n, p in mixed["types"].items() if p == "int8")
    assert groups["group_0"]["targets"] == ["Linear"] and groups["group_0"]["weights"]["symmetric"] is False
    assert groups["group_1"]["targets"] == int8 and groups["group_1"]["weights"]["strategy"] == "channel"
    assert groups["group_1"]["weights"]["num_bits"] == 8 and groups["group_1"]["weights"]["symmetric"] is True
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    for name, precision in mixed["types"].items():
        assert model.get_submodule(name).quantization_scheme.weights.num_bits == {"int4": 4, "int8": 8}[precision]


@pytest.mark.slow
def test_recipe_budget_keeps_layers_16_bit_and_awq_smooths_around_them(cli, micro_model, tmp_path):
    """A 12 bits-per-weight budget keeps some layers 16-bit; AWQ runs (q/k/v and gate/up each share a
    precision, no down_proj is 16-bit under a quantized up_proj) and the 16-bit layers are stored
    unquantized, in the ignore list."""
    import torch
    from compressed_tensors.quantization.utils import is_module_quantized
    from transformers import AutoModelForCausalLM

    recipe = tmp_path / "mixed.yaml"
    recipe.write_text("targets:\n  - name: mixed\n    method: awq\n"
                      "    options: {auto_precision: {budget_bpw: 12, measure_windows: 0}}\n")
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--recipe", recipe, *CALIB_ARGS, *LOOSE_TOP1, "-o", out)
    assert result.exit_code == 0, result.output
    mixed = report(out)["targets"][0]["details"]["mixed_precision"]
    assert mixed["bytes"] <= mixed["budget_bytes"]
    types = mixed["types"]
    kept = sorted(n for n, p in types.items() if p == "16-bit")
    assert kept and set(kept) <= set(quant_config(out)["ignore"])
    for up, down in zip(UP, DOWN):
        assert not (types[up] != "16-bit" and types[down] == "16-bit"), (up, down)
    for i in (0, 1):  # one precision per AWQ mapping's balance layers
        assert len({types[f"model.layers.{i}.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj")}) == 1
        assert len({types[f"model.layers.{i}.mlp.{p}"] for p in ("gate_proj", "up_proj")}) == 1
    tensors = stored(out)
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    for name in kept:
        assert tensors[name + ".weight"][0] == torch.bfloat16
        assert not is_module_quantized(model.get_submodule(name))
