"""quantkit.arch.moe's tables and pure functions, and the MoE smoothing rows (no model runs)."""

from __future__ import annotations

import pytest

from quantkit.arch import moe
from quantkit.arch.mappings import awq_mappings, smoothquant_mappings


def test_starved_experts_lists_only_those_under_the_threshold():
    counts = {"model.layers.0.mlp.gate": [300, 12, 256, 0], "model.layers.1.mlp.gate": [512, 512, 512, 512]}
    assert moe.starved_experts(counts, minimum=256) == [
        {"router": "model.layers.0.mlp.gate", "expert": 1, "tokens": 12},
        {"router": "model.layers.0.mlp.gate", "expert": 3, "tokens": 0},
    ]
    assert moe.starved_experts(counts, minimum=0) == []


def test_starved_experts_line_in_the_printed_report():
    from quantkit.cli.report import starved_experts_text

    assert starved_experts_text({"calibration_tokens": 1024}) == ""
    details = {"min_expert_tokens": 256,
               "experts_under_min_tokens": [{"router": "model.layers.0.mlp.gate", "expert": 3, "tokens": 7}]}
    assert starved_experts_text(details) == ("1 experts were routed fewer than 256 calibration tokens (calibrated on "
                                             "all tokens anyway): model.layers.0.mlp.gate expert 3 (7)")


@pytest.mark.parametrize("config,count", [
    ({"num_local_experts": 8}, 8),  # Mixtral, and Qwen-MoE as transformers 5 writes it
    ({"num_experts": 60}, 60),  # Qwen-MoE as released
    ({"text_config": {"n_routed_experts": 64}}, 64),
    ({"num_experts": None, "hidden_size": 64}, 0),
    ({}, 0),
])
def test_expert_count_reads_every_spelling(config, count):
    assert moe.expert_count(config) == count


def test_save_renamings_turn_linear_experts_back_into_mixtral_names():
    """transformers' own save-time reversal of the rows gives the names its Mixtral conversion reads."""
    from types import SimpleNamespace

    import torch
    from transformers.core_model_loading import revert_weight_conversion

    model = SimpleNamespace(_weight_conversions=moe.save_renamings("mixtral"), config=None)
    state = {"model.layers.0.mlp.experts.3.gate_proj.weight_scale": torch.ones(1),
             "model.layers.0.mlp.experts.3.up_proj.weight": torch.ones(1),
             "model.layers.1.mlp.experts.0.down_proj.weight_packed": torch.ones(1),
             "model.layers.1.mlp.gate.weight": torch.ones(1)}
    assert sorted(revert_weight_conversion(model, state)) == [
        "model.layers.0.block_sparse_moe.experts.3.w1.weight_scale",
        "model.layers.0.block_sparse_moe.experts.3.w3.weight",
        "model.layers.1.block_sparse_moe.experts.0.w2.weight_packed",
        "model.layers.1.block_sparse_moe.gate.weight",
    ]
    assert moe.save_renamings("qwen3_moe") == []


def test_moe_awq_rows_balance_the_router_with_the_experts():
    """Scaling the MLP norm's output must be undone in every layer reading it, the router included
    (else routing changes); SmoothQuant leaves that norm alone on MoE models."""
    for model_type in ("mixtral", "qwen3_moe", "qwen2_moe"):
        mlp_row = next(m for m in awq_mappings(model_type) if m.smooth == "re:.*post_attention_layernorm$")
        assert "re:.*mlp.gate$" in mlp_row.balance
        assert [m.smooth for m in smoothquant_mappings(model_type)] == ["re:.*input_layernorm$"]
    qwen2 = next(m for m in awq_mappings("qwen2_moe") if m.smooth == "re:.*post_attention_layernorm$")
    assert "re:.*mlp.shared_expert_gate$" in qwen2.balance


def test_phi3_rows_use_the_fused_projections():
    assert [(m.smooth, m.balance) for m in awq_mappings("phi3")] == [
        ("re:.*input_layernorm$", ("re:.*qkv_proj$",)),
        ("re:.*qkv_proj$", ("re:.*o_proj$",)),
        ("re:.*post_attention_layernorm$", ("re:.*gate_up_proj$",)),
        ("re:.*gate_up_proj$", ("re:.*down_proj$",)),
    ]
    assert [m.balance for m in smoothquant_mappings("phi3")] == [("re:.*qkv_proj$",), ("re:.*gate_up_proj$",)]


@pytest.mark.parametrize("method", ["fp8", "gptq", "nf4"])
def test_an_moe_architecture_without_a_table_row_is_refused_before_work(method, micro_model):
    """Experts in a layout quantkit.arch.moe does not know (OLMoE's, which no family record describes) would be
    saved under names transformers does not reload; nf4's artifact crashed on reload. Every method refuses it
    first."""
    import dataclasses

    from quantkit.errors import UnsupportedError
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.methods import get_method
    from quantkit.run.recipe import Calibration

    info = check_model_dir(micro_model)
    unknown = dataclasses.replace(info, model_type="olmoe",
                                  config={**info.config, "model_type": "olmoe", "num_local_experts": 4})
    spec = get_method(method)
    with pytest.raises(UnsupportedError, match=f"{method}: mixture-of-experts architecture 'olmoe'"):
        spec.check(unknown, spec.options(), Calibration())
