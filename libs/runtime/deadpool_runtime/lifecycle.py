"""Run an asyncio service until SIGINT or SIGTERM, then let it stop cleanly, within a bound.

A service stops within `SHUTDOWN_BUDGET_S` of the signal, whether or not NATS is reachable: its own
stop (closing subscriptions, storing its last events, giving up a lease) has the budget but the last
`CONNECTION_CLOSE_S`, and is cancelled if it takes longer; the connection is drained in what is left
if the server answers, and closed otherwise. Draining a connection whose server is gone used to raise
(the services exited with a traceback) or, once the server stopped answering, to wait for it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client

from deadpool_runtime.bus import connect
from deadpool_runtime.gc_policy import freeze_old_objects
from deadpool_runtime.logs import configure_logging, get_logger

__all__ = [
    "CONNECTION_CLOSE_S",
    "SHUTDOWN_BUDGET_S",
    "StopDeadline",
    "close_connection",
    "log_tasks",
    "run_nats_service",
    "run_service",
    "stopped_within",
]

SHUTDOWN_BUDGET_S = 3.5
"""From a stop signal to the end of a service's work (the 5 s a supervisor is promised, less the
interpreter's own exit)."""
CONNECTION_CLOSE_S = 1.0
"""The end of the budget, kept for the NATS connection: drained if its server answers, else closed."""
CANCEL_WAIT_S = 0.25
"""How long a step cancelled for running out of budget may take to unwind."""
SERVER_ANSWER_S = 0.5
"""A stopping service drains its connection only if the server answers a ping this fast (a server that
stopped answering, as in a partition, would hold the drain)."""
HARD_STOP_S = 4.5
"""A service still running this long after the signal (stuck outside the event loop, or in its
interpreter's exit) ends at once, with `HARD_STOP_EXIT_CODE`."""
HARD_STOP_EXIT_CODE = 70
"""EX_SOFTWARE: the process had to be ended; its log says so."""

ServiceBody = Callable[[Client, Any, asyncio.Event], Awaitable[None]]


@dataclass(frozen=True)
class StopDeadline:
    """The end of a stop's budget, on the monotonic clock."""

    at: float

    @classmethod
    def after(cls, budget_s: float) -> StopDeadline:
        return cls(time.monotonic() + budget_s)

    def left_s(self, keep_s: float = 0.0) -> float:
        """Seconds left, keeping `keep_s` for what comes after (never negative)."""
        return max(0.0, self.at - keep_s - time.monotonic())


def run_service(
    main: Callable[[asyncio.Event], Awaitable[None]],
    log: Any = None,
    hard_stop_s: float = 0.0,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop,
) -> None:
    """Run `main(stop)` on a loop of `loop_factory`; `stop` is set on SIGINT/SIGTERM and `main` is
    expected to return soon after.
    With `hard_stop_s`, a process still running that long after the first signal is ended at once (a
    safety net: `main` is expected to keep to its own budget). With `log`, SIGUSR1 logs where every
    asyncio task of the service is waiting (an operator's view of a service that looks stuck:
    `kill -USR1 <pid>`)."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        armed: list[threading.Timer] = []

        def on_signal(_signum: int, _frame: Any) -> None:
            # A plain handler, not the loop's: it runs even while the event loop is blocked, so the
            # hard stop is armed whatever the loop is doing.
            if hard_stop_s > 0 and not armed:
                armed.append(_end_after(hard_stop_s))
            loop.call_soon_threadsafe(stop.set)

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        if log is not None:
            loop.add_signal_handler(signal.SIGUSR1, lambda: log_tasks(log))
        try:
            await main(stop)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    with asyncio.Runner(loop_factory=loop_factory) as running:
        running.run(runner())


def _end_after(delay_s: float) -> threading.Timer:
    """End this process `delay_s` from now unless it has ended by then (a daemon thread: it holds
    nothing up, and still fires while the event loop is blocked)."""

    def end() -> None:
        line = {"event": "still running after the stop signal: ending now", "level": "error", "after_s": delay_s}
        sys.stderr.write(json.dumps(line) + "\n")
        sys.stderr.flush()
        os._exit(HARD_STOP_EXIT_CODE)

    timer = threading.Timer(delay_s, end)
    timer.daemon = True
    timer.start()
    return timer


def log_tasks(log: Any) -> None:
    """Log every asyncio task of this loop with the chain of coroutines it is waiting in."""
    for task in asyncio.all_tasks():
        where: list[str] = []
        awaited: Any = task.get_coro()
        while awaited is not None and len(where) < 24:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is not None:
                where.append(f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {frame.f_code.co_name}")
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
        log.warning("task", name=task.get_name(), stack=where)


async def stopped_within(stop: asyncio.Event, period_s: float) -> bool:
    """Wait up to `period_s` for `stop`; True if it was set. The tick of every service's periodic loop."""
    try:
        await asyncio.wait_for(stop.wait(), period_s)
    except TimeoutError:
        return False
    return True


async def close_connection(nc: Client, timeout_s: float, log: Any) -> None:
    """End `nc` within `timeout_s`: drain it (what it holds is sent, its subscriptions finish) if its
    server answers a ping within `SERVER_ANSWER_S`, else close it; closed too if the drain does not
    end in time. Never raises: the process is stopping."""
    deadline = StopDeadline.after(timeout_s)
    if nc.is_closed:
        return
    steps: list[asyncio.Future[None]] = []

    async def finished(step: Awaitable[None], within_s: float) -> bool:
        # A task, not `wait_for`: nats.py's drain swallows one cancellation and goes on to flush, so
        # `wait_for` would wait for it past the bound.
        steps.append(asyncio.ensure_future(step))
        await asyncio.wait(steps[-1:], timeout=within_s)
        return _succeeded(steps[-1])

    if nc.is_connected:
        answered = await finished(nc.flush(), min(SERVER_ANSWER_S, deadline.left_s(keep_s=CANCEL_WAIT_S)))
        if answered and await finished(nc.drain(), deadline.left_s(keep_s=CANCEL_WAIT_S)):
            return
        log.warning("nats connection not drained: closing it", timeout_s=round(timeout_s, 3))
    await finished(nc.close(), max(deadline.left_s(), CANCEL_WAIT_S))  # a drain still waiting ends with it
    for step in steps:
        if not step.done():
            step.cancel()


def _succeeded(step: asyncio.Future[None]) -> bool:
    """Whether `step` ended without an error (which is read, so that asyncio does not report it)."""
    return step.done() and not step.cancelled() and step.exception() is None


def run_nats_service(
    component: str,
    nats_url: str,
    client_name: str,
    body: ServiceBody,
    nkey_file: str = "",
    inbox_prefix: str = "_INBOX",
    loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop,
    **log_keys: Any,
) -> None:
    """The whole life of a DeadPool service process: JSON logs, a NATS connection (as the nkey of
    `nkey_file`, if given, its replies under `inbox_prefix`), `body(nc, log, stop)` until a signal,
    then a bounded stop: the body has until `SHUTDOWN_BUDGET_S` less `CONNECTION_CLOSE_S` to return
    (it is cancelled after that), then the connection is drained or closed (`close_connection`). It
    runs on a loop of `loop_factory` (the detector's: `event_loop.coalescing_loop`)."""
    configure_logging(component)
    log = get_logger(**log_keys)

    async def main(stop: asyncio.Event) -> None:
        nc = await _connected(nats_url, client_name, log, nkey_file, inbox_prefix, stop)
        if nc is None:
            return
        running = asyncio.ensure_future(body(nc, log, stop))
        stopping = asyncio.ensure_future(stop.wait())
        freezing = asyncio.ensure_future(freeze_old_objects(stop))  # full GC passes walk the young only
        await asyncio.wait({running, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        freezing.cancel()
        deadline = StopDeadline.after(SHUTDOWN_BUDGET_S)
        try:
            if not running.done():
                await asyncio.wait({running}, timeout=deadline.left_s(keep_s=CONNECTION_CLOSE_S))
            if not running.done():
                log.error("the service's stop ran out of time: cancelled", budget_s=SHUTDOWN_BUDGET_S)
                running.cancel()
                await asyncio.wait({running}, timeout=CANCEL_WAIT_S)
            failed = running.exception() if running.done() and not running.cancelled() else None
            if failed is not None and not stop.is_set():
                raise failed  # a service that fails on its own ends the process with the error
            if failed is not None:
                log.warning("the service's stop failed", error=repr(failed))
        finally:
            await close_connection(nc, deadline.left_s() if stop.is_set() else CONNECTION_CLOSE_S, log)

    run_service(main, log, hard_stop_s=HARD_STOP_S, loop_factory=loop_factory)


async def _connected(
    url: str, name: str, log: Any, nkey_file: str, inbox_prefix: str, stop: asyncio.Event
) -> Client | None:
    """A connection to NATS, or None if `stop` came first (a server that cannot be reached does not
    hold a stop)."""
    connecting = asyncio.ensure_future(connect(url, name, log, nkey_file, inbox_prefix))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if connecting.done():
        return connecting.result()
    log.warning("stopped before NATS could be reached")
    connecting.cancel()
    await asyncio.wait({connecting}, timeout=CANCEL_WAIT_S)
    return None
