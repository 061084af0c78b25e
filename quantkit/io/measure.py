"""Wall time and peak resident memory of a phase, sampled in a background thread."""

from __future__ import annotations

import threading
import time


def current_rss() -> int:
    """Resident set size of this process in bytes (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")


class PeakTracker:
    """`with PeakTracker() as t: ...` then t.seconds and t.peak_rss (bytes)."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.peak_rss = 0
        self.seconds = 0.0
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak_rss = max(self.peak_rss, current_rss())

    def __enter__(self) -> "PeakTracker":
        self.peak_rss = current_rss()
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_rss = max(self.peak_rss, current_rss())
        self.seconds = round(time.perf_counter() - self._start, 3)
