"""OLMo 3 (Olmo3ForCausalLM) and OLMo 2 (Olmo2ForCausalLM) on tiny random checkpoints: every method, each
artifact proven in its consumer.

OLMo 3: a sliding-window layer and a global one, a window shorter than the calibration windows. Fast: fp8, gptq and gguf through the CLI. Slow: the other methods (SmoothQuant
refused: post-norms leave it no norm row), GGUF against llama.cpp's converter and llama-quantize, MLX against
mlx-lm, vLLM serving; OLMo 2 (no sliding window) through GGUF and a compressed-tensors reload.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.families import common

FAMILY = "olmo3"


def build(out: Path, **config) -> Path:
    """OLMo 3 as its checkpoints are (untied lm_head, no biases), in two layers: a sliding-window one and a
    global one (OLMo 3's default makes every 4th layer global)."""
    return common.build(out, "Olmo3Config", "Olmo3ForCausalLM",
                        **{"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 32, **config})


def build_olmo2(out: Path, **config) -> Path:
    return common.build(out, "Olmo2Config", "Olmo2ForCausalLM", **config)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp(FAMILY) / "model")


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory) -> Path:
    return build_olmo2(tmp_path_factory.mktemp("olmo2") / "model")


COMPRESSED = {"fp8": [], "gptq": [], "awq": [], "autoround": ["--iters", "2"], "nvfp4": [], "mxfp4": [], "nf4": []}
FAST = common.FAST


@pytest.mark.parametrize("method", common.method_params(COMPRESSED, FAST))
def test_compressed_tensors_and_nf4_reload_strictly(cli, model, tmp_path, method):
    common.assert_reloads_strictly(cli, model, tmp_path, method, *COMPRESSED[method])


def test_gguf(cli, model, tmp_path):
    import gguf

    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "gguf", "--gguf-type", "Q4_K_M"), out)
    assert entry["details"]["gguf"]["type"] == "Q4_K_M"
    reader = gguf.GGUFReader(next(out.glob("*.gguf")))
    pattern = reader.fields["olmo2.attention.sliding_window_pattern"]
    assert [bool(pattern.parts[i][0]) for i in pattern.data] == [True, False]
    assert int(reader.fields["olmo2.attention.sliding_window"].parts[-1][0]) == 32


def test_smoothquant_is_refused_naming_the_post_norms(cli, model, tmp_path):
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, model, out, "smoothquant"), out, "post-norms")


def test_gguf_refuses_tied_embeddings_llama_cpp_cannot_load(cli, model, tmp_path):
    """llama.cpp's olmo2 model requires an output head; a tied checkpoint stores none."""
    variant = common.copy_with_config(model, tmp_path / "model", tie_word_embeddings=True)
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, variant, out, "gguf"), out, "tie_word_embeddings")


@pytest.mark.slow
def test_awq_uses_the_linear_rows_only():
    from quantkit.arch.mappings import awq_mappings, smoothquant_mappings

    for model_type in ("olmo2", "olmo3"):
        assert [m.smooth for m in awq_mappings(model_type)] == ["re:.*v_proj$", "re:.*up_proj$"]
        assert smoothquant_mappings(model_type) == []


@pytest.mark.slow
def test_gguf_equals_llama_cpp(model, tmp_path):
    common.assert_gguf_is_llama_cpp_s(model, tmp_path)


@pytest.mark.slow
def test_olmo2_gguf_equals_llama_cpp(olmo2, tmp_path):
    ours, theirs = common.assert_gguf_equals_converter(olmo2, tmp_path, "bf16")
    for path in common.assert_quantized_equals_llama_quantize(olmo2, theirs, tmp_path, ("Q4_K_M",)):
        common.assert_llama_perplexity_runs(path, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_olmo2_compressed_tensors_reload_strictly(cli, olmo2, tmp_path, method):
    out = tmp_path / "out"
    common.assert_passed(common.quantize(cli, olmo2, out, method), out)
    common.assert_strict_reload(out)


@pytest.mark.slow
def test_olmo2_smoothquant_is_refused(cli, olmo2, tmp_path):
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, olmo2, out, "smoothquant"), out, "post-norms")


@pytest.mark.slow
@pytest.mark.parametrize("which", ["model", "olmo2"])
def test_mlx_lm_reads_it_as_quantkit(cli, request, tmp_path, which):
    source, out = request.getfixturevalue(which), tmp_path / "out"
    common.assert_passed(common.quantize(cli, source, out, "mlx", "--bits", "4", gate=False), out)
    common.assert_mlx_lm_reads_as_quantkit(out)


@pytest.mark.slow
def test_mlx_refuses_a_yarn_rope_it_would_read_unscaled(cli, model, tmp_path):
    import json

    rope = json.loads((model / "config.json").read_text())["rope_parameters"]
    rope["full_attention"].update(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024)
    variant = common.copy_with_config(model, tmp_path / "model", rope_parameters=rope)
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, variant, out, "mlx", gate=False), out, "yarn")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fp8", "gptq"])
def test_vllm_serves_it_as_the_gate_read_it(cli, model, tmp_path, method):
    common.assert_vllm_serves_it(cli, model, tmp_path, method)
