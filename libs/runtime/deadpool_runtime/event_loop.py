"""An event loop that waits for I/O at most once per `io_wait_min_s`, so a stream of small messages is
read in chunks, not one wake-up each.

At 16,384 members a detector takes 8,200 launcher batches a second, one NATS message each, arriving
one at a time. With nothing else to run, asyncio's loop woke for each: the poll, the socket's read,
the stream reader, the NATS client's read loop and its subscription's task, every one of them per
message. A loop that, when idle, first lets `io_wait_min_s` pass since it last woke for I/O finds
several messages waiting and reads them with one `recv`; the client parses them in one pass and its
subscription's task takes them in one run. A message is read at most `io_wait_min_s` later than it
would have been (5 ms, against a heartbeat timeout of a second or more); a timer still fires on time,
and a loop with a callback ready polls without waiting, as asyncio's own does. An idle loop is not
held at all: the pause counts from its last wake-up.

At 16,384 members (`bench/detector_scale.py`, the same code with `--io-wait-min-s 0` and 0.005, runs
interleaved) the detector took a median of 56.3 % of a core on asyncio's own loop (7 runs) and 47.9 %
on this one (5 runs); docs/performance.md §5.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable
from typing import Any

__all__ = ["IO_WAIT_MAX_S", "IO_WAIT_MIN_S", "CoalescingSelector", "coalescing_loop"]

IO_WAIT_MIN_S = 0.005
"""The detector's default: at most 200 waits for I/O a second."""
IO_WAIT_MAX_S = 0.05
"""The most that may be asked for: every message may be read this late, and a verdict may come 150 ms
after a 1 s heartbeat timeout (issue 26's goal), of which a tenth of a second would take most."""


class CoalescingSelector(selectors.DefaultSelector):  # epoll on Linux
    """A selector whose waits begin no sooner than `wait_min_s` after the last one ended."""

    def __init__(
        self,
        wait_min_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__()
        self.wait_min_s = wait_min_s
        self._clock, self._sleep = clock, sleep
        self._woke = float("-inf")

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None or timeout > 0:  # the loop has nothing to run before I/O or a timer
            early = self._woke + self.wait_min_s - self._clock()
            if early > 0:
                pause = early if timeout is None else min(early, timeout)
                self._sleep(pause)  # let the socket fill; a timer still fires on time
                timeout = None if timeout is None else max(0.0, timeout - pause)
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(timeout)
        self._woke = self._clock()
        return ready


def coalescing_loop(io_wait_min_s: float = IO_WAIT_MIN_S) -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory of loops that wait for I/O at most once per `io_wait_min_s` (asyncio's own loop where
    it is 0); ValueError outside 0 to `IO_WAIT_MAX_S`."""
    if not 0 <= io_wait_min_s <= IO_WAIT_MAX_S:
        raise ValueError(f"io_wait_min_s {io_wait_min_s} is not within 0 to {IO_WAIT_MAX_S} s")
    if io_wait_min_s == 0:
        return asyncio.new_event_loop

    def new_loop() -> asyncio.AbstractEventLoop:
        selector: Any = CoalescingSelector(io_wait_min_s)
        return asyncio.SelectorEventLoop(selector)

    return new_loop
