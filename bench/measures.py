"""Small measuring helpers the benchmarks share (imported as a sibling module: run them from bench/)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cpu_seconds", "memcpy_ms_per_mb", "memcpy_scaling", "percentile", "pin_process"]


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q`th percentile of `values` (NaN for none)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin_process(pid: int, cpus: set[int]) -> None:
    """Confine every thread of process `pid` to `cpus` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            continue  # the thread ended meanwhile


def memcpy_ms_per_mb(nbytes: int = 64 * 1024 * 1024, repeats: int = 5) -> float:
    """One thread's plain memory copy on this machine, now: the best of `repeats` copies of `nbytes`
    (pages touched first), in ms per MB (10^6 bytes)."""
    import time

    src = bytearray(os.urandom(1024)) * (nbytes // 1024)
    dst = bytearray(len(src))
    view_src, view_dst = memoryview(src), memoryview(dst)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        view_dst[:] = view_src
        best = min(best, time.perf_counter() - started)
    return 1000 * best / (len(src) / 1e6)


def memcpy_scaling(threads: int = 2, nbytes: int = 256 * 1024 * 1024, repeats: int = 4) -> float:
    """How many times one thread's copy rate `threads` threads reach together, each copying its own
    `nbytes` `repeats` times (a memcpy releases the GIL): 1.0 where memory, not cores, bounds a copy."""
    import threading
    import time

    pairs = [(bytearray(nbytes), bytearray(os.urandom(1024)) * (nbytes // 1024)) for _ in range(threads)]

    def copy(index: int) -> None:
        dst, src = pairs[index]
        for _ in range(repeats):
            memoryview(dst)[:] = memoryview(src)

    copy(0)  # every page touched before timing
    started = time.perf_counter()
    copy(0)
    one = time.perf_counter() - started
    workers = [threading.Thread(target=copy, args=(i,)) for i in range(threads)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    together = time.perf_counter() - started
    return threads * one / together
