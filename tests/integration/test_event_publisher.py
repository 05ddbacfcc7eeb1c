"""The event publisher on a real nats-server: an event waits for the stream, a repeat in flight joins it,
the bound drops new events, and a stopping process abandons what it could not store."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client

from deadpool_protocol import MemberDone, Subjects
from deadpool_protocol.events import EVENTS_STREAM
from deadpool_runtime import EventPublisher, ensure_events_stream
from deadpool_runtime import events as events_module
from deadpool_runtime.logs import get_logger

S = Subjects.for_job("pub")
LOG = get_logger(test="event-publisher")


def done(rank: int) -> MemberDone:
    return MemberDone("pub", 1, f"m{rank}", rank, 100)


async def test_an_event_waits_for_the_stream_and_a_repeat_still_in_flight_is_stored_once(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(events_module, "EVENTS_IN_FLIGHT_MAX", 2)
    publisher = EventPublisher(nc, LOG)
    first = publisher.publish_soon(S.member_done, done(0))  # no stream yet: retried
    repeat = publisher.publish_soon(S.member_done, done(0))  # a done report sent again meanwhile
    other = publisher.publish_soon(S.member_done, done(1))
    assert first is not None and repeat is first and other is not None and other is not first
    assert publisher.publish_soon(S.member_done, done(2)) is None and publisher.dropped == 1  # the bound
    assert publisher.publish_soon(S.member_done, done(1)) is other  # a repeat is never dropped
    await asyncio.sleep(0.3)  # the fault's size: a few retries against no stream
    assert not first.done()
    await ensure_events_stream(nc)
    assert list(await asyncio.wait_for(asyncio.gather(first, other), 10)) == [True, True]
    info = await nc.jetstream().stream_info(EVENTS_STREAM)
    assert info.state.messages == 2
    assert publisher.in_flight == 0


async def test_a_stopping_process_abandons_the_events_it_could_not_store(nc: Client) -> None:
    publisher = EventPublisher(nc, LOG)
    waiting = asyncio.create_task(publisher.publish(S.member_done, done(0)))  # no stream: never stored
    await asyncio.sleep(0.2)  # the fault's size: a few retries
    await publisher.drain(0.2)
    assert await asyncio.wait_for(waiting, 5) is False
    assert publisher.in_flight == 0
