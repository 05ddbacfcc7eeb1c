"""A real member control link for tests that play the swapper: its hello answered, the events stream
there."""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client
from nats.aio.msg import Msg

from deadpool.control_link import ControlLink
from deadpool.member_config import MemberConfig
from deadpool_protocol import HelloReply, MemberHello, Subjects, decode, encode
from deadpool_runtime import ensure_events_stream
from deadpool_runtime.logs import get_logger


async def member_link(nc: Client, nats_url: str, config: MemberConfig) -> ControlLink:
    """`config`'s member registered with a swapper the test plays (every hello accepted)."""

    async def swapper(msg: Msg) -> None:
        hello = decode(msg.data, MemberHello)
        await nc.publish(msg.reply, encode(HelloReply(config.job, 0, hello.member, True, "registered")))

    await nc.subscribe(Subjects.for_job(config.job).hello, cb=swapper)
    await ensure_events_stream(nc)
    await nc.flush()
    link = ControlLink(config, get_logger(), on_command=lambda _c: None)
    hello = MemberHello(
        config.job, 0, config.member, config.host, 1, config.launcher, config.rank_hint, config.world_size,
        "127.0.0.1", 4000, time.time(),
    )  # fmt: skip
    await asyncio.to_thread(link.start, hello)
    return link
