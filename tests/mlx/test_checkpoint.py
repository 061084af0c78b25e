"""The stacked experts' names: a checkpoint's per-expert tensors as each family's mlx-lm model stacks them
(quantkit.mlx.checkpoint.expert_stacks), and the way back (unstacked_names)."""

from __future__ import annotations

import pytest

from quantkit.mlx.checkpoint import expert_stacks, unstacked_names


def expert_names(block: str, projections: tuple[str, ...], experts: int = 2) -> list[str]:
    return [f"model.layers.1.{block}.experts.{e}.{p}.weight" for p in projections for e in reversed(range(experts))]


@pytest.mark.parametrize("model_type,block,projections,stacked", [
    ("qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj"), ("gate_proj", "up_proj", "down_proj")),
    ("mixtral", "block_sparse_moe", ("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")),
    ("minimax_m2", "block_sparse_moe", ("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")),
])
def test_experts_stack_under_the_switch_mlp_names_and_back(model_type, block, projections, stacked):
    config = {"model_type": model_type}
    names = expert_names(block, projections) + [f"model.layers.1.{block}.gate.weight"]
    stacks = expert_stacks(config, names)
    assert list(stacks) == sorted(f"model.layers.1.{block}.switch_mlp.{p}" for p in stacked)
    for projection, mlx_name in zip(projections, stacked):
        module = f"model.layers.1.{block}.switch_mlp.{mlx_name}"
        in_order = [f"model.layers.1.{block}.experts.{e}.{projection}.weight" for e in range(2)]
        assert stacks[module] == in_order  # expert order, whatever the checkpoint's
        assert unstacked_names(config, module + ".weight", 2) == in_order
    assert unstacked_names(config, f"model.layers.1.{block}.gate.weight", 2) == []


def test_a_dense_family_has_no_stacks():
    config = {"model_type": "llama"}
    assert expert_stacks(config, expert_names("mlp", ("gate_proj",))) == {}
    assert unstacked_names(config, "model.layers.1.mlp.switch_mlp.gate_proj.weight", 2) == []


def test_qwen35_is_written_in_mlx_lm_s_qwen3_5_layout_and_read_back():
    """Qwen3.5's text checkpoint as mlx_lm.convert writes mlx-lm's qwen3_5 model: config.json nesting the
    checkpoint's as text_config, names under language_model., mtp.* dropped; conv1d and the (1 + w) norms as its
    sanitize makes them (the gated linear_attn.norm as it is), and each taken back exactly."""
    import torch

    from quantkit.mlx.checkpoint import (checkpoint_name, keeps_dtype, layout, mlx_config, written_name,
                                         written_tensor)

    config = {"model_type": "qwen3_5_text", "tie_word_embeddings": False, "eos_token_id": 2,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}
    written = mlx_config(config, {"bits": 4, "group_size": 64})
    assert written["model_type"] == "qwen3_5" and written["text_config"]["model_type"] == "qwen3_5_text"
    assert written["text_config"]["rope_theta"] == 1e7 and written["eos_token_id"] == 2
    assert layout(written) is layout(config) is not None
    assert written_name(config, "lm_head.weight") == "language_model.lm_head.weight"
    assert written_name(config, "mtp.fc.weight") is None
    assert checkpoint_name(written, "language_model.model.norm.weight") == "model.norm.weight"
    assert keeps_dtype(config, "model.layers.0.linear_attn.A_log")
    conv = torch.randn(8, 1, 4).to(torch.bfloat16)
    stored = written_tensor(config, "model.layers.0.linear_attn.conv1d.weight", conv)
    assert stored.shape == (8, 4, 1) and torch.equal(stored[:, 1, 0], conv[:, 0, 1])
    norm = (0.1 * torch.randn(16)).to(torch.bfloat16)
    for name in ("model.norm.weight", "model.layers.1.input_layernorm.weight",
                 "model.layers.1.self_attn.q_norm.weight"):
        assert torch.equal(written_tensor(config, name, norm), (norm.float() + 1).to(torch.bfloat16)), name
    gated = "model.layers.0.linear_attn.norm.weight"
    assert written_tensor(config, gated, norm) is norm
    assert layout({"model_type": "llama"}) is None and written_name({"model_type": "llama"}, "lm_head") == "lm_head"


def test_the_reading_rotates_longrope_as_mlx_lm_does():
    """mlx-lm's SuScaledRoPE applies the long factors at every length: quantkit's reading of an MLX artifact takes
    them for the short ones too (transformers would apply the short factors within the original context); other
    RoPE scalings are read as stored."""
    from quantkit.mlx.checkpoint import as_mlx_lm_rotates

    longrope = {"model_type": "phi3", "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0, 1.5],
                                                          "long_factor": [2.0, 3.0], "rope_theta": 1e4}}
    read = as_mlx_lm_rotates(longrope)
    assert read["rope_parameters"]["short_factor"] == [2.0, 3.0] == read["rope_parameters"]["long_factor"]
    assert longrope["rope_parameters"]["short_factor"] == [1.0, 1.5]  # the stored config is left as it is
    llama3 = {"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "factor": 8.0}}
    assert as_mlx_lm_rotates(llama3) is llama3
