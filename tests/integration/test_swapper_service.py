"""A real swapper process: formation, a swap with its incident, and job state that survives a restart."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from nats.aio.client import Client

from deadpool_protocol import (
    SWAPPER_STATUS,
    Failure,
    HelloReply,
    Incident,
    MemberHello,
    Rebuild,
    RebuildAck,
    StoreStatus,
    Subjects,
    decode,
    encode,
)
from deadpool_protocol.subjects import STORE_STATUS

from .conftest import SpawnService, wait_for_micro_service

S = Subjects.for_job("job1")


async def queue_of(nc: Client, subject: str, kind: type[Any]) -> asyncio.Queue[Any]:
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def on_msg(msg: object) -> None:
        await queue.put(decode(msg.data, kind))  # type: ignore[attr-defined]

    await nc.subscribe(subject, cb=on_msg)
    await nc.flush()
    return queue


async def hello(nc: Client, member: str, hint: int, host: str) -> HelloReply:
    request = MemberHello("job1", 0, member, host, 1000, "l0", hint, 2, "127.0.0.1", 4000 + max(hint, 0), time.time())
    reply = await nc.request(S.hello, encode(request), timeout=5)
    return decode(reply.data, HelloReply)


def ack(rebuild: Rebuild, member: str) -> RebuildAck:
    now = time.time()
    return RebuildAck(
        "job1",
        rebuild.generation,
        member,
        rebuild.rank_of(member),
        rebuild.restore_step,
        -1,
        "fresh" if rebuild.restore_step < 0 else "local",
        {"begin": now, "ready": now},
        now,
    )


async def test_formation_swap_and_restart(nc: Client, spawn_service: SpawnService) -> None:
    swapper = spawn_service("swapper", "--replication", "1")
    await wait_for_micro_service(nc, "deadpool-swapper")
    rebuilds = await queue_of(nc, S.rebuild, Rebuild)
    incidents = await queue_of(nc, S.incident, Incident)

    await nc.publish(STORE_STATUS, encode(StoreStatus("st0", "127.0.0.1", 6000, 0, 100, 0, time.time())))
    assert (await hello(nc, "r0", 0, "h0")).accepted
    assert (await hello(nc, "r1", 1, "h0")).accepted
    assert (await hello(nc, "sp", -1, "h1")).accepted
    refused = await hello(nc, "r1", 1, "h0")  # a repeated hello is harmless
    assert refused.accepted

    formation = await asyncio.wait_for(rebuilds.get(), 10)
    assert formation.generation == 1 and formation.ranks == ["r0", "r1"]  # every rank claimed: no wait
    for member in formation.ranks:
        await nc.publish(S.rebuild_ack, encode(ack(formation, member)))

    now = time.time()
    await nc.publish(S.failure, encode(Failure("job1", 1, "r1", 1, "exit", {"signal": "9"}, now, now)))
    swap = await asyncio.wait_for(rebuilds.get(), 10)
    while swap.generation == 1:  # retransmissions of formation until its acks were processed
        swap = await asyncio.wait_for(rebuilds.get(), 10)
    assert swap.generation == 2 and swap.ranks == ["r0", "sp"] and swap.restore_step == 0
    for member in swap.ranks:
        await nc.publish(S.rebuild_ack, encode(ack(swap, member)))
    incident = await asyncio.wait_for(incidents.get(), 10)
    assert (incident.rank, incident.member, incident.replacement, incident.generation) == (1, "r1", "sp", 2)

    swapper.terminate()
    swapper.wait(10)
    spawn_service("swapper", "--replication", "1")
    await wait_for_micro_service(nc, "deadpool-swapper")
    status = json.loads((await nc.request(SWAPPER_STATUS, b"job1", timeout=5)).data)
    assert status["generation"] == 2 and status["ranks"] == ["r0", "sp"]
    assert [i["replacement"] for i in status["incidents"]] == ["sp"]
    assert not (await hello(nc, "r1", 1, "h0")).accepted  # the replaced member stays fenced
