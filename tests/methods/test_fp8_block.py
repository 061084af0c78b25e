"""fp8 --scheme fp8-block end to end through the CLI: llm-compressor's FP8_BLOCK preset, key for key, and the
128-wide block shape rule of vLLM's kernels refused before any work."""

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


def test_fp8_block_refuses_a_width_the_kernels_cannot_take(cli, odd_model, tmp_path):
    """hidden 192: every layer reading the hidden state has an input width that is not a multiple of 128."""
    out = tmp_path / "block"
    result = cli("quantize", odd_model, "--method", "fp8", "--scheme", "fp8-block", "-o", out)
    assert result.exit_code == 2
    assert "fp8-block: model.layers.0." in result.output and "not a multiple of 128" in result.output
    assert "--ignore model.layers.0." in result.output
    assert_nothing_written(out)
