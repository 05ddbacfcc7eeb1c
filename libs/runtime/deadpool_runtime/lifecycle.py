"""Run an asyncio service until SIGINT or SIGTERM, then let it stop cleanly."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

__all__ = ["run_service", "stopped_within"]


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
