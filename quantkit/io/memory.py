"""Memory of a run: wall time and peak resident memory of a phase (sampled in a background thread),
glibc's heap handed back to the OS (freed pages trimmed, large allocations mapped on their own), and
Python's collector kept off the objects that outlive a phase."""

from __future__ import annotations

import gc
import threading
import time
from contextlib import contextmanager
from typing import Iterator


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


LARGE_ALLOCATION = 16 * 1024 * 1024  # C-heap blocks at least this big get a memory map of their own


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number for it


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim; nothing elsewhere).

    Without it the RSS grew by about half a layer per layer: once glibc's dynamic mmap threshold has
    risen, freed weights stay in the heap (and the torch threads' arenas) in fragments the next
    layer's allocations do not fill (measured: +15 MiB per layer on a 24-layer model, flat with it)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except AttributeError:  # not glibc
        return
    trim(0)


def map_large_allocations() -> None:
    """Serve each C-heap allocation of LARGE_ALLOCATION bytes or more with a memory map of its own,
    returned to the OS when freed (glibc's mallopt M_MMAP_THRESHOLD; nothing elsewhere). Process-wide
    and lasting: called where llm-compressor starts calibrating.

    glibc's default threshold starts at 128 KiB and rises to the size of each mapped block freed, up
    to 32 MiB, after which the 16-32 MiB tensors of GPTQ (a 2048-wide Hessian, a layer's weights read
    for a forward, block products) come from the heap and leave it fragmented. Measured with
    scripts/bench_memory.py's 1B model, gptq with --offload-dir: peak RSS 1188 -> 1130 MiB, the
    quantize step 184 -> 181 s. A 1 MiB threshold lowered the peak further but ran 33% slower (a
    mapped block's pages are zeroed on first touch, for every small temporary)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:  # not glibc
        return
    mallopt(M_MMAP_THRESHOLD, LARGE_ALLOCATION)


@contextmanager
def collector_skips_existing_objects() -> Iterator[None]:
    """Inside, Python's cyclic garbage collector ignores every object that existed on entry (gc.freeze);
    on exit it sees them again (gc.unfreeze). Memory is still freed by reference counting; only cycles
    among the frozen objects wait for the exit.

    An engine that calls gc.collect() per layer then pays for the objects made since, not for the
    several million objects of the imported libraries and the loaded model: auto-round collects about
    seven times per decoder layer, 0.36 s each on a 2-core machine, which was 13% of an autoround run
    at 20 iterations per layer (width 576, 6 layers: quantize step 81.8 -> 71.3 s, the same bytes)."""
    gc.collect()  # what is garbage now is collected once, not held until the exit
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
