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



# ---------------------------------------------------------------- the fallback's search


def keep_rows(damages: dict[str, float]):
    """Rows at "q" (quantized) or "16-bit", each raise 10 bytes, the damage at "q" as given."""
    from quantkit.mixed.sensitivity import SensitivityRow

    return [SensitivityRow(name, (1, 1), {"q": d, "16-bit": 0.0}, "q", "q") for name, d in damages.items()]


def keep_ladder(damages: dict[str, float]):
    rows = keep_rows(damages)
    return Ladder(rows, {r.name: "q" for r in rows}, lambda r, p: {"q": 10, "16-bit": 20}[p], keep_one=True)


def test_the_raise_sequence_is_greedy_and_keeps_one_quantized():
    ladder = keep_ladder({"a": 1.0, "b": 5.0, "c": 3.0})
    sequence = budget.raise_sequence(ladder)
    assert [s.unit for s in sequence] == ["b", "c"]  # the last row stays quantized
    assert [(s.added, s.removed) for s in sequence] == [(10, 5.0), (10, 3.0)]
    assert budget.plan_after(ladder, sequence, 1) == {"a": "q", "b": "16-bit", "c": "q"}


def test_the_search_jumps_to_the_prediction_then_narrows_the_bracket():
    """Damage 10, 9, ..., 1 over ten raises: predicted KLD proportional to the damage left, scaled to the
    measured one. Target 0.1 (with a 15% margin: 0.085) and the plain artifact at 1.0: 8 raises leave 3 of 55
    (0.055), 7 leave 6 (0.109)."""
    space = budget.SearchSpace.of(budget.raise_sequence(keep_ladder({f"r{i}": float(10 - i) for i in range(10)})),
                                  55.0, 10_000, 0.1)
    tried = [budget.Tried(0, False, 1.0)]
    first = budget.next_count(space, tried, 7)
    assert first == 8
    tried.append(budget.Tried(first, True, 0.05))
    second = budget.next_count(space, tried, 6)
    assert second == 4  # no count below 8 is predicted to pass: the middle of the bracket
    tried.append(budget.Tried(second, False, 0.2))
    third = budget.next_count(space, tried, 5)
    assert third is None or second < third < first


def test_the_search_stops_within_the_room_and_predicts_what_it_needs():
    space = budget.SearchSpace.of(budget.raise_sequence(keep_ladder({f"r{i}": 1.0 for i in range(20)})),
                                  20.0, 50, 0.06)
    assert space.reachable == 5
    tried = [budget.Tried(0, False, 1.0)]
    assert budget.next_count(space, tried, 7) == 5  # nothing within the room is predicted to pass: all of it
    tried.append(budget.Tried(5, False, 0.75))
    assert budget.next_count(space, tried, 6) is None
    assert budget.room_needed(space, tried[-1]) == 190  # scaled to 0.75 at 15 left: 19 raises leave 1 (0.05)
    assert budget.room_needed(budget.SearchSpace(space.added, space.left, 50, 0.01), tried[-1]) is None
    assert budget.room_needed(budget.SearchSpace(space.added, space.left, 50, None), tried[-1]) is None


def test_without_a_kld_target_the_search_doubles_then_halves():
    space = budget.SearchSpace.of(budget.raise_sequence(keep_ladder({f"r{i}": 1.0 for i in range(40)})),
                                  40.0, 10_000, None)
    tried = [budget.Tried(0, False, 1.0)]
    assert budget.next_count(space, tried, 7) == 4  # an eighth of the reachable 39
    tried.append(budget.Tried(4, False, 0.9))
    assert budget.next_count(space, tried, 6) == 8
    tried.append(budget.Tried(8, True, 0.5))
    assert budget.next_count(space, tried, 5) == 6
    tried.append(budget.Tried(6, True, 0.6))
    assert budget.next_count(space, tried, 4) == 5
    assert budget.next_count(space, [*tried, budget.Tried(5, False, 0.7)], 3) is None  # 5 failed, 6 passed
    assert budget.next_count(space, tried, 0) is None  # no steps left
