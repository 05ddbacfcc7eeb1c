"""The job worker's inbox in lanes: the first lane's oldest item first, each lane in its order, one
bound for all."""

from __future__ import annotations

import asyncio

import pytest

from deadpool_swapper.lanes import AHEAD, IN_TURN, LanedQueue

pytestmark = pytest.mark.unit


async def test_the_first_lane_comes_first_and_each_lane_keeps_its_order() -> None:
    queue: LanedQueue[str] = LanedQueue(8)
    for item, lane in (("ack1", IN_TURN), ("report1", AHEAD), ("ack2", IN_TURN), ("report2", AHEAD)):
        queue.put_nowait(item, lane)
    assert [queue.get_nowait() for _ in range(4)] == ["report1", "report2", "ack1", "ack2"]
    with pytest.raises(asyncio.QueueEmpty):
        queue.get_nowait()


async def test_one_bound_for_every_lane_and_a_get_makes_room() -> None:
    queue: LanedQueue[int] = LanedQueue(2)
    queue.put_nowait(1)
    queue.put_nowait(2)
    with pytest.raises(asyncio.QueueFull):
        queue.put_nowait(3, AHEAD)
    waiting = asyncio.create_task(queue.put(3, AHEAD))  # a report behind a full inbox of acks
    await asyncio.sleep(0)
    assert not waiting.done()
    assert queue.get_nowait() == 1
    await asyncio.wait_for(waiting, 5)
    assert queue.qsize() == 2
    assert [await queue.get(), await queue.get()] == [3, 2]
