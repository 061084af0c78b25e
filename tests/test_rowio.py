"""quantkit.rowio: row ranges of arrays on disk through plain file I/O."""

from __future__ import annotations

import numpy as np
import pytest

from quantkit.rowio import RowFile, row_runs


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
