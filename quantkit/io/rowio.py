"""Rows of arrays on disk, read and written with plain file I/O (pread / pwrite).

Not memory maps: every page of a mapping that is written or read stays resident and counts in
the process's RSS while the mapping lives, so a memory-mapped array costs as much RSS as an array
in memory once it has been filled and read back. Plain I/O keeps only the rows being used.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages now (their contents are kept)


def page_out(address: int, length: int) -> bool:
    """Hand the whole pages of [address, address + length) back to the kernel. Clean pages of a
    memory-mapped file (a checkpoint tensor read to be copied) leave the RSS at once and are read
    again if touched; anonymous pages stay where there is no swap. Nothing is lost either way. A
    hint: other systems and older kernels refuse it, which changes nothing. Whether it was taken."""
    start = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (address + length) // mmap.PAGESIZE * mmap.PAGESIZE
    if sys.platform != "linux" or end <= start:
        return False
    return ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_PAGEOUT) == 0


def pread_into(fd: int, buffer: memoryview, offset: int) -> None:
    """Fill `buffer` from the file at `offset`; EOFError when the file ends first."""
    done = 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n == 0:
            raise EOFError(f"file ends {len(buffer) - done} bytes short")
        done += n


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def byte_view(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, writable when the array is (empty arrays included)."""
    return memoryview(array.reshape(-1).view(np.uint8))


def row_runs(index: np.ndarray) -> list[tuple[int, int, int]]:
    """(position in index, first row, count) of each run of consecutive rows in a sorted index."""
    index = np.asarray(index, dtype=np.int64)
    if index.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(index) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [index.size]])
    return [(int(s), int(index[s]), int(e - s)) for s, e in zip(starts, ends)]


class RowFile:
    """A (rows, cols) array of one dtype in an unlinked temporary file (in `workdir`, else the
    system's temporary directory), freed when the object is.

    Written by row ranges (`rows[a:b] = values`) or by blocks of columns (`write_columns`), read
    by row ranges (`rows[a:b]`, a new array)."""

    def __init__(self, shape: tuple[int, int], dtype, workdir: Path | None = None, prefix: str = "quantkit-"):
        self.shape = (int(shape[0]), int(shape[1]))
        self.dtype = np.dtype(dtype)
        self.row_bytes = self.shape[1] * self.dtype.itemsize
        self.file = tempfile.TemporaryFile(prefix=prefix, dir=workdir)
        self.file.truncate(self.shape[0] * self.row_bytes)

    def __len__(self) -> int:
        return self.shape[0]

    def _range(self, rows: slice) -> tuple[int, int]:
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("RowFile reads and writes contiguous row ranges only")
        return start, max(start, stop)

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop = self._range(rows)
        out = np.empty((stop - start, self.shape[1]), self.dtype)
        pread_into(self.file.fileno(), byte_view(out), start * self.row_bytes)
        return out

    def __setitem__(self, rows: slice, values: np.ndarray) -> None:
        start, stop = self._range(rows)
        values = np.ascontiguousarray(values, dtype=self.dtype).reshape(stop - start, self.shape[1])
        pwrite_all(self.file.fileno(), byte_view(values), start * self.row_bytes)

    def write_columns(self, row_start: int, col_start: int, block: np.ndarray) -> None:
        """Write a (n, k) block at rows row_start.., columns col_start.. (one write per row)."""
        block = np.ascontiguousarray(block, dtype=self.dtype)
        offset = row_start * self.row_bytes + col_start * self.dtype.itemsize
        for i, row in enumerate(block):
            pwrite_all(self.file.fileno(), byte_view(row), offset + i * self.row_bytes)
