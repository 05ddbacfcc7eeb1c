"""Run an asyncio service until SIGINT or SIGTERM, then let it stop cleanly."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client

from deadpool_protocol.logs import configure_logging, get_logger
from deadpool_runtime.bus import connect

__all__ = ["log_tasks", "run_nats_service", "run_service", "stopped_within"]

ServiceBody = Callable[[Client, Any, asyncio.Event], Awaitable[None]]


def run_service(main: Callable[[asyncio.Event], Awaitable[None]], log: Any = None) -> None:
    """Run `main(stop)`; `stop` is set on SIGINT/SIGTERM and `main` is expected to return soon after.
    With `log`, SIGUSR1 logs where every asyncio task of the service is waiting (an operator's view of
    a service that looks stuck: `kill -USR1 <pid>`)."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if log is not None:
            loop.add_signal_handler(signal.SIGUSR1, lambda: log_tasks(log))
        await main(stop)

    asyncio.run(runner())


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


def run_nats_service(
    component: str, nats_url: str, client_name: str, body: ServiceBody, nkey_file: str = "", **log_keys: Any
) -> None:
    """The whole life of a DeadPool service process: JSON logs, a NATS connection (as the nkey of
    `nkey_file`, if given), `body(nc, log, stop)` until a signal, then a drained connection."""
    configure_logging(component)
    log = get_logger(**log_keys)

    async def main(stop: asyncio.Event) -> None:
        nc = await connect(nats_url, client_name, log, nkey_file)
        try:
            await body(nc, log, stop)
        finally:
            await nc.drain()

    run_service(main, log)
