"""quantkit.io.readahead: results in order, the next read under way while the caller works, one at most."""

from __future__ import annotations

import threading
import time

import pytest

from quantkit.io.readahead import read_ahead


def test_results_come_in_order_and_the_next_is_read_meanwhile():
    started, lock, running, most = [], threading.Lock(), [0], [0]

    def read(i):
        def thunk():
            with lock:
                started.append(i)
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.01)
            with lock:
                running[0] -= 1
            return i * i
        return thunk

    got = []
    for value in read_ahead(read(i) for i in range(6)):
        time.sleep(0.02)  # the caller's work: the next read finishes meanwhile
        got.append((value, len(started)))
    assert [v for v, _ in got] == [i * i for i in range(6)]
    assert all(seen >= min(index + 2, 6) for index, (_, seen) in enumerate(got))  # one read ahead
    assert most[0] == 1  # one read at a time


def test_a_failed_read_raises_where_its_result_would_be():
    def failing():
        raise OSError("disk gone")

    results = read_ahead([lambda: 1, failing, lambda: 3])
    assert next(results) == 1
    with pytest.raises(OSError, match="disk gone"):
        next(results)
    assert list(read_ahead([])) == []
