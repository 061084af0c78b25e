"""quantkit.mixed.core: roles and probes, gains interpolated over depth, the frontier of candidates, budgets as
hard limits, and the fallback step on tied units."""

from __future__ import annotations

import pytest

from quantkit.mixed import core as mixed
from quantkit.mixed.core import Ladder, SensitivityRow, Unit


def row(name: str, error: float = 1.0, candidates=("a", "b", "c")) -> SensitivityRow:
    errors = {c: error / 4 ** i for i, c in enumerate(candidates)}
    return SensitivityRow(name, (4, 4), errors, candidates[0], candidates[0])


def test_role_and_depth_fold_the_layer_index_and_experts():
    assert mixed.role_and_depth("blk.12.ffn_down.weight") == ("blk.N.ffn_down.weight", 12)
    assert mixed.role_and_depth("model.layers.3.mlp.experts.5.down_proj") == ("model.layers.N.mlp.experts.*.down_proj", 3)
    assert mixed.role_and_depth("output.weight") == ("output.weight", None)


def test_probes_spread_over_depth_per_role():
    rows = [row(f"model.layers.{i}.{kind}") for i in range(10) for kind in ("q_proj", "down_proj")] + [row("lm_head")]
    chosen = mixed.probe_names(rows, 3)
    assert sorted(chosen) == sorted([f"model.layers.{i}.{k}" for i in (0, 4, 9) for k in ("q_proj", "down_proj")]
                                    + ["lm_head"])  # round(4.5) is 4
    assert len(mixed.probe_names(rows[:4], 3)) == 4  # two layers: every row


def test_gains_are_measured_on_probes_and_interpolated_over_depth():
    rows = [row(f"blk.{i}.attn_q.weight", error=2.0) for i in range(5)] + [row("blk.0.ffn_up.weight"),
                                                                            row("output.weight", error=4.0)]
    mixed.set_gains(rows, {"blk.0.attn_q.weight": 2.0, "blk.4.attn_q.weight": 10.0, "output.weight": 4.0})
    gains = {r.name: r.gain for r in rows}
    assert gains["blk.0.attn_q.weight"] == 1.0 and gains["blk.4.attn_q.weight"] == 5.0  # kld / error(probe)
    assert gains["blk.2.attn_q.weight"] == pytest.approx(3.0)  # halfway in depth
    assert gains["blk.0.ffn_up.weight"] == pytest.approx((1.0 + 5.0 + 1.0) / 3)  # a role without probes: the mean
    assert rows[2].kld is None and rows[0].kld == 2.0
    assert rows[2].damage("b") == pytest.approx(3.0 * 2.0 / 4)


def test_the_frontier_drops_dominated_candidates():
    errors = {"small": 4.0, "same_size_worse": 5.0, "same_size": 3.0, "bigger_worse": 3.5, "biggest": 1.0}
    cost = {"small": 1, "same_size_worse": 2, "same_size": 2, "bigger_worse": 3, "biggest": 4}
    assert mixed.frontier(errors, cost.__getitem__) == ("small", "same_size", "biggest")


def test_a_budget_below_the_cheapest_plan_is_refused_with_both_numbers():
    rows = [row("x"), row("y")]
    size = lambda r, c: {"a": 10, "b": 20, "c": 40}[c]  # noqa: E731
    assert mixed.assign(rows, 30, size) in ({"x": "b", "y": "a"}, {"x": "a", "y": "b"})
    with pytest.raises(mixed.BudgetError, match="a budget of 19 bytes cannot be met.*20 bytes"):
        mixed.assign(rows, 19, size)


def test_raise_plan_moves_units_together_and_keeps_one_quantized():
    rows = [row("q", 8.0), row("k", 1.0), row("o", 2.0)]
    ladder = Ladder(rows, {"q": "a", "k": "a", "o": "a"}, lambda r, c: {"a": 1, "b": 2, "c": 4}[c],
                    units=lambda plan: [Unit("qk", rows[:2]), Unit("o", rows[2:])], keep_one=True)
    plan, raised = mixed.raise_plan(ladder, ladder.plan, 1, 100)
    assert plan == {"q": "b", "k": "b", "o": "a"} and raised == {"q": ("a", "b"), "k": ("a", "b")}
    again, raised = mixed.raise_plan(ladder, plan, 1, 1)  # q and k to c take 4 bytes: o is raised instead
    assert raised == {"o": ("a", "b")} and again["q"] == "b"
    assert mixed.raise_plan(ladder, plan, 1, 0)[1] == {}  # no room at all
    top = {"q": "c", "k": "c", "o": "b"}
    plan, raised = mixed.raise_plan(ladder, top, 2, 100)  # o to the top would leave nothing quantized
    assert raised == {} and plan == top


def test_an_absolute_max_size_below_the_first_artifact_is_refused():
    mixed.check_max_size(mixed.Fallback(max_size="+1%"), 10_000, "m")
    mixed.check_max_size(mixed.Fallback(max_size="20KB"), 10_000, "m")
    with pytest.raises(mixed.BudgetError, match=r"--max-size 5KB \(5,000 bytes\).*10,000 bytes"):
        mixed.check_max_size(mixed.Fallback(max_size="5KB"), 10_000, "m")
