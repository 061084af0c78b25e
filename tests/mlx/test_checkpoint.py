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
