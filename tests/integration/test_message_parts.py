"""A rebuild of 16,384 ranks crosses a real NATS server in frames of at most 256 KiB and arrives whole;
a forged part makes the subscriber refuse that message, not stop.

Seen (issue 26): the rebuild command names every rank, 607 kB at 16,384 ranks with 9-character
names and over 1 MB with a cluster's, past NATS' `max_payload`: the swapper's publish failed and the
job never formed again."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.client import Client

from deadpool_protocol import Rebuild, encode
from deadpool_protocol.message_parts import MESSAGE_PART_BYTES_MAX, PART_HEADER, split_message
from deadpool_runtime.bus import publish, subscribe_validated
from tests.unit.test_message_parts import rebuild_of
from tests.unit.test_refusal_log import Lines

pytestmark = pytest.mark.timeout(60)

SUBJECT = "deadpool.job.rebuild"


def frame_bytes(msg: Any) -> int:
    """A frame's payload and headers as the server carries them (`NATS/1.0`, each header, blank line)."""
    headers = msg.headers or {}
    return len(msg.data) + (
        len("NATS/1.0\r\n\r\n") + sum(len(f"{k}: {v}\r\n") for k, v in headers.items()) if headers else 0
    )


async def test_a_16384_rank_rebuild_arrives_whole_in_frames_of_at_most_256_kib(nc: Client) -> None:
    received: asyncio.Queue[Rebuild] = asyncio.Queue()
    frames: list[int] = []

    async def on_rebuild(rebuild: Rebuild, _msg: Any) -> None:
        await received.put(rebuild)

    async def on_frame(msg: Any) -> None:
        frames.append(frame_bytes(msg))

    log = Lines()
    await subscribe_validated(nc, SUBJECT, Rebuild, on_rebuild, log)
    await nc.subscribe(SUBJECT, cb=on_frame)
    rebuild = rebuild_of(16384)
    assert len(encode(rebuild)) > nc.max_payload, "the case this exists for: larger than one frame may be"

    await publish(nc, SUBJECT, rebuild)
    first = await asyncio.wait_for(received.get(), 10.0)
    assert first == rebuild
    await nc.flush()
    assert len(frames) == len(split_message(encode(rebuild))) >= 5
    assert max(frames) <= MESSAGE_PART_BYTES_MAX, frames

    # sent again (a retransmission): handed on again, as the message decoded the first time; so is a
    # large message of one frame, and a small one is decoded again
    await publish(nc, SUBJECT, rebuild)
    assert await asyncio.wait_for(received.get(), 10.0) is first
    for ranks, again in ((4096, True), (16, False)):
        one_frame = rebuild_of(ranks)
        assert len(encode(one_frame)) < nc.max_payload
        await publish(nc, SUBJECT, one_frame)
        decoded = await asyncio.wait_for(received.get(), 10.0)
        await publish(nc, SUBJECT, one_frame)
        assert ((await asyncio.wait_for(received.get(), 10.0)) is decoded) is again, ranks

    # a part altered on the way: the whole does not match its digest, nothing is handed on; the next
    # sending (the swapper re-sends a command until it is answered) arrives
    parts = split_message(encode(rebuild))
    header, payload = parts[2]
    for h, p in [*parts[:2], (header, bytes([payload[0] ^ 1]) + payload[1:]), *parts[3:]]:
        await nc.publish(SUBJECT, p, headers={PART_HEADER: h})
    await nc.flush()
    await publish(nc, SUBJECT, rebuild_of(16384, generation=2))
    second = await asyncio.wait_for(received.get(), 10.0)
    assert second.generation == 2 and received.empty()
    assert [f["reason"] for e, f in log.lines if e == "rejected message"] == [
        f"the parts of {header.split('/')[2]} do not make the message it names"
    ]
