"""ERNIE 4.5 dense (Ernie4_5ForCausalLM) on a tiny random checkpoint with a SentencePiece tokenizer.model (the
vocabulary llama.cpp's converter reads for it): every method, each artifact proven in its consumer.

Fast: fp8, gptq and gguf through the CLI. Slow: the other methods, GGUF against llama.cpp's converter and
llama-quantize, MLX against mlx-lm, vLLM serving. Refused before work: GGUF of a checkpoint without
tokenizer.model or with use_bias (llama.cpp lacks both). ERNIE 4.5 MoE: tests/families/test_moe.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.families import common

FAMILY = "ernie4_5"


def build(out: Path, **config) -> Path:
    from tests.gguf.families import write_spm_tokenizer

    return common.build(out, "Ernie4_5Config", "Ernie4_5ForCausalLM", write_tokenizer=write_spm_tokenizer,
                        head_dim=64, **config)


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
    assert entry["details"]["gguf"]["vocab"]["model"] == "llama"


def test_gguf_refuses_a_checkpoint_without_tokenizer_model(cli, model, tmp_path):
    """llama.cpp's Ernie4_5Model reads the vocabulary from tokenizer.model only (its converter fails without it)."""
    import shutil

    bare, out = tmp_path / "bare", tmp_path / "out"
    shutil.copytree(model, bare)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(model).save_pretrained(bare)  # tokenizer.json beside it
    (bare / "tokenizer.model").unlink()
    common.assert_refused(common.quantize(cli, bare, out, "gguf"), out, "tokenizer.model")


@pytest.mark.slow
def test_gguf_refuses_use_bias_llama_cpp_lacks(cli, tmp_path):
    """llama.cpp's ernie4_5 model loads no feed-forward biases: the converter's file would not load."""
    model, out = build(tmp_path / "model", use_bias=True), tmp_path / "out"
    common.assert_refused(common.quantize(cli, model, out, "gguf"), out, "use_bias")


@pytest.mark.slow
def test_gguf_equals_llama_cpp(model, tmp_path):
    ours, theirs = common.assert_gguf_equals_converter(model, tmp_path, "bf16", pre=None)
    for path in common.assert_quantized_equals_llama_quantize(model, theirs, tmp_path):
        common.assert_llama_perplexity_runs(path, tmp_path)


@pytest.mark.slow
def test_mlx_lm_reads_it_as_quantkit(cli, model, tmp_path):
    common.assert_mlx_lm_reads_it(cli, model, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fp8", "gptq"])
def test_vllm_serves_it_as_the_gate_read_it(cli, model, tmp_path, method):
    common.assert_vllm_serves_it(cli, model, tmp_path, method)

