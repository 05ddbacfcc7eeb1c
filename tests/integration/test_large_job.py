"""A job of 4,096 ranks with launcher-style 40-character member names forms: its record (860 kB) is
stored in parts of at most 256 kB (its large fields each in sections of their own), and its hellos
are answered in a few saves, not one save each.

Seen: the record of such a job passes 1 MiB at about 3,000 ranks; the swapper took nats-py's
`MaxPayloadError` for a transient error and retried the save for ever, so the job never published
its formation. The members here are the test's own NATS requests and events (thousands of training
processes cannot run on 2 cores); the swapper, the stores and NATS are real.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nats.aio.client import Client

from deadpool_protocol import (
    HelloReply,
    MemberHello,
    Rebuild,
    RebuildAck,
    RebuildMarks,
    RestoreSource,
    Subjects,
    decode,
    encode,
)
from deadpool_protocol.job_record import JOBS_BUCKET, RECORD_PART_BYTES_MAX, unpack_record
from deadpool_protocol.message_parts import MESSAGE_PART_BYTES_MAX
from deadpool_runtime import EventPublisher
from deadpool_runtime.bus import subscribe_validated
from deadpool_runtime.job_record_kv import read_record
from deadpool_runtime.logs import get_logger

from .conftest import SpawnService, wait_for_micro_service
from .runs import RUN, start_run
from .test_message_parts import frame_bytes
from .test_store_replication import start_stores

JOB = "large-job"
RANKS = 4096
NAME_CHARS = 40
IN_FLIGHT = 256
FORM_WAIT_S = 240.0


def member_name(i: int) -> str:
    name = f"gpu-node-{i // 8:04d}-{31_000 + i // 8}-a1b2-{i}"
    return name + "x" * (NAME_CHARS - len(name))


async def test_a_job_of_4096_ranks_with_long_names_forms(nc: Client, spawn_service: SpawnService) -> None:
    spawn_service("swapper", "--replication", "2")
    await wait_for_micro_service(nc, "deadpool-swapper")
    await start_stores(nc, spawn_service)
    subjects = Subjects.for_job(JOB)
    rebuilds: asyncio.Queue[Rebuild] = asyncio.Queue()
    frames: list[int] = []

    async def on_rebuild(rebuild: Rebuild, _msg: Any) -> None:
        await rebuilds.put(rebuild)

    async def on_frame(msg: Any) -> None:
        frames.append(frame_bytes(msg))

    await subscribe_validated(nc, subjects.rebuild, Rebuild, on_rebuild, get_logger())
    await nc.subscribe(subjects.rebuild, cb=on_frame)
    gate = asyncio.Semaphore(IN_FLIGHT)
    names = [member_name(i) for i in range(RANKS + 1)]
    assert (await start_run(nc, JOB, RANKS)).accepted
    assert all(len(n) == NAME_CHARS for n in names)

    async def hello(i: int) -> HelloReply:
        request = MemberHello(
            JOB, 0, names[i], f"gpu-node-{i // 8:04d}", 1000 + i, f"gpu-node-{i // 8:04d}-launcher",
            i if i < RANKS else -1, RANKS, f"10.1.{i // 256}.{i % 256}", 29_500, time.time(), RUN,
        )  # fmt: skip
        async with gate:
            for _ in range(20):  # a member asks again when no answer comes in time, as members do
                try:
                    return decode((await nc.request(subjects.hello, encode(request), timeout=30)).data, HelloReply)
                except TimeoutError:
                    continue
        raise AssertionError(f"member {i} got no answer")

    started = time.monotonic()
    replies = await asyncio.wait_for(asyncio.gather(*(hello(i) for i in range(RANKS + 1))), FORM_WAIT_S)
    assert all(r.accepted for r in replies), {r.reason for r in replies if not r.accepted}
    formation = await asyncio.wait_for(rebuilds.get(), FORM_WAIT_S)
    assert formation.generation == 1 and formation.ranks == names[:RANKS]
    await nc.flush()
    assert frames and max(frames) <= MESSAGE_PART_BYTES_MAX, "every frame within 256 KiB, the formation's too"

    events = EventPublisher(nc, get_logger())
    marks = RebuildMarks(received=time.time(), ready=time.time())

    async def ack(rank: int) -> None:
        async with gate:
            ok = await events.publish(
                subjects.rebuild_ack,
                RebuildAck(JOB, 1, names[rank], rank, -1, -1, RestoreSource.FRESH, marks, time.time()),
            )
            assert ok

    await asyncio.wait_for(asyncio.gather(*(ack(r) for r in range(RANKS))), FORM_WAIT_S)
    kv = await nc.jetstream(timeout=5.0).key_value(JOBS_BUCKET)
    deadline = time.monotonic() + FORM_WAIT_S
    while True:
        stored = await read_record(kv, JOB, 5.0)
        if stored is not None:
            summary, private = unpack_record(stored.record)
            if summary.generation == 1 and private.get("pending_command") is None and private.get("formed"):
                break
        assert time.monotonic() < deadline, "the swapper did not record the formation"
        await asyncio.sleep(0.5)
    assert summary.ranks == names[:RANKS] and len(summary.hosts) == RANKS + 1
    assert len(stored.record) > 3 * RECORD_PART_BYTES_MAX, "the record was meant to be large"
    assert stored.part_keys, "its large fields are stored in parts"
    print(f"formed {RANKS} ranks in {time.monotonic() - started:.1f} s; record {len(stored.record)} bytes")
