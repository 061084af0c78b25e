"""Precisions under a size budget, and the gate-driven fallback's step: shared by every method.

A unit (a GGUF tensor, a Linear layer, a group of layers that move together) has candidate
precisions, cheapest first, and a predicted damage at each (quantkit.mixed.sensitivity); a size
model gives its bytes at each.

* `assign`: candidates under a byte budget, a hard limit: every unit starts at its cheapest
  candidate (BudgetError when even those exceed the budget), then while the budget allows, the
  single upgrade with the largest predicted damage removed per added byte is applied (greedy
  marginal-gain knapsack).
* `raise_plan`: one step of the gate-driven fallback, the units with the largest predicted damage at
  their current precision moved to their next candidate, within the room left under
  `Fallback.max_size`. The pipeline owns the loop (quantkit.run.pipeline.run_fallback); a method says
  what its units are (its `Ladder`) and how to write a plan.

A row is anything with `name`, `candidates` (cheapest first) and `damage(candidate)` (the `Row`
protocol); a size model is a function (row, candidate) -> bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Protocol, Sequence

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from quantkit.errors import InputError
from quantkit.mixed.sensitivity import SensitivityRow


class Row(Protocol):
    name: str

    @property
    def candidates(self) -> Sequence[Hashable]: ...

    def damage(self, candidate) -> float: ...


SizeModel = Callable[[Row, Hashable], int]


class BudgetError(InputError):
    """A size budget no assignment can meet: refused before the long work, with both numbers."""


def total_bytes(rows: Iterable[Row], choice: dict, size: SizeModel) -> int:
    return sum(size(r, choice[r.name]) for r in rows)


def cheapest_bytes(rows: Iterable[Row], size: SizeModel) -> int:
    return sum(size(r, r.candidates[0]) for r in rows)


def check_budget(cheapest: int, budget: int, what: str, hint: str) -> None:
    """BudgetError when the cheapest assignment (`cheapest` bytes) does not fit in `budget` bytes."""
    if cheapest > budget:
        raise BudgetError(f"{what}: a budget of {budget:,} bytes cannot be met: the cheapest precision of "
                          f"every tensor takes {cheapest:,} bytes", hint=hint)


def best_upgrade(rows: Sequence[Row], choice: dict, room: int, size: SizeModel):
    """(gain per byte, name, candidate, added bytes) of the best upgrade that fits in `room`, or None."""
    best = None
    for r in rows:
        current = choice[r.name]
        cands = list(r.candidates)
        base_bytes, base_damage = size(r, current), r.damage(current)
        for up in cands[cands.index(current) + 1:]:
            added = size(r, up) - base_bytes
            gain = base_damage - r.damage(up)
            if added <= 0 or added > room or gain <= 0:
                continue
            if best is None or gain / added > best[0]:
                best = (gain / added, r.name, up, added)
    return best


def assign(rows: Sequence[Row], budget: int, size: SizeModel) -> dict:
    """{name: candidate} whose total bytes stay within `budget`, the predicted damage reduced greedily
    per added byte; BudgetError when even the cheapest candidates exceed it."""
    check_budget(cheapest_bytes(rows, size), budget, "auto_precision", "raise the budget")
    choice = {r.name: r.candidates[0] for r in rows}
    room = budget - total_bytes(rows, choice, size)
    while (step := best_upgrade(rows, choice, room, size)) is not None:
        _, name, candidate, added = step
        choice[name] = candidate
        room -= added
    return choice


def raise_step(rows: Sequence[Row], choice: dict, count: int, room: int, size: SizeModel) -> dict:
    """One fallback step: up to `count` rows with the largest predicted damage at their current
    candidate, each moved to its next candidate, while the added bytes fit in `room`. A row whose
    current choice is its last candidate stays; one whose choice is not a candidate (dominated) moves
    to the cheapest candidate above it in size.
    Returns {name: (old, new)} (empty: nothing can be raised within the room)."""
    raised = {}
    for r in sorted(rows, key=lambda r: damage_at(r, choice[r.name]), reverse=True):
        new = next_candidate(r, choice[r.name], size)
        if new is None:
            continue
        added = size(r, new) - size(r, choice[r.name])
        if added > room:
            continue
        raised[r.name] = (choice[r.name], new)
        room -= added
        if len(raised) == count:
            break
    return raised


def damage_at(row: Row, candidate) -> float:
    """The row's damage at `candidate`; at a precision it does not list, its cheapest candidate's."""
    return row.damage(candidate if candidate in row.candidates else row.candidates[0])


def next_candidate(row: Row, current, size: SizeModel):
    """The candidate after `current`; for a precision not among the candidates, the first that costs more."""
    cands = list(row.candidates)
    if current in cands:
        position = cands.index(current)
        return cands[position + 1] if position + 1 < len(cands) else None
    return next((c for c in cands if size(row, c) > size(row, current)), None)


def step_count(tensors_per_step: int, rows: int) -> int:
    """Units raised per fixed fallback step: the option, or (0) a tenth of them, at least 1."""
    return tensors_per_step or max(1, rows // 10)


class Fallback(BaseModel):
    """On a failed gate, raise the most damaging tensors' precision until it passes (quantkit.run.fallback)."""

    model_config = ConfigDict(extra="forbid")
    max_size: str = Field("+25%", description="size limit: +N% of the first artifact, or a size (120MB, 4GiB)")
    tensors_per_step: int = Field(0, ge=0, description="0: search for the fewest raises that pass (measured "
                                  "steps, bisected); N: fixed steps of N raises until the gate passes")
    _limit: SizeLimit = PrivateAttr()  # max_size read once, when the model is validated

    def model_post_init(self, context) -> None:
        self._limit = read_size_limit(self.max_size)

    @property
    def relative(self) -> bool:
        """Whether max_size is a share of the first artifact (+N%) rather than a size."""
        return self._limit.growth is not None

    def size_limit(self, first_bytes: int) -> int:
        """max_size in bytes, given the first artifact's size."""
        return self._limit.bytes_for(first_bytes)


@dataclass(frozen=True)
class SizeLimit:
    """A size limit as written: +N% of the first artifact (growth = N / 100), or a size in bytes."""

    growth: float | None = None
    size: int | None = None

    def bytes_for(self, first_bytes: int) -> int:
        return int(first_bytes * (1 + self.growth)) if self.growth is not None else self.size


def read_size_limit(max_size: str) -> SizeLimit:
    """'+25%' or an absolute size (120MB, 4GiB) read once; InputError (exit 2) for anything else."""
    from quantkit.units import parse_size

    text = max_size.strip()
    if text.startswith("+") and text.endswith("%"):
        try:
            return SizeLimit(growth=float(text[1:-1]) / 100)
        except ValueError:
            raise InputError(f"--max-size {max_size}: cannot read the size limit",
                             hint="write e.g. --max-size +25% or --max-size 120MB (recipe: fallback: {max_size: ...})") from None
    return SizeLimit(size=parse_size(text))


def check_max_size(fallback: Fallback | None, first_bytes: int, method: str) -> None:
    """An absolute --max-size below the first artifact's size (estimated before any work): BudgetError."""
    if fallback is None or fallback.relative:
        return
    limit = fallback.size_limit(first_bytes)
    if limit < first_bytes:
        raise BudgetError(f"{method}: --max-size {fallback.max_size} ({limit:,} bytes) is below the first "
                          f"artifact, which takes {first_bytes:,} bytes before any raise",
                          hint="raise --max-size, or give it as +N% of the first artifact")


@dataclass
class Unit:
    """Rows that take one precision together (a Row): their damages add; `highest` caps the candidates."""

    name: str
    members: list[SensitivityRow]
    highest: str | None = None

    @property
    def candidates(self) -> list[str]:
        cands = self.members[0].candidates
        return cands if self.highest is None else cands[:cands.index(self.highest) + 1]

    def damage(self, candidate: str) -> float:
        return sum(m.damage(candidate) for m in self.members)


@dataclass
class Ladder:
    """What a method's fallback raises: its sensitivity rows, the precision of each in the first
    artifact, the bytes a row takes at a precision, and the units a raise moves together."""

    rows: list[SensitivityRow]
    plan: dict[str, str]  # row name -> precision in the artifact
    size: Callable[[SensitivityRow, str], int]
    units: Callable[[dict[str, str]], list[Unit]] | None = None  # default: every row alone
    keep_one: bool = False  # a plan must keep one row below its highest candidate (a format needs one)
    details: dict = field(default_factory=dict)  # the sensitivity table for the report

    def units_for(self, plan: dict[str, str]) -> list[Unit]:
        return self.units(plan) if self.units else [Unit(r.name, [r]) for r in self.rows]


def raise_plan(ladder: Ladder, plan: dict[str, str], count: int, room: int) -> tuple[dict[str, str], dict]:
    """One fallback step on `plan`: (the new plan, {row name: (old, new)}), the most damaging units one
    candidate up within `room` bytes; an empty dict when nothing can be raised. A unit's precision is
    its lowest member's; raised, every member takes the unit's next candidate."""
    units = ladder.units_for(plan)
    order = {u.name: u.members[0].candidates for u in units}
    current = {u.name: min((plan[m.name] for m in u.members), key=lambda p: rank(order[u.name], p)) for u in units}
    moved = raise_step(units, current, count, room, lambda u, p: sum(ladder.size(m, p) for m in u.members))
    members = {u.name: u.members for u in units}
    new = dict(plan)
    for name, (_, precision) in moved.items():
        new.update({m.name: precision for m in members[name]})
    if moved and ladder.keep_one and all(new[r.name] == r.candidates[-1] for r in ladder.rows):
        last = list(moved)[-1]  # the least damaging raise stays where it was
        new.update({m.name: plan[m.name] for m in members[last]})
        del moved[last]
    raised = {m.name: (plan[m.name], new[m.name]) for name in moved for m in members[name]
              if new[m.name] != plan[m.name]}
    return new, raised


def rank(candidates: list[str], precision: str) -> int:
    return candidates.index(precision) if precision in candidates else -1


# ------------------------------------------------------------------ the fallback's search over the raises


@dataclass(frozen=True)
class Raise:
    """One move of a unit to its next candidate: the bytes it adds and the predicted damage it removes."""

    unit: str
    members: tuple[str, ...]
    old: str
    new: str
    added: int
    removed: float


def raise_sequence(ladder: Ladder) -> list[Raise]:
    """Every raise from the ladder's plan, in the order the greedy search takes them: at each point the
    single unit move removing the most predicted damage per added byte (no room limit). With keep_one, the
    sequence stops before it would leave no row below its highest candidate."""
    units = ladder.units_for(ladder.plan)
    current = {u.name: min((ladder.plan[m.name] for m in u.members), key=lambda p: rank(u.members[0].candidates, p))
               for u in units}
    size = lambda u, p: sum(ladder.size(m, p) for m in u.members)  # noqa: E731
    sequence, left = [], {u.name for u in units if current[u.name] != u.candidates[-1]}
    while (step := best_upgrade(units, current, 1 << 62, size)) is not None:
        _, name, new, added = step
        unit = next(u for u in units if u.name == name)
        if ladder.keep_one and new == unit.candidates[-1] and left == {name}:
            break
        sequence.append(Raise(name, tuple(m.name for m in unit.members), current[name], new, added,
                              unit.damage(current[name]) - unit.damage(new)))
        current[name] = new
        if new == unit.candidates[-1]:
            left.discard(name)
    return sequence


def plan_after(ladder: Ladder, sequence: list[Raise], count: int) -> dict[str, str]:
    """The ladder's plan with the first `count` raises of the sequence applied."""
    plan = dict(ladder.plan)
    for step in sequence[:count]:
        plan.update(dict.fromkeys(step.members, step.new))
    return plan


@dataclass(frozen=True)
class Tried:
    """A measured point of the search: `count` raises applied, the gate's verdict and the KL divergence."""

    count: int
    passed: bool
    kld: float


@dataclass(frozen=True)
class SearchSpace:
    """The raise sequence as the search sees it: cumulative bytes added and predicted damage left after k
    raises (k = 0..len), the room the size limit leaves, and the gate's KL divergence limit (None: the gate
    fails on another metric, and the search halves its interval instead of predicting)."""

    added: list[int]
    left: list[float]
    room: int
    target: float | None

    @classmethod
    def of(cls, sequence: list[Raise], total_damage: float, room: int, target: float | None) -> "SearchSpace":
        added, left = [0], [total_damage]
        for step in sequence:
            added.append(added[-1] + step.added)
            left.append(max(0.0, left[-1] - step.removed))
        return cls(added, left, room, target)

    @property
    def reachable(self) -> int:
        """The most raises whose predicted bytes fit in the room."""
        return max(k for k, added in enumerate(self.added) if added <= self.room)

    def predicted(self, k: int, at: Tried) -> float:
        """The KL divergence after k raises, the damage model scaled to the measurement `at`."""
        return self.left[k] * (at.kld / self.left[at.count]) if self.left[at.count] > 0 else at.kld

    def first_passing(self, at: Tried, low: int, high: int) -> int | None:
        """The fewest raises in (low, high] predicted under the target with a 15% margin, None if none is."""
        if self.target is None:
            return None
        return next((k for k in range(low + 1, high + 1) if self.predicted(k, at) <= 0.85 * self.target), None)


def tolerance(best: int) -> int:
    """How close to the fewest passing raises the search stops: within a tenth of them, at least one."""
    return max(1, best // 10)


def next_count(space: SearchSpace, tried: list[Tried], steps_left: int) -> int | None:
    """The number of raises to measure next, or None to stop: the search brackets the fewest raises that
    pass the gate between the most that failed and the fewest that passed. Without a passing point it
    jumps to the prediction (or doubles), bounded by the room; with one, it narrows the bracket by the
    prediction, kept inside the middle half (or halves it)."""
    failed = max(t.count for t in tried if not t.passed)
    passing = [t.count for t in tried if t.passed]
    last = next(t for t in tried if t.count == failed)
    if not passing:
        reach = space.reachable
        if failed >= reach or steps_left <= 0:
            return None
        if space.target is None:  # nothing to predict with: double the raises (an eighth of the room first)
            return min(reach, max(failed + 1, 2 * failed, reach // 8))
        guess = space.first_passing(last, failed, reach)
        return reach if guess is None else guess
    best = min(passing)
    if best - failed <= tolerance(best) or steps_left <= 0:
        return None
    quarter = max(1, (best - failed) // 4)
    guess = space.first_passing(last, failed, best - 1) or (failed + best) // 2
    return min(max(guess, failed + quarter), best - quarter)


def room_needed(space: SearchSpace, at: Tried) -> int | None:
    """Bytes the measured trend needs (the damage model scaled to `at`, the most raises measured): the fewest
    raises predicted under the target, None when none is (or the gate fails on another metric)."""
    if space.target is None:
        return None
    k = next((k for k in range(at.count, len(space.left)) if space.predicted(k, at) <= space.target), None)
    return None if k is None else space.added[k]
