"""An event loop that waits for I/O at most once per `io_wait_min_s`, so a stream of small messages is
read in chunks, not one wake-up each.

At 16,384 members a detector takes 8,200 launcher batches a second, one NATS message each, arriving
one at a time. With nothing else to run, asyncio's loop woke for each: the poll, the socket's read,
the stream reader, the NATS client's read loop and its subscription's task, every one of them per
message. A loop that, with nothing to run, first lets `io_wait_min_s` pass since it last woke finds
several messages waiting and reads them with one `recv`; the client parses them in one pass and its
subscription's task takes them in one run. A message is read at most `io_wait_min_s` later than it
would have been (5 ms, against a heartbeat timeout of a second or more); a timer still fires on time,
and a loop with a callback ready polls without waiting, as asyncio's own does. A loop that is mostly
idle is not held at all (`BUSY_SHARE_MIN`): there a pause saves nothing and delays each reply of a
chain of requests.

At 16,384 members (`bench/detector_scale.py`, the same code with `--io-wait-min-s 0` and 0.005, runs
interleaved) the detector took a median of 56.3 % of a core on asyncio's own loop (7 runs) and 47.9 %
on this one with the pause always on (5 runs); with the pause only while busy, 46.9 and 46.3 % against
52.2 %. docs/performance.md §5.
"""

from __future__ import annotations

import asyncio
import math
import selectors
import time
from collections.abc import Callable
from typing import Any

__all__ = ["BUSY_SHARE_MIN", "BUSY_WINDOW_S", "IO_WAIT_MAX_S", "IO_WAIT_MIN_S", "CoalescingSelector", "coalescing_loop"]

IO_WAIT_MIN_S = 0.005
"""The detector's default: at most 200 waits for I/O a second."""
IO_WAIT_MAX_S = 0.05
"""The most that may be asked for: every message may be read this late, and a verdict may come 150 ms
after a 1 s heartbeat timeout (issue 26's goal), of which a tenth of a second would take most."""


BUSY_SHARE_MIN = 0.25
"""The loop pauses only while it spent at least this share of its recent time running callbacks: a
stream of messages, where a pause saves work. A mostly idle loop going through a chain of requests (a
verdict's reads and publications) would pause once per reply and gain nothing. With the pause always
on, short chaos runs swapped a frozen rank in 2.33-2.57 s, against 2.31-2.45 s without it: few
samples, within this machine's noise, but the cost is real in kind. With this rule: 2.23-2.51 s."""
BUSY_WINDOW_S = 1.0
"""The busy share's memory: time counts with weight e^(-age / this)."""


class CoalescingSelector(selectors.DefaultSelector):  # epoll on Linux
    """A selector whose waits begin no sooner than `wait_min_s` after the last one ended, while its
    loop is busy (`BUSY_SHARE_MIN`)."""

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
        self._ran = 0.0
        self._seen = 0.0
        """Seconds running callbacks, and seconds running or waiting for I/O, each decayed."""

    @property
    def busy_share(self) -> float:
        """The share of its recent time the loop spent running callbacks (0 before any)."""
        return self._ran / self._seen if self._seen > 0 else 0.0

    def note(self, ran_s: float, waited_s: float) -> None:
        """Count `ran_s` running callbacks and `waited_s` waiting for I/O (its own pauses not counted)."""
        keep = math.exp(-(ran_s + waited_s) / BUSY_WINDOW_S)
        self._ran = self._ran * keep + ran_s
        self._seen = self._seen * keep + ran_s + waited_s

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        start = self._clock()
        if self._woke > float("-inf"):
            self.note(start - self._woke, 0.0)
        if (timeout is None or timeout > 0) and self.busy_share >= BUSY_SHARE_MIN:
            early = self._woke + self.wait_min_s - start  # nothing to run before I/O or a timer
            if early > 0:
                pause = early if timeout is None else min(early, timeout)
                self._sleep(pause)  # let the socket fill; a timer still fires on time
                timeout = None if timeout is None else max(0.0, timeout - pause)
        waiting = self._clock()
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(timeout)
        self._woke = self._clock()
        self.note(0.0, self._woke - waiting)
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
