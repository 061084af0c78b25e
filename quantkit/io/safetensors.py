"""The one safetensors reader: headers checked before any weight is read, tensors and rows of
tensors read with plain file reads (no memory map), the dtype table.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import ModelError

MAX_HEADER_BYTES = 100 * 1024 * 1024


DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def read_safetensors_header(file: Path) -> dict[str, tuple[str, list[int]]]:
    """Parse and check one safetensors header: JSON valid, offsets consistent with the file size."""
    header, data_start = safetensors_layout(file)
    return _check_tensor_entries(file, header, file.stat().st_size - data_start)


def safetensors_layout(file: Path) -> tuple[dict, int]:
    """(raw header JSON, byte offset where the tensor data starts) of a safetensors file."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ModelError(f"{file.name} is truncated (no safetensors header)",
                             hint="the file is damaged or incomplete: download or save the checkpoint again")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise ModelError(f"{file.name} is corrupt or truncated (header length {header_len} > file size)",
                             hint="the file is damaged or incomplete: download or save the checkpoint again")
        try:
            header = json.loads(fh.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelError(f"{file.name} has a corrupt safetensors header",
                             hint="the file is damaged: download or save the checkpoint again") from exc
    if not isinstance(header, dict):
        raise ModelError(f"{file.name} has a corrupt safetensors header (not a JSON object)",
                         hint="the file is damaged: download or save the checkpoint again")
    return header, 8 + header_len


def _check_tensor_entries(file: Path, header: dict, data_size: int) -> dict[str, tuple[str, list[int]]]:
    """Every entry well formed, sized as its dtype and shape say, and the entries tiling the data
    exactly (what the safetensors library itself insists on when loading)."""
    tensors = {}
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, stop = _tensor_entry(file, name, entry)
        count = 1
        for d in shape:
            count *= d
        if stop - begin != count * DTYPE_BYTES[dtype]:
            raise ModelError(f"{file.name}: tensor {name} has inconsistent size "
                             f"({dtype} {shape} needs {count * DTYPE_BYTES[dtype]} bytes, the header gives {stop - begin})",
                             hint="the file is damaged: download or save the checkpoint again")
        spans.append((begin, stop, name))
        tensors[name] = (dtype, shape)
    end = _check_tiling(file, sorted(spans))
    if end > data_size:
        raise ModelError(
            f"{file.name} is truncated: the header needs {end} data bytes, the file has {data_size}",
            hint="re-copy or re-download the checkpoint",
        )
    if end < data_size:
        raise ModelError(f"{file.name} is corrupt: {data_size - end} bytes follow the last tensor the header lists",
                         hint="re-copy or re-download the checkpoint")
    return tensors


def _tensor_entry(file: Path, name: str, entry) -> tuple[str, list[int], int, int]:
    """(dtype, shape, begin, stop) of one header entry; ModelError when malformed."""
    try:
        dtype, shape, (begin, stop) = entry["dtype"], list(entry["shape"]), entry["data_offsets"]
        ok = (dtype in DTYPE_BYTES and all(_natural(v) for v in (*shape, begin, stop)) and begin <= stop)
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise ModelError(f"{file.name}: tensor {name} has a malformed safetensors header entry: {entry!r}"[:300],
                         hint="the file is corrupt; re-copy or re-download the checkpoint")
    return dtype, shape, begin, stop


def _natural(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_tiling(file: Path, spans: list[tuple[int, int, str]]) -> int:
    """Tensors must follow each other without gaps or overlaps from offset 0; returns the end."""
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            raise ModelError(f"{file.name}: tensor {name} starts at byte {begin}, expected {end} "
                             "(overlapping or gapped data offsets)", hint="the file is corrupt")
        end = stop
    return end


# safetensors dtype -> torch dtype name
TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


def safetensors_index(file: Path) -> dict[str, StoredTensor]:
    """Where each tensor of one .safetensors file lies (its header only, read by quantkit.io.checkpoint)."""
    from quantkit.io.safetensors import safetensors_layout

    header, base = safetensors_layout(file)
    return {name: StoredTensor(file, e["dtype"], tuple(e["shape"]), base + e["data_offsets"][0],
                               e["data_offsets"][1] - e["data_offsets"][0])
            for name, e in header.items() if name != "__metadata__"}


def empty_stored(entry: StoredTensor, shape: tuple[int, ...]) -> "torch.Tensor":  # noqa: F821
    import torch

    return torch.empty(shape, dtype=getattr(torch, TORCH_DTYPES[entry.dtype]))


def tensor_bytes(tensor) -> memoryview:
    """The bytes of a contiguous tensor of any dtype (bfloat16 has no numpy view of its own)."""
    import torch

    from quantkit.io.rowio import byte_view

    return byte_view(tensor.view(-1).view(torch.uint8).numpy())


def read_stored_rows(entry: StoredTensor, index) -> "torch.Tensor":  # noqa: F821
    """Rows `index` (sorted, unique) of a stored tensor along its first dimension, one plain read
    per run of consecutive rows (an embedding's rows for the ids of a batch, a slice of the head)."""
    from quantkit.io.rowio import row_runs

    out = empty_stored(entry, (len(index), *entry.shape[1:]))
    row_bytes = entry.nbytes // max(1, entry.shape[0])
    raw = tensor_bytes(out)
    read_spans(entry, [(raw[position * row_bytes : (position + count) * row_bytes], row * row_bytes)
                       for position, row, count in row_runs(index)])
    return out


def read_stored(entry: StoredTensor) -> "torch.Tensor":  # noqa: F821
    """One tensor in its stored dtype, read with a plain file read.

    Not safe_open: its memory map keeps every page it has served resident (counted in the RSS and
    growing with the checkpoint), which is what streaming is meant to avoid (see
    quantkit.gguf.convert.SafetensorsRows)."""
    tensor = empty_stored(entry, entry.shape)
    read_spans(entry, [(tensor_bytes(tensor), 0)])
    return tensor


def read_spans(entry: StoredTensor, spans: list[tuple[memoryview, int]]) -> None:
    """Fill each buffer from the tensor's data at its byte offset; ModelError when the file ends first."""
    import os

    from quantkit.io.rowio import pread_into

    fd = os.open(entry.file, os.O_RDONLY)
    try:
        for buffer, offset in spans:
            pread_into(fd, buffer, entry.offset + offset)
    except EOFError as exc:
        raise ModelError(f"{entry.file.name}: tensor data is truncated",
                         hint="the file is damaged or incomplete: download or save the checkpoint again") from exc
    finally:
        os.close(fd)
