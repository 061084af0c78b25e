"""The method-independent parts of mixed precision: sensitivity rows, size budgets, the fallback ladder.

A unit (a GGUF tensor, a Linear layer, a group of layers that move together) has candidate
precisions, cheapest first, and a weighted error at each (in its own units: the output MSE its
quantization adds to the layer's output). The damage model turns errors into KL divergence:

    damage(t, c) = gain(t) * error(t, c)

where gain(t) is the KL divergence per unit of error. It is measured for a few probe units (the
calibration windows through the layer-streamed forward with only that unit quantized at its probe
precision: gain = kld / error(probe)) and interpolated for the rest: units are grouped by role (the
name with its layer index taken out: `blk.N.ffn_down.weight`, `model.layers.N.mlp.down_proj`) and
a role's gain is interpolated linearly over depth between its probes. KL divergence is quadratic in
a small output perturbation, as the error is, so within one role and depth the error ranks the
candidates and the gain carries what the rest of the network makes of that role at that depth.
Probes start the forward at their own layer (quantkit.eval.stream.start_scorer: the inputs of the probed
layers are recorded once), so a probe in the last layer costs one layer, not the whole model.

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

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Hashable, Iterable, Protocol, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from quantkit.errors import InputError, UnsupportedError

PROBES_PER_ROLE = 3  # units of one role whose KL divergence is measured: the first, middle and last layer's


class Row(Protocol):
    name: str

    @property
    def candidates(self) -> Sequence[Hashable]: ...

    def damage(self, candidate) -> float: ...


SizeModel = Callable[[Row, Hashable], int]


class BudgetError(InputError):
    """A size budget no assignment can meet: refused before the long work, with both numbers."""


# ------------------------------------------------------------------ sensitivity rows


@dataclass
class SensitivityRow:
    """One unit's weighted error at each candidate precision (cheapest first), and its gain."""

    name: str
    shape: tuple[int, ...]
    errors: dict[str, float]  # candidate -> weighted error, cheapest candidate first
    probe: str  # the candidate its KL divergence is measured at (when it is a probe)
    plain: str = ""  # the precision the plain (not mixed) artifact gives it
    kld: float | None = None  # measured KL divergence with only this unit at `probe` (None: not a probe)
    gain: float | None = None  # KLD per unit of error: measured (kld / error(probe)) or interpolated
    order: tuple[str, ...] = ()  # candidates cheapest first, dominated ones left out (default: `errors`' order)

    def __post_init__(self) -> None:
        self.order = tuple(self.order or self.errors)

    @property
    def candidates(self) -> list[str]:
        return list(self.order)

    def damage(self, candidate: str) -> float:
        error = self.errors[candidate]
        return error if self.gain is None else self.gain * error

    def as_dict(self) -> dict:
        return {"tensor": self.name, "shape": list(self.shape), "plain": self.plain, "probe": self.probe,
                "kld": self.kld, "gain": self.gain, "errors": self.errors, "candidates": self.candidates,
                "damage": {c: self.damage(c) for c in self.candidates}}

    @classmethod
    def from_dict(cls, row: dict) -> "SensitivityRow":
        return cls(row["tensor"], tuple(row["shape"]), dict(row["errors"]), row["probe"], row.get("plain", ""),
                   row["kld"], row.get("gain"), tuple(row.get("candidates", ())))


def frontier(errors: dict[str, float], cost: Callable[[str], float]) -> tuple[str, ...]:
    """The candidates worth choosing, cheapest first: each has a lower error than every candidate that
    costs no more (a same-size or dearer candidate with no less error is never chosen)."""
    kept, best = [], float("inf")
    for candidate in sorted(errors, key=lambda c: (cost(c), errors[c])):
        if errors[candidate] < best:
            kept.append(candidate)
            best = errors[candidate]
    return tuple(kept)


# ------------------------------------------------------------------ budget


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
    """Units raised per fallback step: the option, or (0) a tenth of them, at least 1."""
    return tensors_per_step or max(1, rows // 10)


class Fallback(BaseModel):
    """On a failed gate, raise the most damaging tensors' precision step by step until it passes."""

    model_config = ConfigDict(extra="forbid")
    max_size: str = Field("+25%", description="size limit: +N% of the first artifact, or a size (120MB, 4GiB)")
    tensors_per_step: int = Field(0, ge=0, description="tensors raised per step (0: a tenth of them, at least 1)")

    @field_validator("max_size")
    @classmethod
    def _readable(cls, value: str) -> str:
        size_limit(value, 1)
        return value


def size_limit(max_size: str, first_bytes: int) -> int:
    """Fallback.max_size in bytes: '+25%' of the first artifact's size, or an absolute size."""
    from quantkit.run.preflight import parse_size

    text = max_size.strip()
    if text.startswith("+") and text.endswith("%"):
        try:
            return int(first_bytes * (1 + float(text[1:-1]) / 100))
        except ValueError:
            raise InputError(f"cannot read the size limit '{max_size}'", hint="write e.g. +25% or 120MB") from None
    return parse_size(text)


def check_max_size(fallback: Fallback | None, first_bytes: int, method: str) -> None:
    """An absolute --max-size below the first artifact's size (estimated before any work): BudgetError."""
    if fallback is None or fallback.max_size.strip().startswith("+"):
        return
    limit = size_limit(fallback.max_size, first_bytes)
    if limit < first_bytes:
        raise BudgetError(f"{method}: --max-size {fallback.max_size} ({limit:,} bytes) is below the first "
                          f"artifact, which takes {first_bytes:,} bytes before any raise",
                          hint="raise --max-size, or give it as +N% of the first artifact")


# ------------------------------------------------------------------ the fallback ladder


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


# ------------------------------------------------------------------ roles, probes and gains


def role_and_depth(name: str) -> tuple[str, int | None]:
    """(role, layer index) of a unit name: the first index component is the layer (blk.N.,
    layers.N.), later ones (experts) are folded into the role; (name, None) without an index."""
    match = re.search(r"(^|\.)(\d+)\.", name)
    if match is None:
        return name, None
    role = name[:match.start(2)] + "N" + re.sub(r"\.\d+\.", ".*.", name[match.end(2):])
    return role, int(match.group(2))


def probe_names(rows: Sequence[SensitivityRow], per_role: int = PROBES_PER_ROLE) -> list[str]:
    """The rows whose KL divergence is measured: per role, `per_role` layers spread evenly from the
    first to the last (every row of a role with fewer layers)."""
    by_role: dict[str, list[tuple[int, str]]] = {}
    for r in rows:
        role, depth = role_and_depth(r.name)
        by_role.setdefault(role, []).append((depth or 0, r.name))
    chosen = []
    for members in by_role.values():
        members.sort()
        count = min(len(members), max(1, per_role))
        picks = sorted({round(i * (len(members) - 1) / max(1, count - 1)) for i in range(count)})
        chosen += [members[i][1] for i in picks]
    return chosen


def set_gains(rows: Sequence[SensitivityRow], klds: dict[str, float]) -> None:
    """Each row's gain: kld / error(probe) where it was measured; elsewhere interpolated linearly over
    depth between the measured rows of its role (the nearest one's beyond them; the mean of every
    measured gain for a role without any)."""
    for r in rows:
        if r.name in klds:
            r.kld = klds[r.name]
            reference = r.errors[r.probe]
            r.gain = r.kld / reference if reference > 0 else 0.0
    known: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r.name in klds:
            role, depth = role_and_depth(r.name)
            known.setdefault(role, []).append((depth or 0, r.gain))
    gains = [g for points in known.values() for _, g in points]
    fallback = sum(gains) / len(gains) if gains else None
    for r in rows:
        if r.name not in klds:
            role, depth = role_and_depth(r.name)
            r.gain = interpolate(sorted(known[role]), depth or 0) if role in known else fallback


def interpolate(points: list[tuple[int, float]], x: int) -> float:
    """Piecewise-linear through (x, y) points sorted by x, flat beyond the ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


# ------------------------------------------------------------------ measured KL divergence


class PatchedWeights:
    """A WeightSource (quantkit.eval.stream) giving `patch`'s tensors in place of the base's."""

    def __init__(self, base, patch: dict):
        self.base, self.patch = base, patch

    def keys(self):
        return self.base.keys()

    def get(self, name: str):
        return self.patch[name] if name in self.patch else self.base.get(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.base.shape(name)

    def rows(self, name: str, index):
        return self.patch[name][index] if name in self.patch else self.base.rows(name, index)


@dataclass
class Probe:
    """One unit quantized alone: the checkpoint tensors it replaces (made when measured, so one probe
    is in memory at a time), the input transforms of its modules (activation quantization: {module
    name: x -> x'}), and the first decoder layer it changes (0: the embedding; the layer count: the head)."""

    name: str
    start: int
    patch: Callable[[], dict]
    inputs: dict[str, Callable] = field(default_factory=dict)


def check_streamable(model_dir: Path, setting: str) -> None:
    """UnsupportedError when the checkpoint has no layer-streamed forward (`setting`: the option
    that turns the measurement off, for the hint)."""
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.eval.stream import streamable

    info = check_model_dir(Path(model_dir))
    if not streamable(info.config):
        raise UnsupportedError(f"measured sensitivity needs the layer-streamed forward, which {info.architecture} "
                               "does not have (a VLM, or experts transformers fuses while loading)",
                               hint=f"set {setting} (the weighted error alone)")


def layer_count(model_dir: Path) -> int:
    from quantkit.engines.transformers import hf_config

    return hf_config(model_dir).get_text_config().num_hidden_layers


@dataclass
class _Hooked:
    handles: list = field(default_factory=list)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def transform_inputs(model, inputs: dict[str, Callable]) -> _Hooked:
    """Forward pre-hooks replacing the first input of each named module by its transform."""
    modules = dict(model.named_modules())
    return _Hooked([modules[name].register_forward_pre_hook(lambda _m, args, fn=fn: (fn(args[0]), *args[1:]))
                    for name, fn in inputs.items()])


def probe_klds(model_dir: Path, probes: Iterable[Probe], windows, setting: str, workdir: Path | None = None,
               progress: Callable[[str], None] = lambda message: None) -> dict[str, float]:
    """{name: mean KL divergence} of the streamed float32 forward over `windows` with one probe at a
    time applied, against the unpatched forward. The unpatched pass records the inputs of the layers
    the probes start at; each probe's forward resumes there."""
    import torch

    from quantkit.eval import evaluate
    from quantkit.engines.transformers import hf_config
    from quantkit.eval.stream import recording_scorer, start_scorer, stream_model
    from quantkit.io.checkpoint import SafetensorsWeights

    check_streamable(model_dir, setting)
    probes = list(probes)
    config = hf_config(model_dir)
    base = SafetensorsWeights(model_dir)
    streamed = stream_model(config, base, torch.float32)
    text, record = config.get_text_config(), {}
    baseline = evaluate.compute_baseline(recording_scorer(streamed, text, {p.start for p in probes}, record,
                                                          workdir=workdir), windows, workdir)
    klds = {}
    for index, probe in enumerate(probes):
        progress(f"sensitivity: {probe.name} alone ({index + 1}/{len(probes)})")
        streamed.weights.source = PatchedWeights(base, probe.patch())
        hooks = transform_inputs(streamed.model, probe.inputs)
        try:
            metrics = evaluate.compare(start_scorer(streamed, text, probe.start, record, workdir=workdir), windows,
                                       baseline)
        finally:
            hooks.close()
            streamed.weights.source = base
        klds[probe.name] = max(0.0, metrics.kld_mean)
    return klds
