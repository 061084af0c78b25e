"""smoothquant W8A8 end to end through the CLI on a micro model, and its bad-input cases."""

from __future__ import annotations

from tests.methods.conftest import (
    CALIB_ARGS,
    LOOSE_TOP1,
    assert_metrics,
    assert_nothing_written,
    mean_kld_vs_base,
    quant_config,
)


def test_smoothquant_end_to_end(cli, micro_model, tmp_path):
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "smoothquant", "--smoothing-strength", 0.5,
                     *CALIB_ARGS, *LOOSE_TOP1, "-o", out)
    assert result.exit_code == 0, result.output
    config = quant_config(out)
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "int-quantized"
    group = config["config_groups"]["group_0"]
    assert (group["weights"]["num_bits"], group["weights"]["strategy"]) == (8, "channel")
    acts = group["input_activations"]
    assert (acts["num_bits"], acts["type"], acts["strategy"], acts["dynamic"]) == (8, "int", "token", True)
    entry = assert_metrics(out)
    assert entry["details"]["smoothing_strength"] == 0.5
    assert mean_kld_vs_base(out, micro_model) < 0.05


def test_smoothquant_unknown_architecture(cli, gpt2_model, tmp_path):
    out = tmp_path / "out"
    result = cli("quantize", gpt2_model, "--method", "smoothquant", *CALIB_ARGS, "-o", out)
    assert result.exit_code == 2, result.output
    assert "architecture 'gpt2'" in result.output and "llama" in result.output
    assert_nothing_written(out)


def test_smoothquant_bad_strength_and_too_few_tokens(cli, micro_model, tmp_path):
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "smoothquant", "--smoothing-strength", 1.5,
                     *CALIB_ARGS, "-o", out)
    assert result.exit_code == 2 and "smoothing_strength=1.5" in result.output
    result = cli("quantize", micro_model, "--method", "smoothquant", "--num-samples", 4, "--seq-len", 32,
                     "-o", out)
    assert result.exit_code == 2 and "too few" in result.output
    assert_nothing_written(out)


def test_gemma2_maps_the_mlp_to_pre_feedforward_norm():
    from quantkit.arch.mappings import smoothquant_mappings

    smooth_layers = [m.smooth for m in smoothquant_mappings("gemma2")]
    assert "re:.*pre_feedforward_layernorm$" in smooth_layers
    assert "re:.*post_attention_layernorm$" not in smooth_layers
