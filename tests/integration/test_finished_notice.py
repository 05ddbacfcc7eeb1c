"""A member takes the job's end only from the generation it knows, or a newer one: a `JobFinished` of an
older generation (a stale retransmission, a replayed one, another run's of the same name) is ignored.

A real member control link on a real nats-server; the test plays the swapper on the bus.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nats.aio.client import Client

from deadpool.control_link import ControlLink
from deadpool.member_config import MemberConfig
from deadpool_protocol import (
    HelloReply,
    JobFinished,
    MemberHello,
    Rebuild,
    StoreAddress,
    Subjects,
    decode,
    encode,
)
from deadpool_runtime.logs import get_logger

JOB = "finished-notice"
WAIT_S = 20.0


async def test_a_member_ignores_the_end_of_an_older_generation(nc: Client, nats_url: str) -> None:
    subjects = Subjects.for_job(JOB)

    async def swapper(msg: Any) -> None:
        hello = decode(msg.data, MemberHello)
        await nc.publish(msg.reply, encode(HelloReply(JOB, 0, hello.member, True, "registered")))

    await nc.subscribe(subjects.hello, cb=swapper)
    await nc.flush()
    config = MemberConfig(JOB, nats_url, "m0", "", 0, 1, "h0")
    commands: list[Any] = []
    link = ControlLink(config, get_logger(), on_command=commands.append)
    hello = MemberHello(JOB, 0, "m0", "h0", 1, "", 0, 1, "127.0.0.1", 4000, time.time())
    await asyncio.to_thread(link.start, hello)
    try:
        store = StoreAddress("s0", "127.0.0.1", 5000)
        rebuild = Rebuild(JOB, 3, 1, ["m0"], [], "m0", "127.0.0.1", 4000, -1, [store], [["s0"]], "", time.time())
        await nc.publish(subjects.rebuild, encode(rebuild))
        await until(lambda: link.latest_rebuild()[0] is not None)
        await nc.publish(subjects.finished, encode(JobFinished(JOB, 2, 10, failed=True, reason="an older run")))
        await nc.publish(subjects.finished, encode(JobFinished(JOB, 3, 20)))
        await until(lambda: link.finished() is not None)
        finished = link.finished()
        assert finished is not None and finished.generation == 3 and not finished.failed
        ends = [c for c in commands if isinstance(c, JobFinished)]
        assert ends == [finished], "the older generation's end reached the member"
    finally:
        await asyncio.to_thread(link.close)


async def until(condition: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
