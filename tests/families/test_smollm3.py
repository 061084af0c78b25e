"""SmolLM3 (SmolLM3ForCausalLM) on a tiny random checkpoint: every method, each artifact proven in its consumer.

Four layers, so the 4th is a NoPE layer (no rotary embedding), as SmolLM3's no_rope_layer_interval 4 makes it.
Fast: fp8, gptq and gguf through the CLI. Slow: the other methods, GGUF against llama.cpp's converter and
llama-quantize, MLX against mlx-lm, vLLM serving.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.families import common

FAMILY = "smollm3"


def build(out: Path, **config) -> Path:
    """SmolLM3 as its checkpoints are (tied embeddings, no biases), with one NoPE layer of four."""
    return common.build(out, "SmolLM3Config", "SmolLM3ForCausalLM", **{"head_dim": 64, "num_hidden_layers": 4,
                                                                        **config})


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp(FAMILY) / "model")


COMPRESSED, FAST = common.COMPRESSED, common.FAST


def test_the_tiny_model_has_a_nope_layer(model):
    import json

    assert json.loads((model / "config.json").read_text())["no_rope_layers"] == [1, 1, 1, 0]


@pytest.mark.parametrize("method", common.method_params(COMPRESSED, FAST))
def test_compressed_tensors_and_nf4_reload_strictly(cli, model, tmp_path, method):
    common.assert_reloads_strictly(cli, model, tmp_path, method, *COMPRESSED[method])


def test_gguf(cli, model, tmp_path):
    import gguf

    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "gguf", "--gguf-type", "Q4_K_M"), out)
    assert entry["details"]["gguf"]["type"] == "Q4_K_M"
    reader = gguf.GGUFReader(next(out.glob("*.gguf")))
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "smollm3"


def test_gguf_refuses_nope_layers_llama_cpp_does_not_place_there(cli, model, tmp_path):
    """llama.cpp's smollm3 graph skips RoPE on every 4th layer whatever the file says: another layout is refused."""
    variant = common.copy_with_config(model, tmp_path / "model", no_rope_layers=[1, 0, 1, 1])
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, variant, out, "gguf"), out, "no_rope_layers")


def test_gguf_refuses_llama3_rope_factors_smollm3_never_loads(cli, model, tmp_path):
    """The converter writes Llama 3.1's rope_freqs, which llama.cpp's smollm3 model does not load."""
    rope = {"rope_type": "llama3", "rope_theta": 2000000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    variant = common.copy_with_config(model, tmp_path / "model", rope_parameters=rope)
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, variant, out, "gguf"), out, "llama3")


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
