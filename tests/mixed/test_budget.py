"""quantkit.mixed.budget: budgets as hard limits, and the fallback step on tied units."""

from __future__ import annotations

import pytest

from quantkit.mixed import budget
from quantkit.mixed.budget import Ladder, Unit
from quantkit.mixed.sensitivity import SensitivityRow


def row(name: str, error: float = 1.0, candidates=("a", "b", "c")) -> SensitivityRow:
    errors = {c: error / 4 ** i for i, c in enumerate(candidates)}
    return SensitivityRow(name, (4, 4), errors, candidates[0], candidates[0])


def test_a_budget_below_the_cheapest_plan_is_refused_with_both_numbers():
    rows = [row("x"), row("y")]
    size = lambda r, c: {"a": 10, "b": 20, "c": 40}[c]  # noqa: E731
    assert budget.assign(rows, 30, size) in ({"x": "b", "y": "a"}, {"x": "a", "y": "b"})
    with pytest.raises(budget.BudgetError, match="a budget of 19 bytes cannot be met.*20 bytes"):
        budget.assign(rows, 19, size)


def test_raise_plan_moves_units_together_and_keeps_one_quantized():
    rows = [row("q", 8.0), row("k", 1.0), row("o", 2.0)]
    ladder = Ladder(rows, {"q": "a", "k": "a", "o": "a"}, lambda r, c: {"a": 1, "b": 2, "c": 4}[c],
                    units=lambda plan: [Unit("qk", rows[:2]), Unit("o", rows[2:])], keep_one=True)
    plan, raised = budget.raise_plan(ladder, ladder.plan, 1, 100)
    assert plan == {"q": "b", "k": "b", "o": "a"} and raised == {"q": ("a", "b"), "k": ("a", "b")}
    again, raised = budget.raise_plan(ladder, plan, 1, 1)  # q and k to c take 4 bytes: o is raised instead
    assert raised == {"o": ("a", "b")} and again["q"] == "b"
    assert budget.raise_plan(ladder, plan, 1, 0)[1] == {}  # no room at all
    top = {"q": "c", "k": "c", "o": "b"}
    plan, raised = budget.raise_plan(ladder, top, 2, 100)  # o to the top would leave nothing quantized
    assert raised == {} and plan == top


def test_an_absolute_max_size_below_the_first_artifact_is_refused():
    budget.check_max_size(budget.Fallback(max_size="+1%"), 10_000, "m")
    budget.check_max_size(budget.Fallback(max_size="20KB"), 10_000, "m")
    with pytest.raises(budget.BudgetError, match=r"--max-size 5KB \(5,000 bytes\).*10,000 bytes"):
        budget.check_max_size(budget.Fallback(max_size="5KB"), 10_000, "m")

