"""Reads overlapped with work: the next read runs in a background thread while the caller works on the
current result (a plain read and torch's kernels release the GIL, so a disk read and a GPU's or a
CPU's work proceed together). At most one result is read ahead, so memory holds two at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def read_ahead(reads: Iterable[Callable[[], T]]) -> Iterator[T]:
    """The results of `reads`, in order; while the caller holds one, the next is being read. An error
    in a read is raised where its result would have been given."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantkit-read-ahead") as pool:
        pending = None
        for read in reads:
            future = pool.submit(read)
            if pending is not None:
                yield pending.result()
            pending = future
        if pending is not None:
            yield pending.result()
