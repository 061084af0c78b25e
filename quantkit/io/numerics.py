"""Streamed checks of the input weight values: no NaN or Inf anywhere, before any long work.

Reads each safetensors file with plain reads, one bounded chunk of one tensor at a time, so the
whole model is never in memory (a memory map would keep every page it touched resident: the
whole checkpoint, counted in the process's RSS). A float is non-finite exactly when all its exponent
bits are set, so one bit mask per dtype covers float32/16, bfloat16 and both FP8 kinds
(E4M3 has no Inf; its NaN is the all-ones exponent and mantissa, hence the wider mask).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from quantkit.errors import ModelError
from quantkit.io.safetensors import read_safetensors_header, safetensors_layout

# safetensors dtype -> (unsigned integer view, mask whose bits are all set for NaN/Inf)
NONFINITE_MASKS = {
    "F64": ("<u8", 0x7FF0000000000000),
    "F32": ("<u4", 0x7F800000),
    "F16": ("<u2", 0x7C00),
    "BF16": ("<u2", 0x7F80),
    "F8_E5M2": ("u1", 0x7C),
    "F8_E4M3": ("u1", 0x7F),
}
CHUNK_ELEMENTS = 1 << 24  # bounded temporaries: 16M elements per step


def check_finite(files: list[Path]) -> None:
    """ModelError naming the first tensor (and its file) that holds a NaN or Inf."""
    for file in files:
        for name, count in nonfinite_tensors(file):
            raise ModelError(f"{file.name}: tensor {name} holds {count} NaN/Inf value(s) ({file})",
                             hint="the checkpoint is damaged or was saved after a diverged training step")


def nonfinite_tensors(file: Path):
    """Yield (tensor name, number of NaN/Inf values) for each float tensor that has any."""
    read_safetensors_header(file)  # offsets checked against the file before slicing by them
    header, data_start = safetensors_layout(file)
    entries = sorted((e["data_offsets"][0], n, e) for n, e in header.items() if n != "__metadata__")
    if not entries:
        return
    with open(file, "rb") as fh:
        for begin, name, entry in entries:
            if entry["dtype"] not in NONFINITE_MASKS:
                continue
            view, mask = NONFINITE_MASKS[entry["dtype"]]
            count = count_nonfinite(fh, data_start + begin, data_start + entry["data_offsets"][1], view, mask)
            if count:
                yield name, count


def count_nonfinite(fh, begin: int, end: int, view: str, mask: int) -> int:
    """How many values in bytes [begin, end) of the file have every bit of `mask` set (a NaN or
    Inf for the dtype's mask), read CHUNK_ELEMENTS at a time."""
    dtype = np.dtype(view)
    mask = dtype.type(mask)
    step = CHUNK_ELEMENTS * dtype.itemsize
    total = 0
    for start in range(begin, end, step):
        fh.seek(start)
        chunk = np.frombuffer(fh.read(min(step, end - start)), dtype=dtype)
        total += int(np.count_nonzero((chunk & mask) == mask))
    return total
