"""Hunyuan dense (HunYuanDenseV1ForCausalLM) on a tiny random checkpoint with dynamic NTK-alpha RoPE (as Hunyuan
checkpoints state it: alpha 1000, rope_theta 10000, a 32K context) and q/k norms: every method, each artifact
proven in its consumer.

Fast: fp8, gptq and gguf through the CLI. Slow: the other methods, GGUF against llama.cpp's converter and
llama-quantize, MLX against mlx-lm (which reads the alpha from the rope_scaling quantkit writes), vLLM serving.
Refused before work: GGUF without tokenizer.json (a hy.tiktoken vocabulary) or with a dynamic RoPE the converter
asserts against. Hunyuan MoE: tests/families/test_moe.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.families import common

FAMILY = "hunyuan_v1_dense"
ROPE = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}


def build(out: Path, **config) -> Path:
    out = common.build(out, "HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", head_dim=64,
                       max_position_embeddings=32768, **{"rope_parameters": dict(ROPE), **config})
    settings = json.loads((out / "config.json").read_text())
    settings["eod_token_id"] = settings["eos_token_id"]  # Hunyuan's end of document is its eos
    (out / "config.json").write_text(json.dumps(settings, indent=2))
    return out


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


def test_the_gate_reads_the_alpha_scaled_rope(model):
    """The GGUF/MLX readings rebuild the rotary frequencies with the NTK alpha, as the model's own class does
    (transformers' generic dynamic RoPE function has no alpha)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.eval.artifacts import materialize_buffers

    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    rotary = materialize_buffers(meta, config).model.rotary_emb
    base = 10000.0 * 1000.0 ** (64 / 62)
    assert torch.allclose(rotary.inv_freq, 1.0 / (base ** (torch.arange(0, 64, 2).float() / 64)))


def test_gguf_refuses_a_tiktoken_vocabulary_without_tokenizer_json(cli, model, tmp_path):
    import shutil

    bare, out = tmp_path / "bare", tmp_path / "out"
    shutil.copytree(model, bare)
    (bare / "tokenizer.json").unlink()
    (bare / "hy.tiktoken").write_text("")
    common.assert_refused(common.quantize(cli, bare, out, "gguf"), out, "tokenizer.json", "hy.tiktoken")


@pytest.mark.slow
def test_gguf_refuses_a_dynamic_rope_the_converter_asserts_against(cli, model, tmp_path):
    variant, out = common.copy_with_config(model, tmp_path / "variant", max_position_embeddings=4096), tmp_path / "out"
    common.assert_refused(common.quantize(cli, variant, out, "gguf"), out, "dynamic RoPE", "32768")


@pytest.mark.slow
def test_gguf_equals_llama_cpp(model, tmp_path):
    common.assert_gguf_is_llama_cpp_s(model, tmp_path)


@pytest.mark.slow
def test_mlx_lm_reads_it_as_quantkit(cli, model, tmp_path):
    out = tmp_path / "out"
    common.assert_passed(common.quantize(cli, model, out, "mlx", "--bits", "4", gate=False), out)
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == {"alpha": 1000.0, "factor": 1.0,
                                                                            "type": "dynamic"}
    common.assert_mlx_lm_reads_as_quantkit(out)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fp8", "gptq"])
def test_vllm_serves_it_as_the_gate_read_it(cli, model, tmp_path, method):
    common.assert_vllm_serves_it(cli, model, tmp_path, method)

