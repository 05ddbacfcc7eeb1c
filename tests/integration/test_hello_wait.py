"""A member's wait for the swapper's answer to its hello is bounded (`hello_wait_s`): with no swapper
on the bus, or one that hears the hello and never answers, the member ends saying why instead of
waiting for ever.

A real member control link on a real nats-server; the test plays the silent swapper.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from nats.aio.client import Client

from deadpool.control_link import HELLO_TIMEOUT_S, ControlLink
from deadpool.member_config import MemberConfig
from deadpool_protocol import HelloReply, MemberHello, Subjects, encode
from deadpool_runtime.logs import get_logger

JOB = "hello-wait"
HELLO_WAIT_S = 1.0
ANSWER_AFTER_S = HELLO_TIMEOUT_S * 1.25
"""Longer than a member's first wait, shorter than its second."""
ENDED_WITHIN_S = 30.0
"""The test's own bound on the member's end (the wait, then the link's close): far above both."""


@pytest.mark.parametrize("swapper", ["absent", "silent"])
async def test_a_member_no_swapper_answers_ends_saying_so(nc: Client, nats_url: str, swapper: str) -> None:
    heard: list[Any] = []

    async def hear(msg: Any) -> None:  # and never answer
        heard.append(msg)

    if swapper == "silent":
        await nc.subscribe(Subjects.for_job(JOB).hello, cb=hear)
        await nc.flush()
    config = MemberConfig(JOB, nats_url, "m0", "", 0, 1, "h0", hello_wait_s=HELLO_WAIT_S)
    link = ControlLink(config, get_logger(), on_command=lambda _c: None)
    hello = MemberHello(JOB, 0, "m0", "h0", 1, "", 0, 1, "127.0.0.1", 4000, time.time())
    with pytest.raises(ConnectionError, match=r"no swapper answered member m0's hello within 1\.0 s"):
        await asyncio.wait_for(asyncio.to_thread(link.start, hello), ENDED_WITHIN_S)
    assert not link._thread.is_alive(), "the link's thread still runs after the member gave up"
    assert (swapper == "silent") == bool(heard), "the silent swapper should have heard the hello"


async def test_a_member_whose_swapper_answers_every_hello_late_still_registers(nc: Client, nats_url: str) -> None:
    """A swapper that needs longer than the member's first wait to answer (thousands of hellos at
    once): the member waits longer each time, instead of asking again for ever and dropping every
    late answer."""
    heard: list[float] = []

    async def answer_late(msg: Any) -> None:
        heard.append(time.monotonic())
        await asyncio.sleep(ANSWER_AFTER_S)
        await msg.respond(encode(HelloReply(JOB, 0, "m0", True, "")))

    answering: set[asyncio.Task[None]] = set()

    async def hear(msg: Any) -> None:  # each hello answered on its own, late
        task = asyncio.create_task(answer_late(msg))
        answering.add(task)
        task.add_done_callback(answering.discard)

    await nc.subscribe(Subjects.for_job(JOB).hello, cb=hear)
    await nc.flush()
    config = MemberConfig(JOB, nats_url, "m0", "", 0, 1, "h0", hello_wait_s=60.0)
    link = ControlLink(config, get_logger(), on_command=lambda _c: None)
    hello = MemberHello(JOB, 0, "m0", "h0", 1, "", 0, 1, "127.0.0.1", 4000, time.time())
    try:
        await asyncio.wait_for(asyncio.to_thread(link.start, hello), ENDED_WITHIN_S)
        assert len(heard) == 2, "asked once, waited too little, asked again with a longer wait"
    finally:
        await asyncio.to_thread(link.close)
