"""mxfp4 end to end through the CLI: llm-compressor's MXFP4A16 preset key for key, and the group-of-32 width
rule refused before work."""

from __future__ import annotations

from tests.methods.conftest import (
    assert_metrics,
    assert_nothing_written,
    assert_same_as_llmcompressor,
    preset_artifact,
    quant_config,
    stored_tensors,
)


def test_mxfp4_is_llmcompressors_mxfp4a16(cli, micro_model, tmp_path):
    out = tmp_path / "mxfp4"
    result = cli("quantize", micro_model, "--method", "mxfp4", "-o", out, "--eval-windows", "4", "--no-gate")
    assert result.exit_code == 0, result.output
    bare = preset_artifact(micro_model, "MXFP4A16", tmp_path / "bare")
    assert_same_as_llmcompressor(out, bare, equal_values=(".weight_packed", ".weight_scale"))
    assert quant_config(out)["format"] == "mxfp4-pack-quantized"
    tensors = stored_tensors(out)
    assert tensors["model.layers.0.mlp.down_proj.weight_scale"] == ("U8", [256, 512 // 32])
    assert assert_metrics(out)["details"]["preset"] == "MXFP4A16"


def test_a_width_the_group_of_32_does_not_divide_is_refused_with_strict_shapes(cli, width_72_model, tmp_path):
    out = tmp_path / "mxfp4"
    result = cli("quantize", width_72_model, "--method", "mxfp4", "-o", out, "--strict-shapes")
    assert result.exit_code == 2
    assert "mxfp4: model.layers.0." in result.output and "not a multiple of the group of 32" in result.output
    assert_nothing_written(out)
