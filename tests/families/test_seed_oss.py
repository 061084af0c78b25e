"""Seed-OSS (SeedOssForCausalLM) on a tiny random checkpoint: every method, each artifact proven in its consumer.

Fast: fp8, gptq and gguf through the CLI. Slow: the other methods, GGUF against llama.cpp's converter and
llama-quantize, MLX against mlx-lm.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.families import common

FAMILY = "seed_oss"


def build(out: Path, **config) -> Path:
    """Seed-OSS as its checkpoints are: q/k/v biases, no attention output bias."""
    return common.build(out, "SeedOssConfig", "SeedOssForCausalLM", head_dim=64, attention_bias=True, **config)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp(FAMILY) / "model")


COMPRESSED, FAST = common.COMPRESSED, common.FAST


@pytest.mark.parametrize("method", common.method_params(COMPRESSED, FAST))
def test_compressed_tensors_and_nf4_reload_strictly(cli, model, tmp_path, method):
    common.assert_reloads_strictly(cli, model, tmp_path, method, *COMPRESSED[method])


def test_gguf(cli, model, tmp_path):
    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "gguf", "--gguf-type", "Q4_K_M"), out)
    assert entry["details"]["gguf"]["type"] == "Q4_K_M"


def test_gguf_refuses_an_attention_output_bias_llama_cpp_lacks(cli, tmp_path):
    """llama.cpp's converter writes attn_output.bias, which its seed_oss model never loads (the file fails to
    load: 'wrong number of tensors'): refused before work."""
    model, out = build(tmp_path / "model", attention_out_bias=True), tmp_path / "out"
    common.assert_refused(common.quantize(cli, model, out, "gguf"), out, "attention_out_bias")


@pytest.mark.slow
def test_gguf_equals_llama_cpp(model, tmp_path):
    common.assert_gguf_is_llama_cpp_s(model, tmp_path)


@pytest.mark.slow
def test_mlx_lm_reads_it_as_quantkit(cli, model, tmp_path):
    common.assert_mlx_lm_reads_it(cli, model, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fp8", "gptq"])
def test_vllm_serves_it_as_the_gate_read_it(cli, model, tmp_path, method):
    common.assert_vllm_serves_it(cli, model, tmp_path, method)
