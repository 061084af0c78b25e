"""The method-independent parts of mixed precision (gguf per-tensor k-quants, gptq per-layer int4/int8/16-bit).

* The damage model: each tensor has a weighted error per candidate precision (in its own units);
  with a measured KL divergence at one probe precision the error curve is scaled into KLD units,

      damage(t, c) = kld(t, probe) * error(t, c) / error(t, probe)

  (KL divergence is quadratic in a small output perturbation, and so is the error).
* `single_tensor_klds`: that KL divergence, one tensor at a time: the calibration windows through
  the layer-streamed float32 forward (quantkit.stream) with only that tensor replaced.
* `assign`: precisions under a byte budget. Every tensor starts at its cheapest candidate; then,
  while the budget allows, the single upgrade (one tensor to any higher candidate) with the largest
  predicted damage removed per added byte is applied (greedy marginal-gain knapsack).
* `raise_step`: one step of the gate-driven fallback, the tensors with the largest predicted damage at
  their current precision moved to their next candidate, within the room left under `Fallback.max_size`.

A sensitivity row is anything with `name`, `candidates` (cheapest first) and `damage(candidate)`
(the `Row` protocol); a size model is a function (row, candidate) -> bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Hashable, Iterable, Protocol, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from quantkit.errors import InputError, UnsupportedError


class Row(Protocol):
    name: str

    @property
    def candidates(self) -> Sequence[Hashable]: ...

    def damage(self, candidate) -> float: ...


SizeModel = Callable[[Row, Hashable], int]


def scaled_damage(kld: float | None, error: float, reference: float) -> float:
    """The damage of a precision whose weighted error is `error`, given the KLD measured at the probe
    (whose error is `reference`); without a measured KLD, the error itself."""
    if kld is None:
        return error
    return kld * error / reference if reference > 0 else 0.0


# ------------------------------------------------------------------ budget


def total_bytes(rows: Iterable[Row], choice: dict, size: SizeModel) -> int:
    return sum(size(r, choice[r.name]) for r in rows)


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
    """{name: candidate} whose total bytes stay within `budget` (the cheapest candidates where even
    those do not fit), the predicted damage reduced greedily per added byte."""
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
    current choice is its last candidate (or not one of them) stays.
    Returns {name: (old, new)} (empty: nothing can be raised within the room)."""
    raised = {}
    for r in sorted(rows, key=lambda r: r.damage(choice[r.name]), reverse=True):
        cands = list(r.candidates)
        position = cands.index(choice[r.name]) if choice[r.name] in cands else len(cands)
        if position + 1 >= len(cands):
            continue
        new = cands[position + 1]
        added = size(r, new) - size(r, choice[r.name])
        if added > room:
            continue
        raised[r.name] = (choice[r.name], new)
        room -= added
        if len(raised) == count:
            break
    return raised


def step_count(tensors_per_step: int, rows: int) -> int:
    """Tensors raised per fallback step: the option, or (0) a tenth of them, at least 1."""
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
    from quantkit.preflight import parse_size

    text = max_size.strip()
    if text.startswith("+") and text.endswith("%"):
        try:
            return int(first_bytes * (1 + float(text[1:-1]) / 100))
        except ValueError:
            raise InputError(f"cannot read the size limit '{max_size}'", hint="write e.g. +25% or 120MB") from None
    return parse_size(text)


# ------------------------------------------------------------------ measured KL divergence


class PatchedWeights:
    """A WeightSource (quantkit.stream) giving `patch`'s tensors in place of the base's."""

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


def check_streamable(model_dir: Path, setting: str) -> None:
    """UnsupportedError when the checkpoint has no layer-streamed forward (`setting`: the option
    that turns the measurement off, for the hint)."""
    from quantkit.model import check_model_dir
    from quantkit.stream import streamable

    info = check_model_dir(Path(model_dir))
    if not streamable(info.config):
        raise UnsupportedError(f"measured sensitivity needs the layer-streamed forward, which {info.architecture} "
                               "does not have (a VLM, or experts transformers fuses while loading)",
                               hint=f"set {setting} (the weighted error alone)")


def single_tensor_klds(model_dir: Path, patches: Iterable[tuple[str, dict]], windows, setting: str,
                       workdir: Path | None = None) -> dict[str, float]:
    """{name: mean KL divergence} of the streamed float32 forward over `windows` with only the
    tensors of one patch ({checkpoint tensor name: float tensor}) replaced, against the unpatched
    forward. `patches` yields (name, patch) one at a time, so one patch is in memory at once."""
    import torch

    from quantkit import evaluate
    from quantkit.model import hf_config
    from quantkit.stream import SafetensorsWeights, streamed_scorer

    check_streamable(model_dir, setting)
    config = hf_config(model_dir)
    base = SafetensorsWeights(model_dir)
    baseline = evaluate.compute_baseline(streamed_scorer(config, base, torch.float32, workdir=workdir), windows,
                                         workdir)
    klds = {}
    for name, patch in patches:
        scorer = streamed_scorer(config, PatchedWeights(base, patch), torch.float32, workdir=workdir)
        klds[name] = max(0.0, evaluate.compare(scorer, windows, baseline).kld_mean)
    return klds
