"""Per-tensor GGUF types under a size budget, from a sensitivity table (quantkit.gguf.sensitivity).

`assign_types`: quantkit.mixed.assign (greedy marginal-gain knapsack) with the k-quant byte sizes.
`raise_types`: one fallback step, the tensors with the largest predicted damage moved to their next
candidate type.

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

from quantkit import mixed
from quantkit.gguf.mixture import T
from quantkit.gguf.sensitivity import TensorSensitivity


def nbytes(shape: tuple[int, ...], qtype: T) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    count = 1
    for d in shape:
        count *= d
    return count // block * size


def tensor_size(row: TensorSensitivity, qtype: T) -> int:
    """The size model of quantkit.mixed.assign: a tensor's bytes at a k-quant type."""
    return nbytes(row.shape, qtype)


def total_bytes(table: list[TensorSensitivity], types: dict[str, T]) -> int:
    return mixed.total_bytes(table, types, tensor_size)


def mixture_types(table: list[TensorSensitivity]) -> dict[str, T]:
    return {t.name: T[t.mixture] for t in table}


def assign_types(table: list[TensorSensitivity], budget: int) -> dict[str, T]:
    """Per-tensor types whose total bytes stay within `budget`, the predicted damage reduced greedily
    (quantkit.mixed.assign)."""
    return mixed.assign(table, budget, tensor_size)


def raise_types(table: list[TensorSensitivity], types: dict[str, T], count: int, room: int) -> dict[str, tuple[T, T]]:
    """One fallback step: up to `count` tensors with the largest predicted damage at their current
    type, each moved to its next candidate type, while the added bytes fit in `room`
    (quantkit.mixed.raise_step). Returns {name: (old type, new type)} (empty: nothing can be raised)."""
    return mixed.raise_step(table, types, count, room, tensor_size)


def override_lines(types: dict[str, T]) -> list[str]:
    """llama-quantize --tensor-type-file lines (anchored regex = type) naming every tensor."""
    return [f"^{re.escape(name)}$={qtype.name.lower()}" for name, qtype in sorted(types.items())]
