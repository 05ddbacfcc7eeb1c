"""A real detector process on a real NATS server: exits and silence become exactly one failure each."""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client

from deadpool_protocol import ChildExit, Failure, Heartbeat, MemberError, Subjects, decode, encode

from .conftest import SpawnService, wait_for_micro_service

S = Subjects.for_job("j")


async def failures_of(nc: Client) -> asyncio.Queue[Failure]:
    queue: asyncio.Queue[Failure] = asyncio.Queue()

    async def on_failure(msg: object) -> None:
        await queue.put(decode(msg.data, Failure))  # type: ignore[attr-defined]

    await nc.subscribe(S.failure, cb=on_failure)
    await nc.flush()
    return queue


async def test_each_dead_member_yields_exactly_one_failure(nc: Client, spawn_service: SpawnService) -> None:
    spawn_service("detector", "--heartbeat-timeout-s", "30", "--hang-floor-s", "60")
    await wait_for_micro_service(nc, "deadpool-detector")
    failures = await failures_of(nc)
    now = time.time()
    await nc.publish(S.child_exit, encode(ChildExit("j", 1, "l0", "m1", 4321, -9, now)))
    await nc.publish(S.member_error, encode(MemberError("j", 1, "m1", 1, "late error report", now)))
    await nc.publish(S.child_exit, encode(ChildExit("j", 1, "l0", "m1", 4321, -9, now)))  # duplicate
    await nc.publish(S.child_exit, encode(ChildExit("j", 1, "l0", "m2", 4322, 1, now)))
    first = await asyncio.wait_for(failures.get(), 10)
    second = await asyncio.wait_for(failures.get(), 10)
    # Messages on one connection arrive in order, so had m1 been reported twice, the second m1 report
    # would come before m2's.
    assert (first.member, first.reason, first.evidence["signal"]) == ("m1", "exit", "9")
    assert (second.member, second.evidence["returncode"]) == ("m2", "1")


async def test_a_member_whose_heartbeats_stop_is_declared_failed(nc: Client, spawn_service: SpawnService) -> None:
    spawn_service("detector", "--heartbeat-timeout-s", "0.5")
    await wait_for_micro_service(nc, "deadpool-detector")
    failures = await failures_of(nc)
    for step in range(3):
        await nc.publish(S.heartbeat, encode(Heartbeat("j", 1, "quiet", 0, 77, step, True, 0.0, time.time())))
    await nc.flush()
    failure = await asyncio.wait_for(failures.get(), 10)
    assert (failure.member, failure.reason, failure.rank) == ("quiet", "heartbeat", 0)
    assert failure.evidence["last_step"] == "2"
    assert failure.t_detected - failure.t_fault > 0.5


async def test_malformed_messages_are_rejected_and_the_detector_keeps_working(
    nc: Client, spawn_service: SpawnService
) -> None:
    spawn_service("detector", "--heartbeat-timeout-s", "30", "--hang-floor-s", "60")
    await wait_for_micro_service(nc, "deadpool-detector")
    failures = await failures_of(nc)
    await nc.publish(S.child_exit, b"\x93garbage")
    await nc.publish(S.child_exit, encode(Heartbeat("j", 1, "m", 0, 1, 0, False, 0.0, 0.0)))  # wrong kind
    await nc.publish(S.heartbeat, b"")
    await nc.publish(S.child_exit, encode(ChildExit("j", 1, "l0", "m9", 1, 1, time.time())))
    failure = await asyncio.wait_for(failures.get(), 10)
    assert failure.member == "m9"
