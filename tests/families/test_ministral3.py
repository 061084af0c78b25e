"""Ministral 3 (Ministral3ForCausalLM) on a tiny random checkpoint: every method, each artifact proven in its
consumer.

Its configuration class's defaults: YaRN RoPE (factor 16 over 16384 positions, mscale 1 / mscale_all_dim 1) and
Llama 4's attention temperature (llama_4_scaling_beta 0.1). Fast: fp8, gptq and gguf through the CLI. Slow: the
other methods, GGUF against llama.cpp's converter and llama-quantize, MLX against mlx-lm, vLLM serving (which
reads no llama_4_scaling_beta from a Hugging Face config: the same below 16384 positions).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.families import common

FAMILY = "ministral3"


def build(out: Path, **config) -> Path:
    """Ministral 3's RoPE as its configuration class gives it: YaRN factor 16 from 16384 to 262144 positions."""
    return common.build(out, "Ministral3Config", "Ministral3ForCausalLM",
                        **{"head_dim": 64, "max_position_embeddings": 262144, **config})


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp(FAMILY) / "model")


COMPRESSED, FAST = common.COMPRESSED, common.FAST


@pytest.mark.parametrize("method", common.method_params(COMPRESSED, FAST))
def test_compressed_tensors_and_nf4_reload_strictly(cli, model, tmp_path, method):
    common.assert_reloads_strictly(cli, model, tmp_path, method, *COMPRESSED[method])


def test_gguf(cli, model, tmp_path):
    import gguf

    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "gguf", "--gguf-type", "Q4_K_M"), out)
    assert entry["details"]["gguf"]["type"] == "Q4_K_M"
    fields = gguf.GGUFReader(next(out.glob("*.gguf"))).fields
    assert float(fields["mistral3.attention.temperature_scale"].parts[-1][0]) == pytest.approx(0.1)
    assert float(fields["mistral3.rope.scaling.yarn_log_multiplier"].parts[-1][0]) == 1.0
    assert int(fields["mistral3.rope.scaling.original_context_length"].parts[-1][0]) == 16384


def test_gguf_refuses_a_rope_without_the_temperature_the_converter_reads(cli, model, tmp_path):
    import json

    rope = json.loads((model / "config.json").read_text())["rope_parameters"]
    del rope["llama_4_scaling_beta"]
    variant = common.copy_with_config(model, tmp_path / "model", rope_parameters=rope)
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, variant, out, "gguf"), out, "llama_4_scaling_beta")


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
