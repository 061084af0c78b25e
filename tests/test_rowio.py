"""quantkit.io.rowio: row ranges of arrays on disk through plain file I/O."""

from __future__ import annotations

import numpy as np
import pytest

from quantkit.io.rowio import RowFile, row_runs


def test_row_runs_groups_consecutive_rows():
    assert row_runs(np.array([2, 3, 4, 9, 11, 12])) == [(0, 2, 3), (3, 9, 1), (4, 11, 2)]
    assert row_runs(np.array([], dtype=np.int64)) == []


def test_rows_and_column_blocks_round_trip(tmp_path):
    values = np.arange(7 * 5, dtype=np.float32).reshape(7, 5)
    rows = RowFile((7, 5), np.float32, tmp_path)
    rows[0:4] = values[0:4]
    rows.write_columns(4, 0, values[4:, :2])
    rows.write_columns(4, 2, values[4:, 2:])
    assert np.array_equal(rows[0:7], values) and np.array_equal(rows[3:5], values[3:5])
    assert rows[6:6].shape == (0, 5) and len(rows) == 7
    assert not list(tmp_path.iterdir())  # unlinked from the start


def test_strided_ranges_are_refused(tmp_path):
    with pytest.raises(ValueError, match="contiguous"):
        RowFile((4, 2), np.float16, tmp_path)[0:4:2]


def resident_file_mib() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("RssFile:")) // 1024


def test_page_out_keeps_contents_and_drops_a_mapped_files_pages(tmp_path):
    """Anonymous memory keeps its bytes; a memory-mapped file's clean pages leave the RSS and read back the same."""
    import numpy as np

    from quantkit.io.rowio import page_out

    anonymous = np.arange(4 << 20, dtype=np.int32)
    expected = anonymous.copy()
    page_out(anonymous.ctypes.data, anonymous.nbytes)
    assert np.array_equal(anonymous, expected)

    path = tmp_path / "data.bin"
    np.arange(16 << 20, dtype=np.int32).tofile(path)  # 64 MiB
    mapped = np.memmap(path, dtype=np.int32, mode="r")
    total = int(mapped.sum(dtype=np.int64))  # every page read: resident
    before = resident_file_mib()
    if not page_out(mapped.ctypes.data, mapped.nbytes):
        pytest.skip("the kernel does not take MADV_PAGEOUT")
    assert before - resident_file_mib() >= 32
    assert int(mapped.sum(dtype=np.int64)) == total
