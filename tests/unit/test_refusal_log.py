"""Refusal logs are rate-limited: a flood writes a few lines per period and one count of the rest."""

from __future__ import annotations

import asyncio
from typing import Any

from deadpool_runtime.log_limit import OVERFLOW_KEY, RefusalLog


class Lines:
    """A logger that keeps what it is given (the services' is structlog, with the same call shape)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []
        self.summary_written = asyncio.Event()

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))
        if "suppressed" in fields:
            self.summary_written.set()

    info = warning

    def events(self) -> list[str]:
        return [event for event, _ in self.lines]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_writes_a_few_lines_per_period_then_how_many_were_suppressed() -> None:
    log, clock = Lines(), Clock()
    refusals = RefusalLog(log, lines_max=3, period_s=10.0, clock=clock)
    written = [refusals.warning("data plane connection dropped", peer=f"p{i}") for i in range(1000)]
    assert written == [True] * 3 + [False] * 997
    assert log.events() == ["data plane connection dropped"] * 3
    clock.now += 10.0  # the period ends: the next refusal first says how many were suppressed
    assert refusals.warning("data plane connection dropped", peer="late")
    summary, fields = log.lines[3]
    assert summary == "997 more refusals suppressed"
    assert fields["refusal"] == "data plane connection dropped" and fields["suppressed"] == 997
    assert log.lines[4][0] == "data plane connection dropped"
    assert refusals.suppressed == 997


def test_each_key_has_its_own_lines_and_memory_stays_bounded() -> None:
    log, clock = Lines(), Clock()
    refusals = RefusalLog(log, lines_max=2, period_s=10.0, keys_max=4, clock=clock)
    for _ in range(5):
        refusals.warning("rejected message", subject="a")
        refusals.warning("heartbeat refused")
    assert log.events() == ["rejected message", "heartbeat refused"] * 2
    for i in range(10_000):  # made-up keys: they share one once keys_max are followed
        refusals.warning("heartbeat refused", key=f"member-{i}")
    assert len(refusals._windows) <= 5
    assert OVERFLOW_KEY in refusals._windows
    assert len(log.lines) == 4 + 2 + 2  # two new keys fit, then the overflow key's two lines
    refusals.flush()
    summaries = [fields for event, fields in log.lines if event.endswith("more refusals suppressed")]
    assert sum(f["suppressed"] for f in summaries) == 3 + 3 + (10_000 - 2 - 2)  # all but the lines written
    assert refusals._windows == {}


async def test_the_summary_comes_when_the_period_ends_even_if_the_flood_stopped() -> None:
    log = Lines()
    refusals = RefusalLog(log, lines_max=1, period_s=0.05)
    for _ in range(50):
        refusals.warning("data plane connection refused")
    await asyncio.wait_for(log.summary_written.wait(), 5.0)
    assert log.events() == ["data plane connection refused", "49 more refusals suppressed"]
