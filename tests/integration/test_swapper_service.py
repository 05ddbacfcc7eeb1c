"""A real swapper process: formation, a swap with its incident, and job state that survives a restart."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from deadpool_protocol import (
    SWAPPER_STATUS,
    Failure,
    FailureReason,
    HelloReply,
    Incident,
    MemberHello,
    Rebuild,
    RebuildAck,
    RebuildMarks,
    RestoreSource,
    StepResumed,
    StoreStatus,
    Subjects,
    decode,
    encode,
)
from deadpool_protocol.job_record import JOBS_BUCKET, PART_SEPARATOR
from deadpool_protocol.subjects import store_announce

from .conftest import SpawnService, wait_for_micro_service
from .runs import RUN, start_run

S = Subjects.for_job("job1")


async def queue_of(nc: Client, subject: str, kind: type[Any]) -> asyncio.Queue[Any]:
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def on_msg(msg: object) -> None:
        await queue.put(decode(msg.data, kind))  # type: ignore[attr-defined]

    await nc.subscribe(subject, cb=on_msg)
    await nc.flush()
    return queue


async def hello(nc: Client, member: str, hint: int, host: str) -> HelloReply:
    port = 4000 + max(hint, 0)
    request = MemberHello("job1", 0, member, host, 1000, f"l-{host}", hint, 2, "127.0.0.1", port, time.time(), run=RUN)
    reply = await nc.request(S.hello, encode(request), timeout=5)
    return decode(reply.data, HelloReply)


async def leader_status(nc: Client, job: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The job's status from the leading swapper (a swapper that just started leads a moment later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            body: dict[str, Any] = json.loads((await nc.request(SWAPPER_STATUS, job.encode(), timeout=0.5)).data)
            return body
        except (NatsTimeoutError, NoRespondersError):
            if time.monotonic() > deadline:
                raise


async def wait_for_leader(nc: Client, timeout_s: float = 30.0) -> None:
    """Block until a swapper leads: only the leader answers status requests (or hellos), and a swapper
    answers micro-service pings before it has taken the lease."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await nc.request(SWAPPER_STATUS, b"no-such-job", timeout=0.5)  # a 404 is an answer
            return
        except (NatsTimeoutError, NoRespondersError):
            if time.monotonic() > deadline:
                raise


async def announce_store(nc: Client, period_s: float) -> None:
    """A store `st0` that announces itself every `period_s` until cancelled: the swapper rebuilds only
    with a live store in its view."""
    while True:
        await nc.publish(store_announce("st0"), encode(StoreStatus("st0", "127.0.0.1", 6000, 0, 100, 0, time.time())))
        await asyncio.sleep(period_s)


def ack(rebuild: Rebuild, member: str) -> RebuildAck:
    now = time.time()
    return RebuildAck(
        "job1",
        rebuild.generation,
        member,
        rebuild.rank_of(member),
        rebuild.restore_step,
        -1,
        RestoreSource.FRESH if rebuild.restore_step < 0 else RestoreSource.LOCAL,
        RebuildMarks(begin=now, ready=now),
        now,
    )


async def test_formation_swap_and_restart(nc: Client, spawn_service: SpawnService) -> None:
    swapper = spawn_service("swapper", "--replication", "1")
    await wait_for_micro_service(nc, "deadpool-swapper")
    await wait_for_leader(nc)
    rebuilds = await queue_of(nc, S.rebuild, Rebuild)
    incidents = await queue_of(nc, S.incident, Incident)

    await nc.publish(store_announce("st0"), encode(StoreStatus("st0", "127.0.0.1", 6000, 0, 100, 0, time.time())))
    assert (await start_run(nc, "job1", 2)).accepted
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
    await nc.publish(S.failure, encode(Failure("job1", 1, "r1", 1, FailureReason.EXIT, {"signal": "9"}, now, now)))
    swap = await asyncio.wait_for(rebuilds.get(), 10)
    while swap.generation == 1:  # retransmissions of formation until its acks were processed
        swap = await asyncio.wait_for(rebuilds.get(), 10)
    assert swap.generation == 2 and swap.ranks == ["r0", "sp"] and swap.restore_step == 0
    for member in swap.ranks:
        await nc.publish(S.rebuild_ack, encode(ack(swap, member)))
    for rank, member in enumerate(swap.ranks):  # the recovery ends at every rank's first step
        resumed = StepResumed("job1", swap.generation, member, rank, swap.restore_step + 1, time.time())
        await nc.publish(S.step_resumed, encode(resumed))
    incident = await asyncio.wait_for(incidents.get(), 10)
    assert (incident.rank, incident.member, incident.replacement, incident.generation) == (1, "r1", "sp", 2)

    swapper.terminate()
    swapper.wait(10)
    spawn_service("swapper", "--replication", "1")
    await wait_for_micro_service(nc, "deadpool-swapper")
    await wait_for_leader(nc)
    status = await leader_status(nc, "job1")
    assert status["generation"] == 2 and status["ranks"] == ["r0", "sp"]
    assert [i["replacement"] for i in status["incidents"]] == ["sp"]
    assert not (await hello(nc, "r1", 1, "h0")).accepted  # the replaced member stays fenced


def job_hello(job: str, member: str, hint: int, launcher: str) -> MemberHello:
    return MemberHello(job, 0, member, "h0", 1000, launcher, hint, 1, "127.0.0.1", 4100 + hint, time.time(), run=RUN)


async def never_answer(_msg: object) -> None:
    """A launcher that hears the fence request and never answers it (cut off, or wedged)."""


async def test_a_job_whose_fence_hangs_never_delays_another_job(nc: Client, spawn_service: SpawnService) -> None:
    """Job a's fence goes to a launcher that never answers (5 s, the fence timeout); job b's failure,
    arriving meanwhile, is swapped at once: each job has its own worker."""
    spawn_service("swapper", "--replication", "1")
    await wait_for_micro_service(nc, "deadpool-swapper")
    await wait_for_leader(nc)

    announcing = asyncio.create_task(announce_store(nc, 1.0))
    rebuilds: dict[str, asyncio.Queue[Rebuild]] = {}
    for job in ("a", "b"):
        rebuilds[job] = await queue_of(nc, Subjects.for_job(job).rebuild, Rebuild)
        await nc.subscribe(Subjects.for_job(job).fence(f"l{job}"), cb=never_answer)
        assert (await start_run(nc, job, 1, launcher=f"l{job}")).accepted
        for member, hint in ((f"{job}0", 0), (f"{job}s", -1)):
            reply = await nc.request(Subjects.for_job(job).hello, encode(job_hello(job, member, hint, f"l{job}")), 10)
            assert decode(reply.data, HelloReply).accepted
        formation = await asyncio.wait_for(rebuilds[job].get(), 10)
        ack_message = RebuildAck(
            job, 1, f"{job}0", 0, -1, -1, RestoreSource.FRESH, RebuildMarks(ready=time.time()), time.time()
        )
        await nc.publish(Subjects.for_job(job).rebuild_ack, encode(ack_message))
        assert formation.generation == 1
    await asyncio.sleep(0.5)
    now = time.time()
    hung = Failure("a", 1, "a0", 0, FailureReason.HEARTBEAT, {}, now, now)  # needs a fence: the process may still run
    await nc.publish(Subjects.for_job("a").failure, encode(hung))
    await asyncio.sleep(0.2)
    started = time.monotonic()
    crashed = Failure("b", 1, "b0", 0, FailureReason.EXIT, {}, now, now)  # an exit needs no fence
    await nc.publish(Subjects.for_job("b").failure, encode(crashed))
    swap_b = await asyncio.wait_for(rebuilds["b"].get(), 10)
    while swap_b.generation == 1:
        swap_b = await asyncio.wait_for(rebuilds["b"].get(), 10)
    b_s = time.monotonic() - started
    assert swap_b.generation == 2 and swap_b.ranks == ["bs"]
    assert rebuilds["a"].empty(), "job a's swap came first: its fence should still be waiting"
    swap_a = await asyncio.wait_for(rebuilds["a"].get(), 15)
    while swap_a.generation == 1:
        swap_a = await asyncio.wait_for(rebuilds["a"].get(), 15)
    a_s = time.monotonic() - started
    announcing.cancel()
    assert swap_a.ranks == ["as"] and b_s < a_s, (b_s, a_s)


async def test_a_running_job_the_leader_did_not_list_on_taking_the_lead_is_adopted_and_swapped(
    nc: Client, spawn_service: SpawnService
) -> None:
    """Right after JetStream got its quorum back, a new leader's listing of the job records was seen
    to come back empty: it led no job, and a stored verdict waited for good. Here the record is away
    from the bucket while the new leader takes the lead, and comes back after: the leader adopts the
    job (it lists the records again) and acts on the verdict."""
    first = spawn_service("swapper", "--replication", "1")
    await wait_for_micro_service(nc, "deadpool-swapper")
    await wait_for_leader(nc)
    rebuilds = await queue_of(nc, S.rebuild, Rebuild)
    await nc.publish(store_announce("st0"), encode(StoreStatus("st0", "127.0.0.1", 6000, 0, 100, 0, time.time())))
    assert (await start_run(nc, "job1", 2)).accepted
    for member, hint in (("sp", -1), ("r0", 0), ("r1", 1)):
        assert (await hello(nc, member, hint, f"h-{member}")).accepted
    formation = await asyncio.wait_for(rebuilds.get(), 10)
    for member in formation.ranks:
        await nc.publish(S.rebuild_ack, encode(ack(formation, member)))
    while (await leader_status(nc, "job1"))["rebuild_pending"]:
        await asyncio.sleep(0.1)  # polling a status: the swapper publishes no event for this
    first.terminate()
    assert first.wait(10) == 0

    kv = await nc.jetstream().key_value(JOBS_BUCKET)
    away = {key: (await kv.get(key)).value for key in await kv.keys() if key.split(PART_SEPARATOR)[0] == "job1"}
    assert "job1" in away
    for key in away:
        await kv.delete(key)
    spawn_service("swapper", "--replication", "1")
    await wait_for_micro_service(nc, "deadpool-swapper")
    await wait_for_leader(nc)
    unknown = await nc.request(SWAPPER_STATUS, b"job1", timeout=5)  # it took the lead without the job
    assert unknown.headers is not None and unknown.headers.get("Nats-Service-Error-Code") == "404"
    for key, value in away.items():
        await kv.put(key, value or b"")

    announcing = asyncio.create_task(announce_store(nc, 0.5))
    try:
        now = time.time()
        await nc.publish(S.failure, encode(Failure("job1", 1, "r1", 1, FailureReason.EXIT, {"signal": "9"}, now, now)))
        swap = await asyncio.wait_for(rebuilds.get(), 30)  # bound: jobs_relist_s, a store timeout, a tick
        while swap.generation == 1:
            swap = await asyncio.wait_for(rebuilds.get(), 30)
    finally:
        announcing.cancel()
    assert swap.generation == 2 and swap.ranks == ["r0", "sp"], swap
