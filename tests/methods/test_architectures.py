"""The smoothing methods' mapping tables against real (tiny) models of each family they claim."""

from __future__ import annotations

import pytest

from tests.methods.conftest import CALIB_ARGS, LOOSE_TOP1, assert_metrics, quant_config

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


def build(model_type: str, tokenizer_dir, out):
    """A random tiny model of `model_type` with the micro tokenizer, saved as safetensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    extra = {"head_dim": 64} if model_type in ("qwen3", "gemma2") else {}
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **SHAPE, **extra)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("method,model_type", [
    pytest.param("awq", "qwen3", marks=pytest.mark.slow),  # awq fast: test_families, test_awq
    pytest.param("awq", "mistral", marks=pytest.mark.slow),
    pytest.param("awq", "qwen2", marks=pytest.mark.slow),
    pytest.param("awq", "gemma2", marks=pytest.mark.slow),
    ("smoothquant", "qwen2"),
    pytest.param("smoothquant", "gemma2", marks=pytest.mark.slow),
    pytest.param("smoothquant", "qwen3", marks=pytest.mark.slow),
])
def test_smoothing_methods_run_on_each_family(cli, micro_model, tmp_path, method, model_type):
    model = build(model_type, micro_model, tmp_path / model_type)
    out = tmp_path / "out"
    extra = ["--smoothing-strength", "0.5"] if method == "smoothquant" else []
    result = cli("quantize", model, "--method", method, *extra, *CALIB_ARGS, *LOOSE_TOP1,
                     "--max-kld", "0.5", "--max-ppl-increase", "0.5", "-o", out)
    assert result.exit_code == 0, result.output
    assert quant_config(out)["quant_method"] == "compressed-tensors"
    assert assert_metrics(out)["metrics"]["kld_mean"] < 0.5
