"""The detector's event loop waits for I/O at most once per `io_wait_min_s`, and never past a timer."""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import socket
from collections.abc import Iterator

import pytest

from deadpool_detector import DetectorServiceConfig
from deadpool_runtime.event_loop import BUSY_SHARE_MIN, CoalescingSelector, coalescing_loop

pytestmark = pytest.mark.unit


class Clock:
    """A clock that moves only when the selector sleeps (and when a test moves it)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@contextlib.contextmanager
def watching_readable() -> Iterator[tuple[CoalescingSelector, Clock]]:
    """A selector (a 5 ms pause) on the test's clock, watching a socket that is readable: a wait for
    I/O returns at once, so only the selector's own pause counts. It has woken once."""
    clock = Clock()
    a, b = socket.socketpair()
    b.send(b"x")
    with a, b, CoalescingSelector(0.005, clock, clock.sleep) as selector:
        selector.register(a, selectors.EVENT_READ)
        assert len(selector.select(None)) == 1
        assert clock.sleeps == []  # the first wait: nothing to wait for
        yield selector, clock


def test_a_wait_soon_after_the_last_one_first_lets_the_rest_of_the_interval_pass() -> None:
    with watching_readable() as (selector, clock):
        clock.now += 0.001
        assert len(selector.select(None)) == 1
        assert clock.sleeps == [pytest.approx(0.004)]  # the rest of the 5 ms since it last woke
        clock.now += 0.010
        assert len(selector.select(1.0)) == 1
        assert clock.sleeps == [pytest.approx(0.004)]  # woke long enough ago: no pause


def test_a_ready_callback_or_a_nearer_timer_is_never_held_back() -> None:
    with watching_readable() as (selector, clock):
        clock.now += 0.0005  # callbacks ran: the loop is busy
        selector.select(0)  # a callback is ready: the loop polls and must not wait
        assert clock.sleeps == []
        selector.select(0.002)  # a timer is due in 2 ms: the pause ends with it
        assert clock.sleeps == [pytest.approx(0.002)]


def test_a_loop_mostly_waiting_is_not_held_between_replies() -> None:
    with watching_readable() as (selector, clock):
        selector.note(0.0, 1.0)  # it waited a second for I/O
        for _ in range(5):  # then a chain of replies, each taking a tenth of a millisecond to handle
            clock.now += 0.0001
            selector.select(None)
        assert clock.sleeps == [] and selector.busy_share < BUSY_SHARE_MIN
        for _ in range(3):  # then a stream: it runs callbacks nearly all the time
            clock.now += 0.5
            selector.select(None)
        assert selector.busy_share >= BUSY_SHARE_MIN and len(clock.sleeps) == 0
        clock.now += 0.001
        selector.select(None)
        assert clock.sleeps == [pytest.approx(0.004)]


@pytest.mark.parametrize("wait_s", [-0.001, 0.051, 5.0])
def test_a_wait_out_of_bounds_is_refused_where_the_detector_is_configured(wait_s: float) -> None:
    with pytest.raises(ValueError, match="io_wait_min_s"):
        coalescing_loop(wait_s)
    with pytest.raises(ValueError, match="io_wait_min_s"):
        DetectorServiceConfig("nats://127.0.0.1:4222", io_wait_min_s=wait_s)


def test_a_loop_on_it_runs_asyncio_code_and_zero_gives_asyncio_s_own() -> None:
    assert coalescing_loop(0) is asyncio.new_event_loop

    async def echo() -> bytes:
        reader, writer = await asyncio.open_connection(sock=a)
        b.send(b"ping")
        data = await reader.readexactly(4)
        writer.close()
        return data

    a, b = socket.socketpair()
    with b, asyncio.Runner(loop_factory=coalescing_loop(0.001)) as runner:
        assert isinstance(runner.get_loop(), asyncio.SelectorEventLoop)
        assert runner.run(echo()) == b"ping"
