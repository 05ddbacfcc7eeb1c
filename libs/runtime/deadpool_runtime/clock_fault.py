"""A wall clock that steps, for the chaos benchmark's `clock_step` fault.

With `DEADPOOL_CLOCK_STEP_FILE` set (only the benchmark sets it), every DeadPool process adds the
number of seconds that file holds to `time.time()`, read again at most every `REREAD_S`: the chaos
benchmark writes +3600 and then -3600 into it, and every Python caller of `time.time()` in every
process sees its wall clock step an hour forward, then back. Timers run on the monotonic clock and
must not notice (no false verdict, no delayed one); only the stamps reported to humans move.

Why not libfaketime: Debian's 0.9.10 fails Python's `time.sleep` (EINVAL from `clock_nanosleep`)
unless it also shifts the monotonic clock, which is what this fault must leave alone.
"""

from __future__ import annotations

import os
import time

__all__ = ["CLOCK_STEP_FILE_ENV", "install_from_env"]

CLOCK_STEP_FILE_ENV = "DEADPOOL_CLOCK_STEP_FILE"
REREAD_S = 0.1


def install_from_env() -> None:
    """Step this process's `time.time()` by the file's offset, if the variable names one."""
    path = os.environ.get(CLOCK_STEP_FILE_ENV, "")
    if not path or getattr(time.time, "_deadpool_stepped", False):
        return
    real_time, real_monotonic = time.time, time.monotonic
    cached = [0.0, -REREAD_S]  # offset, when it was read (monotonic)

    def offset() -> float:
        now = real_monotonic()
        if now - cached[1] >= REREAD_S:
            try:
                with open(path) as f:
                    cached[0] = float(f.read().strip() or 0.0)
            except (OSError, ValueError):
                cached[0] = 0.0
            cached[1] = now
        return cached[0]

    def stepped_time() -> float:
        return real_time() + offset()

    def stepped_time_ns() -> int:
        return int(stepped_time() * 1e9)

    stepped_time._deadpool_stepped = True  # type: ignore[attr-defined]
    time.time = stepped_time
    time.time_ns = stepped_time_ns
