"""fp8 --scheme fp8-block end to end through the CLI: llm-compressor's FP8_BLOCK preset, key for key, and the
128-wide block shape rule of vLLM's kernels: layers it cannot tile kept 16-bit and listed, or refused
before any work with --strict-shapes (and always when no layer would be left to quantize)."""

from __future__ import annotations

from tests.methods.conftest import (
    assert_metrics,
    assert_nothing_written,
    assert_same_as_llmcompressor,
    preset_artifact,
    quant_config,
    stored_tensors,
)
from tests.util import FAST_CALIB


def test_fp8_block_is_llmcompressors_fp8_block(cli, micro_model, tmp_path):
    out = tmp_path / "block"
    result = cli("quantize", micro_model, "--method", "fp8", "--scheme", "fp8-block", "-o", out, *FAST_CALIB,
                 "--min-top1", "0")
    assert result.exit_code == 0, result.output
    bare = preset_artifact(micro_model, "FP8_BLOCK", tmp_path / "bare")
    assert_same_as_llmcompressor(out, bare, equal_values=(".weight", ".weight_scale"))
    group = quant_config(out)["config_groups"]["group_0"]
    assert group["weights"]["block_structure"] == [128, 128] and group["input_activations"]["group_size"] == 128
    tensors = stored_tensors(out)
    projections = [k for k in tensors if k.endswith("_proj.weight")]
    assert projections and all(tensors[k][0] == "F8_E4M3" for k in projections)
    out_rows, width = tensors["model.layers.0.mlp.down_proj.weight"][1]
    assert tensors["model.layers.0.mlp.down_proj.weight_scale"][1] == [out_rows // 128, width // 128]
    entry = assert_metrics(out)
    assert entry["details"]["path"].startswith("oneshot: fp8-block")


def test_fp8_block_keeps_the_layers_it_cannot_tile_in_16_bit(cli, narrow_kv_model, tmp_path):
    """64-wide k/v projections: kept 16-bit, and q_proj with them (vLLM fuses q/k/v into one layer, which
    takes one scheme), listed in the output, quantkit.json and the model card; the rest is fp8."""
    import json

    out = tmp_path / "block"
    result = cli("quantize", narrow_kv_model, "--method", "fp8", "--scheme", "fp8-block", "-o", out, *FAST_CALIB,
                 "--no-gate")
    assert result.exit_code == 0, result.output
    narrow = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "kv"]
    fused = [f"model.layers.{i}.self_attn.q_proj" for i in range(2)]
    assert "kept 16-bit: 6 layer(s) (their widths do not tile in the format; vLLM fuses them with a 16-bit shard)" \
        in result.stderr
    tensors = stored_tensors(out)
    for name in narrow + fused:
        assert tensors[f"{name}.weight"][0] == "F32" and f"{name}.weight_scale" not in tensors  # as stored
    assert tensors["model.layers.0.self_attn.o_proj.weight"][0] == "F8_E4M3"
    entry = json.loads((out / "quantkit.json").read_text())["targets"][0]
    kept = entry["details"]["kept_16bit"]
    assert sorted(kept) == sorted(narrow + fused)
    assert "output width 64 not a multiple of 128" in kept[narrow[0]] and "self_attn.qkv_proj" in kept[fused[0]]
    assert set(kept) <= set(entry["ignore"]) and set(kept) <= set(quant_config(out)["ignore"])
    assert "Also kept 16-bit: 6 layer(s)" in (out / "README.md").read_text()


def test_strict_shapes_refuses_a_width_the_kernels_cannot_take(cli, narrow_kv_model, tmp_path):
    out = tmp_path / "block"
    result = cli("quantize", narrow_kv_model, "--method", "fp8", "--scheme", "fp8-block", "-o", out, "--strict-shapes")
    assert result.exit_code == 2
    assert "fp8: model.layers.0.self_attn.k_proj: output width 64 not a multiple of 128" in result.output
    assert "4 layer(s) do not tile" in result.output and "--ignore model.layers.0.self_attn.k_proj" in result.output
    assert_nothing_written(out)


def test_fp8_block_refuses_a_model_it_can_tile_no_layer_of(cli, odd_model, tmp_path):
    """hidden 192: every layer reads or writes the hidden state, which 128 does not divide."""
    out = tmp_path / "block"
    result = cli("quantize", odd_model, "--method", "fp8", "--scheme", "fp8-block", "-o", out)
    assert result.exit_code == 2
    assert "fp8 can tile no layer of this model (model.layers.0." in result.output and "not a multiple of 128" in result.output
    assert_nothing_written(out)


def test_inspect_shows_the_layers_the_rules_keep(cli, narrow_kv_model, tmp_path):
    import json

    recipe = tmp_path / "block.yaml"
    recipe.write_text("targets:\n  - name: block\n    method: fp8\n    options: {scheme: fp8-block}\n")
    data = json.loads(cli("inspect", narrow_kv_model, "--recipe", recipe, "--json", "-").stdout)
    precisions = {m["name"]: m["precision"] for m in data["modules"]}
    assert precisions["model.layers.0.self_attn.k_proj"].endswith("(kept: widths do not tile)")
    assert precisions["model.layers.0.self_attn.q_proj"].endswith("(kept: fused with a 16-bit shard)")
    assert precisions["model.layers.0.self_attn.o_proj"].startswith("fp8-e4m3 W/block128x128")
    assert len(data["kept_16bit"]) == 6
