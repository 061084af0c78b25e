"""Gemma 4 (Gemma4ForCausalLM) on a tiny random checkpoint: every method, each artifact proven in its consumer.

Fast: fp8, gptq and gguf through the CLI. Slow: the other methods, GGUF against llama.cpp's converter and
llama-quantize, MLX against mlx-lm.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.families import common
from tests.gguf.families import write_spm_json_tokenizer

FAMILY = "gemma4_text"


def spm_json_tokenizer(out: Path) -> tuple[int, dict]:
    """Gemma's SentencePiece vocabulary as a tokenizer.json (tests.gguf.families, as Gemma 4 ships it), its size
    also the per-layer embedding's rows."""
    vocab, ids = write_spm_json_tokenizer(out, "gemma")
    return vocab, {**ids, "vocab_size_per_layer_input": vocab}


def build(out: Path, **config) -> Path:
    """Gemma 4 as its small checkpoints are: sliding and global layers (the global ones with their own head
    width, saved as per_layer_config, and proportional RoPE), per-layer inputs, the last two layers reading the
    keys and values of the first two; norms that scale by w."""
    settings = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                    num_kv_shared_layers=2, head_dim=64, global_head_dim=128, hidden_size_per_layer_input=64,
                    sliding_window=32, final_logit_softcapping=30.0)
    return common.build(out, "Gemma4TextConfig", "Gemma4ForCausalLM", write_tokenizer=spm_json_tokenizer,
                        norm_center=1.0, **{**settings, **config})


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp(FAMILY) / "model")


@pytest.fixture(scope="module")
def layered(tmp_path_factory) -> Path:
    """Gemma 4 without KV sharing (as the large dense checkpoints are): calibrated layer by layer."""
    return build(tmp_path_factory.mktemp(FAMILY) / "layered", num_kv_shared_layers=0)


def test_gguf_auto_precision_probes_a_kv_shared_model_from_the_embedding(cli, model, layered, tmp_path):
    """The measured sensitivity resumes each probe's forward at the layer it changes, except where later layers read
    the keys and values of earlier ones (shared_kv_states, filled only by a forward that ran those layers): there
    every probe runs from the embedding."""
    from quantkit.mixed.sensitivity import resumable_start

    shared, plain = (json.loads((m / "config.json").read_text()) for m in (model, layered))
    assert resumable_start(shared, 3) == 0 and resumable_start(plain, 3) == 3
    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "gguf", "--gguf-type", "Q4_K_M", "--imatrix", "auto",
                                                 "--auto-precision"), out)
    assert entry["details"]["sensitivity"]["measured"] and entry["details"]["sensitivity"]["probes"]


COMPRESSED = {"fp8": [], "gptq": [], "awq": [], "smoothquant": [], "nvfp4": [], "mxfp4": [], "nf4": []}
FAST = ("fp8",)


@pytest.mark.parametrize("method", [pytest.param(m, marks=() if m in FAST else pytest.mark.slow)
                                    for m in COMPRESSED if m != "gptq"])
def test_compressed_tensors_and_nf4_reload_strictly(cli, model, tmp_path, method):
    out = tmp_path / "out"
    common.assert_passed(common.quantize(cli, model, out, method, *COMPRESSED[method]), out)
    common.assert_strict_reload(out)


def test_gptq_calibrates_the_kv_sharing_layers_and_the_per_layer_projection(cli, model, tmp_path):
    """GPTQ runs the whole text model as one subgraph (the KV-shared layers read the keys and values of earlier
    layers): every linear layer is quantized, the per-layer model projection too; only lm_head stays 16-bit;
    transformers reloads it strictly."""
    out = tmp_path / "out"
    common.assert_passed(common.quantize(cli, model, out, "gptq"), out)
    assert common.kept_16bit(out) == ["lm_head"]
    common.assert_strict_reload(out)


def test_gguf(cli, model, tmp_path):
    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "gguf", "--gguf-type", "Q4_K_M"), out)
    assert entry["details"]["gguf"]["type"] == "Q4_K_M"


@pytest.mark.slow
def test_gptq_without_kv_sharing_keeps_the_per_layer_projection_16bit(cli, layered, tmp_path):
    """Layer by layer (no KV sharing), per_layer_model_projection runs inside project_per_layer_inputs, which
    llm-compressor's tracer leaves untraced: kept 16-bit with the reason, every other linear layer quantized."""
    out = tmp_path / "out"
    common.assert_passed(common.quantize(cli, layered, out, "gptq"), out)
    assert sorted(common.kept_16bit(out)) == ["lm_head", "model.per_layer_model_projection"]
    assert "project_per_layer_inputs" in json.dumps(common.report(out))
    common.assert_strict_reload(out)


@pytest.mark.slow
@pytest.mark.parametrize("kv_shared", [True, False])
def test_autoround_refuses_gemma4(cli, model, layered, tmp_path, kv_shared):
    """auto-round tunes one decoder layer at a time on its cached inputs and drops Gemma 4's per-layer input
    (without KV sharing it failed with "Tensor * None") and shared_kv_states: refused before work, naming why."""
    out = tmp_path / "out"
    result = common.quantize(cli, model if kv_shared else layered, out, "autoround", "--iters", "2")
    common.assert_refused(result, out, "per-layer inputs")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gguf", "gptq"])
def test_refuses_a_mixture_of_experts_gemma4(cli, model, tmp_path, method):
    """Gemma 4's MoE checkpoints (a router and fused experts beside the MLP) have no expert layout here yet:
    refused before work, naming it."""
    variant = common.copy_with_config(model, tmp_path / "moe", enable_moe_block=True, num_experts=4,
                                      top_k_experts=2, moe_intermediate_size=256)
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, variant, out, method), out, "mixture-of-experts")


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
