"""The events reader on a real nats-server, with a burst of stored events to read."""

from __future__ import annotations

import asyncio
import itertools
import time

from nats.aio.client import Client

from deadpool_protocol import MemberDone, Message, Subjects
from deadpool_runtime import EventPublisher, EventReader, ensure_events_stream
from deadpool_runtime.events import stream_position
from deadpool_runtime.logs import get_logger

S = Subjects.for_job("burst")
LOG = get_logger(test="event-reader")
BURST = 300
LIVENESS_BOUND_S = 20.0


async def test_a_reader_of_a_burst_lets_the_loops_other_tasks_run_between_its_events(nc: Client) -> None:
    """nats.py hands a subscription's waiting messages to its callback one after the other without
    yielding: a swapper reading a rebuild's thousand ack batches held its loop (its job worker, its
    other reader, its leader lease) for a third of a second. The reader yields between its events
    (after `slice_s` of them: here after each)."""
    await ensure_events_stream(nc)
    _, last = await stream_position(nc)
    publisher = EventPublisher(nc, LOG)
    for rank in range(BURST):  # stored before the reader starts: it is handed them as a burst
        assert await publisher.publish(S.member_done, MemberDone("burst", 1, f"m{rank}", rank, 100))
    stop = asyncio.Event()
    ticks = 0

    async def tick() -> None:
        """Another task of the loop, always ready to run."""
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    seen: list[int] = []
    """The ticks counted when each event reached the handler."""

    async def handler(_message: Message, _seq: int) -> None:
        seen.append(ticks)

    ticker = asyncio.create_task(tick())
    reader = EventReader(nc, [S.member_done], handler, LOG, slice_s=0.0)  # a yield after every event
    try:
        assert await reader.start(stop, start_seq=last + 1, attempts_max=50)
        deadline = time.monotonic() + LIVENESS_BOUND_S
        while len(seen) < BURST:
            assert time.monotonic() < deadline, f"{len(seen)} of {BURST} events read"
            await asyncio.sleep(0.01)
    finally:
        stop.set()
        await reader.stop()
        await ticker
    back_to_back = sum(1 for before, after in itertools.pairwise(seen) if before == after)
    assert back_to_back == 0, f"{back_to_back} of {BURST} events handled with no other task run in between"
