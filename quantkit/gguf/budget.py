"""Per-tensor GGUF types under a size budget, from a sensitivity table (quantkit.gguf.sensitivity).

`assign_types`: every tensor starts at its cheapest candidate type; then, while the budget allows,
the single upgrade (one tensor to any higher candidate) with the largest predicted damage removed
per added byte is applied (greedy marginal-gain knapsack). `raise_types`: one fallback step, the
tensors with the largest predicted damage moved to their next candidate type.

The result is an ordinary per-tensor type map. `override_lines` writes it as llama-quantize
`--tensor-type-file` lines: one anchored regex per quantized tensor. llama-quantize matches each
pattern with std::regex_search on the tensor name (so `attn_v` alone would match every layer and
`output.weight` would match `attn_output.weight`), and a tensor matched by a pattern skips the
mixture rules entirely; every quantized tensor is named, so the mixture's attn_v / ffn_down
counters never matter and the file reproduces the types exactly.
"""

from __future__ import annotations

import re

from gguf import GGML_QUANT_SIZES

from quantkit.gguf.mixture import T
from quantkit.gguf.sensitivity import TensorSensitivity


def nbytes(shape: tuple[int, ...], qtype: T) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    count = 1
    for d in shape:
        count *= d
    return count // block * size


def total_bytes(table: list[TensorSensitivity], types: dict[str, T]) -> int:
    return sum(nbytes(t.shape, types[t.name]) for t in table)


def mixture_types(table: list[TensorSensitivity]) -> dict[str, T]:
    return {t.name: T[t.mixture] for t in table}


def best_upgrade(table: list[TensorSensitivity], types: dict[str, T], room: int):
    """(gain per byte, name, type, added bytes) of the best upgrade that fits in `room`, or None."""
    best = None
    for t in table:
        current = types[t.name]
        cands = t.candidates
        base_bytes, base_damage = nbytes(t.shape, current), t.damage(current)
        for up in cands[cands.index(current) + 1:]:
            added = nbytes(t.shape, up) - base_bytes
            gain = base_damage - t.damage(up)
            if added <= 0 or added > room or gain <= 0:
                continue
            if best is None or gain / added > best[0]:
                best = (gain / added, t.name, up, added)
    return best


def assign_types(table: list[TensorSensitivity], budget: int) -> dict[str, T]:
    """Per-tensor types whose total bytes stay within `budget`, the predicted damage reduced greedily."""
    types = {t.name: t.candidates[0] for t in table}
    room = budget - total_bytes(table, types)
    while (step := best_upgrade(table, types, room)) is not None:
        _, name, qtype, added = step
        types[name] = qtype
        room -= added
    return types


def raise_types(table: list[TensorSensitivity], types: dict[str, T], count: int, room: int) -> dict[str, tuple[T, T]]:
    """One fallback step: up to `count` tensors with the largest predicted damage at their current
    type, each moved to its next candidate type, while the added bytes fit in `room`.
    Returns {name: (old type, new type)} (empty: nothing can be raised within the room)."""
    raised = {}
    for t in sorted(table, key=lambda t: t.damage(types[t.name]), reverse=True):
        cands = t.candidates
        position = cands.index(types[t.name]) if types[t.name] in cands else len(cands)
        if position + 1 >= len(cands):
            continue
        new = cands[position + 1]
        added = nbytes(t.shape, new) - nbytes(t.shape, types[t.name])
        if added > room:
            continue
        raised[t.name] = (types[t.name], new)
        room -= added
        if len(raised) == count:
            break
    return raised


def override_lines(types: dict[str, T]) -> list[str]:
    """llama-quantize --tensor-type-file lines (anchored regex = type) naming every tensor."""
    return [f"^{re.escape(name)}$={qtype.name.lower()}" for name, qtype in sorted(types.items())]
