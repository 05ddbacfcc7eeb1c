"""A service's old objects leave the collector's full passes, and come back for one now and then: cyclic
garbage among them is freed at the next thaw, not never."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Callable

from deadpool_runtime.gc_policy import freeze_old_objects

WAIT_S = 5.0


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


async def until(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


async def test_old_cyclic_garbage_waits_for_the_thaw_and_everything_is_unfrozen_at_the_stop() -> None:
    stop = asyncio.Event()
    node = Node()
    alive = weakref.ref(node)
    task = asyncio.create_task(freeze_old_objects(stop, freeze_every_s=0.01, thaw_every_s=0.3))
    try:
        await until(lambda: gc.get_freeze_count() > 0, "the objects alive were frozen")
        del node
        gc.collect()
        assert alive() is not None, "a frozen cycle is out of the collector's reach"
        await until(lambda: alive() is None, "the thaw collected it")
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_S)
    assert gc.get_freeze_count() == 0
