"""A bounded queue in lanes: the oldest item of the first lane that has one comes out first.

A job's worker reads the stores' reports (which commit steps) ahead of its other inputs, so that a
commit is never decided behind a rebuild's thousands of acks and first steps (`SWAPPER_REPORTS`).
Within a lane, items keep their order."""

from __future__ import annotations

import asyncio
import itertools
from typing import Generic, TypeVar

__all__ = ["AHEAD", "IN_TURN", "LanedQueue"]

T = TypeVar("T")

AHEAD = 0
"""The lane taken first."""
IN_TURN = 1
"""The lane taken when the first one is empty."""


class LanedQueue(Generic[T]):
    """`asyncio.Queue`'s bounded put and get, where `get` takes from the lowest lane first. One bound
    for all lanes: a put waits while the queue is full, and the worker's next get makes room."""

    def __init__(self, maxsize: int) -> None:
        self._queue: asyncio.PriorityQueue[tuple[int, int, T]] = asyncio.PriorityQueue(maxsize)
        self._order = itertools.count()
        """Ties within a lane go by arrival (and never compare the items)."""

    async def put(self, item: T, lane: int = IN_TURN) -> None:
        await self._queue.put((lane, next(self._order), item))

    def put_nowait(self, item: T, lane: int = IN_TURN) -> None:
        self._queue.put_nowait((lane, next(self._order), item))

    async def get(self) -> T:
        return (await self._queue.get())[2]

    def get_nowait(self) -> T:
        return self._queue.get_nowait()[2]

    def qsize(self) -> int:
        return self._queue.qsize()
