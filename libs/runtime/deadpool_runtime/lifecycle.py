"""Run an asyncio service until SIGINT or SIGTERM, then let it stop cleanly."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client

from deadpool_protocol.logs import configure_logging, get_logger
from deadpool_runtime.bus import connect

__all__ = ["run_nats_service", "run_service", "stopped_within"]

ServiceBody = Callable[[Client, Any, asyncio.Event], Awaitable[None]]


def run_service(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)`; `stop` is set on SIGINT/SIGTERM and `main` is expected to return soon after."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    asyncio.run(runner())


async def stopped_within(stop: asyncio.Event, period_s: float) -> bool:
    """Wait up to `period_s` for `stop`; True if it was set. The tick of every service's periodic loop."""
    try:
        await asyncio.wait_for(stop.wait(), period_s)
    except TimeoutError:
        return False
    return True


def run_nats_service(component: str, nats_url: str, client_name: str, body: ServiceBody, **log_keys: Any) -> None:
    """The whole life of a DeadPool service process: JSON logs, a NATS connection, `body(nc, log, stop)`
    until a signal, then a drained connection."""
    configure_logging(component)
    log = get_logger(**log_keys)

    async def main(stop: asyncio.Event) -> None:
        nc = await connect(nats_url, client_name, log)
        try:
            await body(nc, log, stop)
        finally:
            await nc.drain()

    run_service(main)
