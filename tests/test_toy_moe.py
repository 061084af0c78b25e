"""quantkit.toy_moe: the synthetic MoE checkpoints are what transformers builds for their config.json, under the
names their families' released checkpoints use."""

from __future__ import annotations

import json

import pytest

from quantkit.toy_moe import build_moe


@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3_moe"])
def test_transformers_loads_every_tensor_but_the_mtp_layer(kind, tmp_path):
    """Strict: nothing missing, nothing of the wrong shape; DeepSeek-V3's MTP layer (after the decoder's layers) is
    the only thing transformers' model leaves unread, as it leaves the released checkpoint's layer 61."""
    from transformers import AutoModelForCausalLM

    out = build_moe(kind, tmp_path / kind)
    _model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    config = json.loads((out / "config.json").read_text())
    mtp = f"model.layers.{config['num_hidden_layers']}."
    assert all(name.startswith(mtp) for name in info["unexpected_keys"])
    assert bool(info["unexpected_keys"]) == (kind == "deepseek_v3")


def test_deepseek_v3_shape(tmp_path):
    """MLA attention, the dense first layers, routed and shared experts, a float32 correction bias, the MTP layer."""
    from quantkit.io.checkpoint import check_model_dir

    info = check_model_dir(build_moe("deepseek_v3", tmp_path / "ds", layers=3, dense_layers=1))
    names = set(info.tensors)
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names
    assert {"model.layers.1.self_attn.q_a_proj.weight", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
            "model.layers.1.self_attn.kv_b_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight",
            "model.layers.2.mlp.experts.3.down_proj.weight", "model.layers.3.eh_proj.weight",
            "model.layers.3.shared_head.head.weight", "model.layers.3.mlp.experts.0.gate_proj.weight"} <= names
    assert info.tensors["model.layers.1.mlp.gate.e_score_correction_bias"] == ("F32", [4])
    assert info.config["num_nextn_predict_layers"] == 1 and info.architecture == "DeepseekV3ForCausalLM"


def test_a_checkpoint_is_the_same_however_it_is_sharded(tmp_path):
    from safetensors import safe_open

    one = build_moe("qwen3_moe", tmp_path / "one", layers=1)
    many = build_moe("qwen3_moe", tmp_path / "many", layers=1, shard_bytes=200_000)
    files = sorted(many.glob("*.safetensors"))
    assert len(files) > 3 and (many / "model.safetensors.index.json").is_file()
    with safe_open(one / "model.safetensors", "pt") as f:
        whole = {name: f.get_tensor(name) for name in f.keys()}
    for file in files:
        with safe_open(file, "pt") as f:
            for name in f.keys():
                assert f.get_tensor(name).equal(whole.pop(name)), name
    assert not whole
