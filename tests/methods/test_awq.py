"""awq end to end on CPU (exercises the pin_memory workaround), mappings, and bad inputs."""

from __future__ import annotations

import pytest
import yaml

from tests.methods.conftest import (
    CALIB_ARGS,
    LOOSE_TOP1,
    assert_beats_rtn,
    assert_metrics,
    assert_nothing_written,
    mean_kld_vs_base,
    quant_config,
)


def awq_recipe(tmp_path, **options) -> str:
    path = tmp_path / "awq.yaml"
    path.write_text(yaml.safe_dump({"targets": [{"name": "awq", "method": "awq", "options": options}]}))
    return str(path)


def test_awq_end_to_end_on_cpu(cli, micro_model, tmp_path):
    """Fails (exit 1, 'Cannot access accelerator device') if the CPU pin_memory workaround breaks."""
    out = tmp_path / "out"
    recipe = awq_recipe(tmp_path, n_grid=4, group_size=64)
    result = cli("quantize", micro_model, "--recipe", recipe, *CALIB_ARGS, *LOOSE_TOP1, "-o", out)
    assert result.exit_code == 0, result.output
    config = quant_config(out)
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (4, 64, False)
    entry = assert_metrics(out)
    import torch

    assert entry["details"]["cpu_pin_memory_workaround"] is (not torch.accelerator.is_available())
    assert mean_kld_vs_base(out, micro_model) < 0.05


@pytest.mark.parametrize("duo_scaling, n_grid", [(True, 2), (False, 1), ("both", 3)])
def test_a_grid_the_scale_search_cannot_divide_is_refused_before_work(cli, micro_model, tmp_path, duo_scaling,
                                                                      n_grid):
    """llm-compressor's grid divides by n_grid - 2 (duo scaling), n_grid - 1 (without) or n_grid // 2 - 1 (both):
    a grid one point smaller than that allows was a ZeroDivisionError (exit 1) after calibration started."""
    out = tmp_path / "out"
    recipe = awq_recipe(tmp_path, n_grid=n_grid, duo_scaling=duo_scaling)
    result = cli("quantize", micro_model, "--recipe", recipe, *CALIB_ARGS, "-o", out)
    assert result.exit_code == 2, result.output
    assert f"awq: n_grid={n_grid} is too small for duo_scaling {duo_scaling}" in " ".join(result.output.split())
    assert not out.exists()


def test_pin_memory_site_still_exists():
    """An llm-compressor upgrade that moves or renames the patched method must be noticed."""
    import inspect

    from llmcompressor.modifiers.transform.awq import base

    from quantkit.engines.patches import PATCHES, site_function, site_owner

    assert site_owner(PATCHES["awq.pin_memory"].site)[0].__name__ == "IntermediatesCache"
    assert site_function(PATCHES["awq.pin_memory"].site).__name__ == "pin_memory"
    assert "cache.pin_memory(" in inspect.getsource(base.AWQModifier._apply_smoothing)


def test_pin_memory_guard_patches_and_restores():
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    from quantkit.methods import awq

    if torch.accelerator.is_available():
        pytest.skip("the guard is inactive with an accelerator")
    original = IntermediatesCache.pin_memory
    cache = IntermediatesCache.empty(1, torch.device("cpu"))
    cache.update(0, {"hidden": torch.zeros(4)})
    with pytest.raises(RuntimeError, match="accelerator"):  # the bug the guard works around
        cache.pin_memory(0)
    with awq.cpu_pin_memory_guard() as patched:
        assert patched
        cache.pin_memory(0)
    assert IntermediatesCache.pin_memory is original


def test_awq_unknown_architecture(cli, gpt2_model, tmp_path):
    out = tmp_path / "out"
    result = cli("quantize", gpt2_model, "--method", "awq", *CALIB_ARGS, "-o", out)
    assert result.exit_code == 2, result.output
    assert "architecture 'gpt2'" in result.output
    assert "llama" in result.output and "qwen3" in result.output
    assert_nothing_written(out)


def test_awq_group_size_and_bits(cli, micro_model, tmp_path):
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "awq", "--group-size", 96, *CALIB_ARGS, "-o", out)
    assert result.exit_code == 2 and "does not divide" in result.output
    result = cli("quantize", micro_model, "--method", "awq", "--bits", 2, *CALIB_ARGS, "-o", out)
    assert result.exit_code == 2 and "bits=2" in result.output
    assert_nothing_written(out)


def test_awq_refuses_an_ignore_list_that_leaves_a_quantized_smooth_layer_nothing_to_balance(cli, micro_model, tmp_path):
    """up_proj -> down_proj: with down_proj 16-bit and up_proj int4, llm-compressor's duo scaling divided
    by zero after loading and calibrating (exit 1); refused before work. Both ignored, or all of a norm's
    balance layers ignored, is fine (the latter is what the end-to-end run below does)."""
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.methods.awq import check_ignore

    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "awq", "--ignore", "model.layers.0.mlp.down_proj",
                 *CALIB_ARGS, "-o", out)
    assert result.exit_code == 2, result.output
    assert "model.layers.0.mlp.down_proj" in result.stderr and "ignore model.layers.0.mlp.up_proj" in result.stderr
    assert_nothing_written(out)
    info = check_model_dir(micro_model)
    check_ignore(info, None, ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.0.mlp.up_proj"])
    check_ignore(info, None, ["lm_head", r"re:.*layers\.0\.self_attn\.[qkv]_proj$"])


@pytest.mark.slow
def test_awq_with_a_norms_balance_layers_all_ignored_runs(cli, micro_model, tmp_path):
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "awq", "--ignore", r"re:.*layers\.0\.self_attn\.[qkv]_proj$",
                 *CALIB_ARGS, "-o", out)
    assert result.exit_code == 0, result.output


def test_awq_autoawq_backend_fails_honestly(cli, micro_model, tmp_path):
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "awq", "--backend", "autoawq", *CALIB_ARGS, "-o", out)
    assert result.exit_code == 2, result.output
    assert "autoawq" in result.output.lower()
    assert_nothing_written(out)


def test_mappings_cover_required_architectures():
    from quantkit.arch.mappings import awq_mappings

    from quantkit.arch.families import VLM_TEXT_TYPES

    for model_type in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"):
        assert len(awq_mappings(model_type)) >= 3, model_type
    assert all(m.smooth.startswith("re:") for m in awq_mappings("gemma2"))
    assert "re:.*input_layernorm$" in [m.smooth for m in awq_mappings("gemma2")]
    # Gemma 3's VLM (model_type gemma3) is smoothed with the rows of its text model
    assert VLM_TEXT_TYPES["gemma3"] == "gemma3_text"
    assert "re:.*input_layernorm$" not in [m.smooth for m in awq_mappings("gemma3_text")]


def test_autoawq_installed_but_not_loadable(monkeypatch):
    import importlib.util

    from quantkit.errors import UnsupportedError
    from quantkit.methods import awq

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "awq" else
                        (None if name == "gptqmodel" else real(name, *a)))
    with pytest.raises(UnsupportedError, match="gptqmodel"):
        awq.check_backend("autoawq")


@pytest.mark.slow
def test_awq_beats_rtn_on_reference_model(cli, reference_model, tmp_path):
    assert_beats_rtn(cli, reference_model, tmp_path, "awq", "W4A16_ASYM")