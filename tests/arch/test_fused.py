"""quantkit.arch.fused: the shards vLLM loads into one Linear, and the ignore list completed so none is split."""

from __future__ import annotations

import json

from quantkit.arch.fused import partners, split_groups


def test_partners_of_a_shard():
    assert partners("model.layers.3.self_attn.k_proj") == (
        "model.layers.3.self_attn.qkv_proj", ["model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.v_proj"])
    assert partners("model.language_model.layers.0.mlp.up_proj") == (
        "model.language_model.layers.0.mlp.gate_up_proj", ["model.language_model.layers.0.mlp.gate_proj"])
    assert partners("model.layers.0.mlp.down_proj") is None and partners("model.layers.0.self_attn.qkv_proj") is None
    assert partners("model.layers.1.self_attn.kv_a_proj_with_mqa") == (  # DeepSeek-V3's MLA in vLLM
        "model.layers.1.self_attn.fused_qkv_a_proj", ["model.layers.1.self_attn.q_a_proj"])
    assert partners("model.layers.1.mlp.experts.7.gate_proj") == (
        "model.layers.1.mlp.experts.7.gate_up_proj", ["model.layers.1.mlp.experts.7.up_proj"])


def test_split_groups_adds_only_the_missing_shards_that_exist():
    layers = [f"model.layers.0.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                               "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    joined = split_groups(["model.layers.0.self_attn.v_proj", "model.layers.0.mlp.down_proj"], layers)
    assert sorted(joined) == ["model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.q_proj"]
    assert "into model.layers.0.self_attn.qkv_proj" in joined["model.layers.0.self_attn.q_proj"]
    assert split_groups(["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"], layers) == {}
    assert split_groups(["model.layers.0.self_attn.q_proj"], ["model.layers.0.self_attn.q_proj"]) == {}


def test_an_ignored_shard_keeps_its_fused_partners_16_bit(cli, micro_model, tmp_path):
    """--ignore k_proj alone would give vLLM a qkv_proj with shards in two schemes, which it refuses."""
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "fp8", "--ignore", "model.layers.0.self_attn.k_proj", "-o", out,
                 "--eval-windows", "2", "--no-gate")
    assert result.exit_code == 0, result.output
    assert "kept 16-bit: 2 layer(s) (vLLM fuses them with a 16-bit shard)" in result.stderr
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert {f"model.layers.0.self_attn.{p}_proj" for p in "qkv"} <= set(ignore)
    assert "model.layers.1.self_attn.k_proj" not in ignore
