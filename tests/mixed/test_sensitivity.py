"""quantkit.mixed.sensitivity: roles and probes, gains measured on probes and interpolated over depth,
the frontier of candidates."""

from __future__ import annotations

import pytest

from quantkit.mixed import sensitivity
from quantkit.mixed.sensitivity import SensitivityRow


def row(name: str, error: float = 1.0, candidates=("a", "b", "c")) -> SensitivityRow:
    errors = {c: error / 4 ** i for i, c in enumerate(candidates)}
    return SensitivityRow(name, (4, 4), errors, candidates[0], candidates[0])


def test_role_and_depth_fold_the_layer_index_and_experts():
    assert sensitivity.role_and_depth("blk.12.ffn_down.weight") == ("blk.N.ffn_down.weight", 12)
    assert sensitivity.role_and_depth("model.layers.3.mlp.experts.5.down_proj") == ("model.layers.N.mlp.experts.*.down_proj", 3)
    assert sensitivity.role_and_depth("output.weight") == ("output.weight", None)


def test_probes_spread_over_depth_per_role():
    rows = [row(f"model.layers.{i}.{kind}") for i in range(10) for kind in ("q_proj", "down_proj")] + [row("lm_head")]
    chosen = sensitivity.probe_names(rows, 3)
    assert sorted(chosen) == sorted([f"model.layers.{i}.{k}" for i in (0, 4, 9) for k in ("q_proj", "down_proj")]
                                    + ["lm_head"])  # round(4.5) is 4
    assert len(sensitivity.probe_names(rows[:4], 3)) == 4  # two layers: every row


def test_gains_are_measured_on_probes_and_interpolated_over_depth():
    rows = [row(f"blk.{i}.attn_q.weight", error=2.0) for i in range(5)] + [row("blk.0.ffn_up.weight"),
                                                                            row("output.weight", error=4.0)]
    sensitivity.set_gains(rows, {"blk.0.attn_q.weight": 2.0, "blk.4.attn_q.weight": 10.0, "output.weight": 4.0})
    gains = {r.name: r.gain for r in rows}
    assert gains["blk.0.attn_q.weight"] == 1.0 and gains["blk.4.attn_q.weight"] == 5.0  # kld / error(probe)
    assert gains["blk.2.attn_q.weight"] == pytest.approx(3.0)  # halfway in depth
    assert gains["blk.0.ffn_up.weight"] == pytest.approx((1.0 + 5.0 + 1.0) / 3)  # a role without probes: the mean
    assert rows[2].kld is None and rows[0].kld == 2.0
    assert rows[2].damage("b") == pytest.approx(3.0 * 2.0 / 4)


def test_the_frontier_drops_dominated_candidates():
    errors = {"small": 4.0, "same_size_worse": 5.0, "same_size": 3.0, "bigger_worse": 3.5, "biggest": 1.0}
    cost = {"small": 1, "same_size_worse": 2, "same_size": 2, "bigger_worse": 3, "biggest": 4}
    assert sensitivity.frontier(errors, cost.__getitem__) == ("small", "same_size", "biggest")


def test_rank_correlation_of_the_proxy_against_measured_klds():
    from quantkit.mixed.sensitivity import proxy_agreement, rank_correlation, ranks

    assert ranks([3.0, 1.0, 2.0, 1.0]) == [3.0, 0.5, 2.0, 0.5]
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert rank_correlation([1, 2], [1, 2]) is None and rank_correlation([1, 1, 1], [1, 2, 3]) is None
    rows = [SensitivityRow(f"l{i}", (1, 1), {"q": e}, "q") for i, e in enumerate([1.0, 2.0, 3.0, 4.0])]
    for row, kld in zip(rows, [0.1, 0.3, 0.2, None]):
        row.kld = kld
    assert proxy_agreement(rows) == pytest.approx(0.5)  # the unmeasured row is left out


def test_probe_windows_grow_with_the_calibration_and_stop_at_the_limit():
    starts = [0, 3, 6]  # passes through 7, 4 and 1 layers (the head counted as one): 12 a window
    assert sensitivity.probe_windows(8, 32, 6, starts) == 8  # 32 windows x 7 layers pay for 18
    assert sensitivity.probe_windows(8, 6, 6, starts) == 3  # 42 // 12
    assert sensitivity.probe_windows(8, 1, 6, starts) == 1  # at least one
    assert sensitivity.probe_windows(8, 100, 6, []) == 8


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "glm4_moe", "mixtral", "minimax_m2", "ernie4_5_moe",
                                    "deepseek_v3", "qwen3_5_moe_text", "qwen3_next", "hunyuan_v1_moe"])
def test_a_probe_of_one_expert_measures_the_model_with_that_expert_changed(tmp_path, family):
    """A mixture of experts streams for the probes (its tensors renamed and its per-expert tensors stacked as
    transformers' loading does it; the routers' correction biases read in): a probe patching one stored expert
    tensor measures the KL divergence of the resident float32 model with that expert's weight changed, to float32
    rounding."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.families.test_moe import build

    model_dir = build(tmp_path / "model", family)
    layer = 1  # an MoE layer in every family (GLM-4.5's and DeepSeek-V3's first_k_dense_replace 1)
    block, down = ("block_sparse_moe", "w2") if family in ("mixtral", "minimax_m2") else ("mlp", "down_proj")
    name = f"model.layers.{layer}.{block}.experts.2.{down}.weight"
    resident = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    experts = resident.model.layers[layer].mlp.experts
    changed = experts.down_proj[2].detach().flip(0)
    windows = torch.randint(0, resident.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = torch.log_softmax(resident(windows).logits.float(), -1)
        experts.down_proj[2].copy_(changed)
        patched = torch.log_softmax(resident(windows).logits.float(), -1)
    expected = (base.exp() * (base - patched)).sum(-1)[:, :-1].mean().item()  # the positions that predict a token
    probe = sensitivity.Probe(name, layer, lambda: {name: changed.clone()})
    measured = sensitivity.probe_klds(model_dir, [probe], windows, "setting")[name]
    assert expected > 1e-5 and measured == pytest.approx(expected, rel=1e-3)
