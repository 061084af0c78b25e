"""--kv-cache fp8 end to end through the CLI: llm-compressor's kv_cache_scheme key for key (calibrated k_scale /
v_scale per attention layer), and the gate's KV-only KLD (the same weights with the KV quantization off)."""

from __future__ import annotations

import pytest

from tests.methods.conftest import (
    CALIB_ARGS,
    assert_same_as_llmcompressor,
    preset_artifact,
    quant_config,
    report,
    stored_tensors,
)


def test_fp8_kv_cache_is_llmcompressors_kv_cache_scheme(cli, micro_model, tmp_path):
    from quantkit.engines.llmcompressor.llmc import kv_cache_scheme

    out = tmp_path / "kv"
    result = cli("quantize", micro_model, "--method", "fp8", "--kv-cache", "fp8", "-o", out, *CALIB_ARGS, "--no-gate")
    assert result.exit_code == 0, result.output
    bare = preset_artifact(micro_model, "FP8_DYNAMIC", tmp_path / "bare", kv_cache_scheme=kv_cache_scheme("fp8"),
                           windows=4)
    assert_same_as_llmcompressor(out, bare, equal_values=("_proj.weight", "_proj.weight_scale"))
    assert quant_config(out)["kv_cache_scheme"]["num_bits"] == 8
    tensors = stored_tensors(out)
    assert {k for k in tensors if k.endswith(("k_scale", "v_scale"))} == {
        f"model.layers.{i}.self_attn.{kv}_scale" for i in (0, 1) for kv in "kv"}
    entry = report(out)["targets"][0]
    kv = entry["details"]["kv_cache"]
    assert 0 < kv["kld_mean"] < entry["metrics"]["kld_mean"] * 10 and kv["top1"] > 0.5
    assert entry["details"]["path"].startswith("oneshot: the KV-cache scales")


def test_kv_cache_is_refused_where_the_format_has_no_kv_scheme(cli, micro_model, tmp_path):
    result = cli("quantize", micro_model, "--method", "nf4", "--kv-cache", "fp8", "-o", tmp_path / "nf4")
    assert result.exit_code == 2 and "--kv-cache does not apply to method nf4" in result.output


@pytest.mark.parametrize("method", ["fp8", "gptq", "nvfp4", "mxfp4"])
def test_the_plan_names_the_kv_cache(method):
    from quantkit.methods import get_method

    spec = get_method(method)
    options = spec.options(kv_cache="fp8")
    assert spec.needs_calibration(options)
    assert "KV fp8" in spec.precision("decoder", options, "model.layers.0.self_attn.q_proj", [256, 256])
