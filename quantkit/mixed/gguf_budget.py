"""Per-tensor GGUF types under a size budget, from a sensitivity table (quantkit.mixed.gguf).

`assign_types`: quantkit.mixed.core.assign (greedy marginal-gain knapsack) with the GGUF byte sizes.
The size of a tensor is its data padded to the file's alignment (32 bytes, gguf-py's writer and
llama.cpp's default), so the tensors' total is exactly what they take in the file: a budget of the
mixture's total gives a file no larger than the mixture's (the metadata is the same).

The result is an ordinary per-tensor type map. `override_lines` writes it as llama-quantize
`--tensor-type-file` lines: one anchored regex per quantized tensor. llama-quantize matches each
pattern with std::regex_search on the tensor name (so `attn_v` alone would match every layer and
`output.weight` would match `attn_output.weight`), and a tensor matched by a pattern skips the
mixture rules entirely; every quantized tensor is named, so the mixture's attn_v / ffn_down
counters never matter and the file reproduces the types exactly.
"""

from __future__ import annotations

import re

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT

from quantkit.mixed import core as mixed
from quantkit.gguf.mixture import T
from quantkit.mixed.core import SensitivityRow


def nbytes(shape: tuple[int, ...], qtype: T) -> int:
    """A tensor's data at `qtype`, padded to the file's alignment."""
    block, size = GGML_QUANT_SIZES[qtype]
    count = 1
    for d in shape:
        count *= d
    data = count // block * size
    return (data + GGUF_DEFAULT_ALIGNMENT - 1) // GGUF_DEFAULT_ALIGNMENT * GGUF_DEFAULT_ALIGNMENT


def tensor_size(row: SensitivityRow, qtype: str) -> int:
    """The size model of quantkit.mixed.core: a tensor's bytes in the file at a type (by name)."""
    return nbytes(row.shape, T[qtype])


def total_bytes(table: list[SensitivityRow], types: dict[str, T]) -> int:
    return mixed.total_bytes(table, {name: t.name for name, t in types.items()}, tensor_size)


def mixture_types(table: list[SensitivityRow]) -> dict[str, T]:
    return {t.name: T[t.plain] for t in table}


def cheapest_bytes(table: list[SensitivityRow]) -> int:
    return mixed.cheapest_bytes(table, tensor_size)


def assign_types(table: list[SensitivityRow], budget: int) -> dict[str, T]:
    """Per-tensor types whose total bytes stay within `budget`, the predicted damage reduced greedily
    (quantkit.mixed.core.assign; BudgetError when the cheapest types exceed it)."""
    return {name: T[c] for name, c in mixed.assign(table, budget, tensor_size).items()}


def override_lines(types: dict[str, T]) -> list[str]:
    """llama-quantize --tensor-type-file lines (anchored regex = type) naming every tensor."""
    return [f"^{re.escape(name)}$={qtype.name.lower()}" for name, qtype in sorted(types.items())]
