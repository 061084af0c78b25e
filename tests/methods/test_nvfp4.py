"""nvfp4 end to end through the CLI: llm-compressor's NVFP4 (W4A4) and NVFP4A16 presets key for key, the
gate quantizing activations as the W4A4 kernels do, and the group-of-16 width rule refused before work."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.methods.conftest import (
    CALIB_ARGS,
    assert_metrics,
    assert_nothing_written,
    assert_same_as_llmcompressor,
    preset_artifact,
    quant_config,
    stored_tensors,
)

WEIGHTS = (".weight_packed", ".weight_scale", ".weight_global_scale")


def test_nvfp4_w4a4_is_llmcompressors_nvfp4(cli, micro_model, tmp_path):
    out = tmp_path / "nvfp4"
    result = cli("quantize", micro_model, "--method", "nvfp4", "-o", out, *CALIB_ARGS, "--no-gate")
    assert result.exit_code == 0, result.output
    bare = preset_artifact(micro_model, "NVFP4", tmp_path / "bare", windows=4)
    assert_same_as_llmcompressor(out, bare, equal_values=WEIGHTS)  # input_global_scale: other windows
    config = quant_config(out)
    assert config["format"] == "nvfp4-pack-quantized"
    tensors = stored_tensors(out)
    packed = [k for k in tensors if k.endswith("_proj.weight_packed")]
    assert len(packed) == 14 and all(tensors[k][0] == "U8" for k in packed)
    assert all(tensors[k.replace("weight_packed", "input_global_scale")][0] == "F32" for k in packed)
    entry = assert_metrics(out)
    assert entry["details"]["preset"] == "NVFP4" and entry["details"]["calibration_tokens"] == 16 * 64


def test_the_gate_quantizes_w4a4_activations(cli, micro_model, tmp_path):
    """The artifact as the gate loads it against the same weights with the activations left 16-bit (its
    config without input_activations): the logits differ, so the activation rounding is measured."""
    import torch

    from quantkit.formats.gate import load_artifact

    out = tmp_path / "nvfp4"
    assert cli("quantize", micro_model, "--method", "nvfp4", "-o", out, *CALIB_ARGS, "--eval-windows", "0").exit_code == 0
    weights_only = tmp_path / "a16-view"
    shutil.copytree(out, weights_only)
    config = json.loads((weights_only / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = None
    (weights_only / "config.json").write_text(json.dumps(config))
    for path in weights_only.glob("*.safetensors"):  # the stored input_global_scale would be unexpected
        from safetensors.torch import load_file, save_file

        save_file({k: v for k, v in load_file(path).items() if not k.endswith("input_global_scale")}, path,
                  metadata={"format": "pt"})
    ids = torch.randint(0, 500, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        w4a4, a16 = (load_artifact(p)(ids).logits.float() for p in (out, weights_only))
    assert (w4a4 - a16).abs().max() > 1e-3


@pytest.mark.slow
def test_nvfp4_a16_is_llmcompressors_nvfp4a16(cli, micro_model, tmp_path):
    out = tmp_path / "a16"
    result = cli("quantize", micro_model, "--method", "nvfp4", "--scheme", "a16", "-o", out, "--eval-windows", "4",
                 "--no-gate")
    assert result.exit_code == 0, result.output
    assert_same_as_llmcompressor(out, preset_artifact(micro_model, "NVFP4A16", tmp_path / "bare"),
                                 equal_values=WEIGHTS)
    assert "input_global_scale" not in " ".join(stored_tensors(out))


def test_a_width_the_group_does_not_divide_stays_16_bit_or_is_refused(cli, width_72_model, tmp_path):
    """hidden 72: the layers reading it stay 16-bit (down_proj, reading 128, is FP4); --strict-shapes refuses."""
    out = tmp_path / "nvfp4"
    result = cli("quantize", width_72_model, "--method", "nvfp4", "--scheme", "a16", "-o", out, "--no-gate",
                 "--eval-windows", "2")
    assert result.exit_code == 0, result.output
    assert ("kept 16-bit: 6 layer(s) (their widths do not tile in the format): model.layers.0.mlp.gate_proj"
            in result.stderr)
    assert "model.layers.0.mlp.down_proj.weight_packed" in stored_tensors(out)
    assert "model.layers.0.self_attn.q_proj.weight_packed" not in stored_tensors(out)
    strict = tmp_path / "strict"
    result = cli("quantize", width_72_model, "--method", "nvfp4", "--scheme", "a16", "-o", strict, "--strict-shapes")
    assert result.exit_code == 2
    assert "nvfp4: model.layers.0." in result.output and "not a multiple of the group of 16" in result.output
    assert_nothing_written(strict)
