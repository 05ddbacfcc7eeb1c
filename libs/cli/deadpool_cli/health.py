"""A health check for one service process: does an instance on this host answer its NATS micro ping?

Every DeadPool service is a `nats.micro` service whose metadata names its host. A container's or a
unit's health check pings the service's name and waits for an answer from its own host, so it fails
when that process is gone or cut off from NATS, whatever its peers elsewhere do.
"""

from __future__ import annotations

import asyncio
import json
import socket

from nats.aio.client import Client
from nats.aio.msg import Msg

__all__ = ["PING_WAIT_S", "answers_from_host"]

PING_WAIT_S = 2.0


async def answers_from_host(nc: Client, service: str, host: str = "", wait_s: float = PING_WAIT_S) -> bool:
    """Whether an instance of `service` on `host` (default: this one) answers a ping within `wait_s`."""
    host = host or socket.gethostname()
    found = asyncio.Event()

    async def on_reply(msg: Msg) -> None:
        try:
            metadata = json.loads(msg.data).get("metadata") or {}
        except (ValueError, AttributeError):
            return  # not a micro ping response: ignored
        if metadata.get("host") == host:
            found.set()

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        await nc.publish(f"$SRV.PING.{service}", b"", reply=inbox)
        try:
            await asyncio.wait_for(found.wait(), wait_s)
        except TimeoutError:
            return False
        return True
    finally:
        await sub.unsubscribe()
