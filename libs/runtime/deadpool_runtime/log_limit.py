"""Refusal logs, rate-limited: a flood of bad input must not become a flood of log lines.

Every refusal (a connection over the limit, a frame or a message that fails validation) is worth a
line, until a peer sends thousands a second: a connection flood once wrote 9,000 lines in 30 s. A
`RefusalLog` writes at most `lines_max` lines per key (by default, the line's event) in a period of
`period_s`; past that it counts, and when the period ends it writes one line saying how many more
were suppressed. Memory is bounded (`keys_max` keys; past them, new keys share one), and periods are
measured on the monotonic clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "REFUSAL_KEYS_MAX",
    "REFUSAL_LINES_PER_PERIOD",
    "REFUSAL_PERIOD_S",
    "RefusalLog",
]

REFUSAL_LINES_PER_PERIOD = 10
"""Refusal lines written per key in one period; the rest are counted."""
REFUSAL_PERIOD_S = 10.0
REFUSAL_KEYS_MAX = 256
"""Keys followed at once; refusals under any further key share the key `OVERFLOW_KEY`."""
OVERFLOW_KEY = "(other refusals)"


@dataclass
class _Window:
    event: str
    """The first line's event, named by the summary."""
    ends_at: float
    lines: int = 0
    suppressed: int = 0
    timer: asyncio.TimerHandle | None = None


class RefusalLog:
    """Writes refusal lines to `log` (a structlog logger), at most `lines_max` per key per `period_s`,
    then one summary line per period: "N more refusals suppressed"."""

    def __init__(
        self,
        log: Any,
        lines_max: int = REFUSAL_LINES_PER_PERIOD,
        period_s: float = REFUSAL_PERIOD_S,
        keys_max: int = REFUSAL_KEYS_MAX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lines_max < 1 or period_s <= 0 or keys_max < 1:
            raise ValueError("lines_max and keys_max must be at least 1, period_s positive")
        self.log = log
        self.lines_max = lines_max
        self.period_s = period_s
        self.keys_max = keys_max
        self.clock = clock
        self._windows: dict[str, _Window] = {}
        self.suppressed = 0
        """Lines suppressed so far, in all."""

    def warning(self, event: str, key: str = "", **fields: Any) -> bool:
        """Log a refusal at warning level unless its key (default: `event`) has had its lines this
        period; True if it was written."""
        return self._write(self.log.warning, event, key, fields)

    def info(self, event: str, key: str = "", **fields: Any) -> bool:
        """As `warning`, at info level (a refusal that is no fault of ours, such as a peer going away)."""
        return self._write(self.log.info, event, key, fields)

    def flush(self) -> None:
        """Write the summary of every period with lines suppressed, and forget every key (a stop)."""
        for key in list(self._windows):
            self._end(key)

    def _write(self, write: Callable[..., Any], event: str, key: str, fields: dict[str, Any]) -> bool:
        now = self.clock()
        key, window = self._window(key or event, event, now)
        if window.lines < self.lines_max:
            window.lines += 1
            write(event, **fields)
            return True
        window.suppressed += 1
        self.suppressed += 1
        if window.timer is None:
            window.timer = _call_later(window.ends_at - now, self._end, key)
        return False

    def _window(self, key: str, event: str, now: float) -> tuple[str, _Window]:
        """The key's current period (a new one if its last has ended, which is summed up first), and the
        key it is counted under (`OVERFLOW_KEY` once `keys_max` keys are followed)."""
        window = self._windows.get(key)
        if window is not None and now >= window.ends_at:
            self._end(key)
            window = None
        if window is None:
            if len(self._windows) >= self.keys_max:
                for ended in [k for k, w in self._windows.items() if now >= w.ends_at]:
                    self._end(ended)
            if len(self._windows) >= self.keys_max and key != OVERFLOW_KEY:
                return self._window(OVERFLOW_KEY, event, now)
            window = self._windows[key] = _Window(event, now + self.period_s)
        return key, window

    def _end(self, key: str) -> None:
        """The key's period is over: say how many lines it suppressed, if any, and forget it."""
        window = self._windows.pop(key, None)
        if window is None:
            return
        if window.timer is not None:
            window.timer.cancel()
        if window.suppressed:
            self.log.warning(
                f"{window.suppressed} more refusals suppressed",
                refusal=window.event,
                key=key,
                suppressed=window.suppressed,
                period_s=self.period_s,
            )


def _call_later(delay_s: float, callback: Callable[[str], None], key: str) -> asyncio.TimerHandle | None:
    """`callback(key)` after `delay_s` on the running event loop; None outside one (then the summary
    comes with the key's next line, or `flush`)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return loop.call_later(max(0.0, delay_s), callback, key)
