"""Qwen3.5 (Qwen3_5ForCausalLM) on a tiny random checkpoint: a Gated DeltaNet linear-attention layer and a gated
full-attention layer (full_attention_interval 2, in config.json as Qwen3.5 checkpoints have it beside
layer_types), fewer key heads than value heads (so llama.cpp's value-head reorder applies); every method, each
artifact proven in its consumer.

Fast: fp8, gptq and gguf through the CLI, and the refusals of a checkpoint whose config and tensors disagree.
Fast too: MLX against mlx-lm (its qwen3_5 model), and its refusal of layer types mlx-lm places otherwise.
Slow: the other methods, GGUF against llama.cpp's converter and llama-quantize, vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.families import common

FAMILY = "qwen3_5_text"
SHAPE = dict(head_dim=64, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
             full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
             linear_value_head_dim=64)


def build(out: Path, **config) -> Path:
    return common.build(out, "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", **{**SHAPE, **config})


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp(FAMILY) / "model")


COMPRESSED, FAST = common.COMPRESSED, ("fp8", "gptq")  # gptq calibrates the recurrent layers too
KEPT = {f"model.layers.0.linear_attn.in_proj_{g}" for g in "ab"}


@pytest.mark.parametrize("method", [pytest.param(m, marks=() if m in FAST else pytest.mark.slow) for m in COMPRESSED])
def test_compressed_tensors_and_nf4_reload_strictly(cli, model, tmp_path, method):
    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, method, *COMPRESSED[method]), out)
    common.assert_strict_reload(out)
    if method != "nf4":  # the beta/alpha gates kept 16-bit, with the reason in the report
        assert KEPT <= set(common.kept_16bit(out))
        assert all("beta/alpha" in entry["details"]["kept_16bit"][name] for name in KEPT), entry["details"]


def test_gguf(cli, model, tmp_path):
    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "gguf", "--gguf-type", "Q4_K_M"), out)
    assert entry["details"]["gguf"]["type"] == "Q4_K_M"


@pytest.mark.slow  # the fast suite streams a hybrid through Granite 4's test
def test_gguf_auto_precision_measures_the_hybrid_layers(cli, model, tmp_path):
    """The measured sensitivity streams the hybrid decoder (Gated DeltaNet layers beside attention): transformers'
    loading conversion for the family only moves a VLM's language-model prefix, which a text checkpoint lacks."""
    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, model, out, "gguf", "--gguf-type", "Q4_K_M", "--imatrix", "auto",
                                                 "--auto-precision"), out)
    sensitivity = entry["details"]["sensitivity"]
    assert sensitivity["measured"] and any("ssm" in t["tensor"] or "attn_qkv" in t["tensor"]
                                           for t in sensitivity["tensors"] if t.get("kld") is not None)


def without_tensor(model: Path, dest: Path, name: str) -> Path:
    """A copy of the checkpoint with one tensor removed from its safetensors file."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, dest)
    tensors = load_file(dest / "model.safetensors")
    del tensors[name]
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("method", ["fp8", "gguf"])
def test_refuses_a_layer_types_list_shorter_than_the_layers(cli, model, tmp_path, method):
    config = json.loads((model / "config.json").read_text())
    short = common.copy_with_config(model, tmp_path / "model", layer_types=config["layer_types"][:1])
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, short, out, method), out, "layer_types", "num_hidden_layers = 2")


@pytest.mark.parametrize("method", ["gptq", "gguf"])
def test_refuses_a_missing_linear_attention_tensor(cli, model, tmp_path, method):
    name = "model.layers.0.linear_attn.A_log"
    broken, out = without_tensor(model, tmp_path / "model", name), tmp_path / "out"
    common.assert_refused(common.quantize(cli, broken, out, method), out, name)


def with_mtp(model: Path, dest: Path) -> Path:
    """A copy of the checkpoint with one multi-token-prediction layer as Qwen3.5 checkpoints store it (mtp.fc,
    the two pre-fc norms, mtp.norm and a full-attention layer under mtp.layers.0; transformers does not load
    them) and mtp_num_hidden_layers = 1."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, dest)
    config = json.loads((dest / "config.json").read_text())
    tensors, hidden, last = load_file(dest / "model.safetensors"), config["hidden_size"], config["num_hidden_layers"] - 1
    generator = torch.Generator().manual_seed(7)
    for name, value in list(tensors.items()):
        if name.startswith(f"model.layers.{last}."):
            noise = 0.01 * torch.randn(value.shape, generator=generator)
            tensors["mtp.layers.0." + name.split(".", 3)[3]] = (value.float() + noise).to(value.dtype)
    tensors["mtp.fc.weight"] = (0.02 * torch.randn(hidden, 2 * hidden, generator=generator)).to(torch.bfloat16)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = (0.1 * torch.randn(hidden, generator=generator)).to(torch.bfloat16)
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    config["mtp_num_hidden_layers"] = 1
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


@pytest.fixture(scope="module")
def mtp_model(model, tmp_path_factory) -> Path:
    return with_mtp(model, tmp_path_factory.mktemp(FAMILY) / "mtp")


@pytest.mark.slow
def test_gguf_writes_the_mtp_layer_as_llama_cpp_s_nextn_block(cli, mtp_model, tmp_path):
    """The converter's default: the MTP layer is block 2 (nextn.eh_proj / enorm / hnorm / shared_head_norm and
    a full-attention block), nextn_predict_layers = 1; the gate reads the decoder's blocks."""
    import gguf

    out = tmp_path / "out"
    common.assert_passed(common.quantize(cli, mtp_model, out, "gguf", "--gguf-type", "Q4_K_M"), out)
    ours, theirs = common.assert_gguf_equals_converter(mtp_model, tmp_path, "bf16")
    reader = gguf.GGUFReader(str(ours))
    assert reader.fields["qwen35.nextn_predict_layers"].contents() == 1
    assert reader.fields["qwen35.block_count"].contents() == 3
    assert {"blk.2.nextn.eh_proj.weight", "blk.2.attn_q.weight"} <= {t.name for t in reader.tensors}
    for path in common.assert_quantized_equals_llama_quantize(mtp_model, theirs, tmp_path, ("Q4_K_M",)):
        common.assert_llama_perplexity_runs(path, tmp_path)


@pytest.mark.slow
def test_compressed_tensors_carries_the_mtp_layer_as_stored(cli, mtp_model, tmp_path):
    """compressed-tensors copies the mtp.* tensors beside the model as stored (bf16) and ignores them, for vLLM's
    MTP draft; transformers' reload skips them (Qwen3_5ForCausalLM ignores ^mtp.*)."""
    from safetensors import safe_open

    out = tmp_path / "out"
    common.assert_passed(common.quantize(cli, mtp_model, out, "fp8"), out)
    common.assert_strict_reload(out)
    assert any(p.startswith("re:") and "mtp" in p for p in common.kept_16bit(out))
    stored = {}
    for shard in out.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            stored.update({k: f.get_tensor(k) for k in f.keys() if k.startswith("mtp.")})
    with safe_open(str(mtp_model / "model.safetensors"), "pt") as f:
        source = {k: f.get_tensor(k) for k in f.keys() if k.startswith("mtp.")}
    assert sorted(stored) == sorted(source) and len(source) == 15
    assert all(stored[k].dtype == source[k].dtype and stored[k].equal(source[k]) for k in source)


@pytest.mark.slow
def test_nf4_says_it_does_not_write_the_mtp_layer(cli, mtp_model, tmp_path):
    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, mtp_model, out, "nf4"), out)
    assert entry["details"]["mtp_layers"].startswith("not written: 15 mtp.* tensors")


@pytest.mark.parametrize("method", ["fp8", "gguf"])
def test_refuses_mtp_layers_config_json_does_not_count(cli, mtp_model, tmp_path, method):
    broken = common.copy_with_config(mtp_model, tmp_path / "model", mtp_num_hidden_layers=2)
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, broken, out, method), out, "mtp_num_hidden_layers = 2")


@pytest.mark.slow
def test_gguf_equals_llama_cpp(model, tmp_path):
    """A checkpoint without MTP layers: the converter's default stops on it (it asserts there is one), --no-mtp
    converts it."""
    ours, theirs = common.assert_gguf_equals_converter(model, tmp_path, "bf16", converter_args=("--no-mtp",))
    for path in common.assert_quantized_equals_llama_quantize(model, theirs, tmp_path):
        common.assert_llama_perplexity_runs(path, tmp_path)


def mlx_stored(out: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        return {k: f.get_slice(k).get_shape() for k in f.keys()}


def test_mlx_lm_reads_it_as_quantkit(cli, model, tmp_path):
    """mlx-lm 0.32 has no model for model_type qwen3_5_text: the artifact is what mlx_lm.convert writes for its
    qwen3_5 model (config.json model_type qwen3_5 with the checkpoint's as text_config; the tensors under
    language_model., conv1d's kernel axis last, the (1 + w) norms stored as 1 + w); mlx_lm.load builds the quantized
    modules with exactly quantkit's weights and its logits follow quantkit's reading (float32, same weights)."""
    out = tmp_path / "out"
    common.assert_passed(common.quantize(cli, model, out, "mlx", "--bits", "4", gate=False), out)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["text_config"]["model_type"] == FAMILY
    assert config["quantization"]["language_model.model.layers.0.linear_attn.in_proj_a"] is False
    stored = mlx_stored(out)
    assert stored["language_model.model.layers.0.linear_attn.conv1d.weight"] == [512, 4, 1]
    assert "language_model.lm_head.scales" in stored and not any(k.startswith("model.") for k in stored)
    common.assert_mlx_lm_reads_as_quantkit(out)


def test_mlx_drops_the_mtp_layer_as_mlx_lm_does_and_says_so(cli, mtp_model, tmp_path):
    out = tmp_path / "out"
    entry = common.assert_passed(common.quantize(cli, mtp_model, out, "mlx", "--bits", "4", gate=False), out)
    assert entry["details"]["mtp_layers"].startswith("not written: 15 mtp.* tensors; mlx-lm's qwen3_5")
    assert not any("mtp" in k for k in mlx_stored(out))
    common.assert_mlx_lm_reads_as_quantkit(out)


def test_mlx_refuses_layer_types_mlx_lm_would_place_otherwise(cli, model, tmp_path):
    """mlx-lm's qwen3_5 places the attention layers by full_attention_interval alone (it reads no layer_types)."""
    swapped = common.copy_with_config(model, tmp_path / "model", full_attention_interval=1)
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, swapped, out, "mlx", gate=False), out,
                          "full_attention_interval = 1", "layer 0")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fp8", "gptq"])
def test_vllm_serves_it_as_the_gate_read_it(cli, model, tmp_path, method):
    common.assert_vllm_serves_it(cli, model, tmp_path, method)
