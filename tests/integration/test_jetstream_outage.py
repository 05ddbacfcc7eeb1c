"""JetStream away for longer than the event publisher's old give-up time: the verdict is not lost.

A real 3-node NATS cluster (the events stream and the KV buckets with 3 replicas), a real detector and
a real swapper connected to one node, three members beating on core NATS. Two nodes are SIGKILLed:
JetStream loses its quorum while core NATS goes on through the survivor, so heartbeats still flow.
A member's heartbeats stop; the detector declares it, but its verdict cannot be stored. The outage
lasts longer than the 120 s after which the publisher used to give up (the verdict was then lost for
good: the detector declares a member once, and the job waited until every survivor's own bound ended
it). The two nodes come back: the verdict ends up in the events stream and the swapper swaps the
member.

The survivor is a node that does not lead the events stream, so no publication can sit in the raft
log of a leader cut off from its peers and be committed once they return: while the quorum is gone,
nothing is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import StreamInfo

from deadpool_cli.nats_server import NatsCluster, NatsServer
from deadpool_protocol import (
    Failure,
    Heartbeat,
    HelloReply,
    MemberHello,
    Message,
    Rebuild,
    RebuildAck,
    RebuildMarks,
    RestoreSource,
    Subjects,
    decode,
    encode,
)
from deadpool_protocol.events import EVENTS_STREAM
from deadpool_runtime import EventReader, ensure_events_stream
from deadpool_runtime.logs import get_logger

from .conftest import wait_for_micro_service
from .runs import RUN, start_run
from .test_swapper_service import announce_store, leader_status, queue_of, wait_for_leader

JOB = "outage"
S = Subjects.for_job(JOB)
OLD_PUBLISH_DEADLINE_S = 120.0
"""How long the event publisher retried one event before this test was written (then it gave up)."""
OUTAGE_PAST_DEADLINE_S = 5.0
"""How much longer than that JetStream stays away: the fault's size, not a synchronisation."""
HEARTBEAT_TIMEOUT_S = 2.0
HEARTBEAT_PERIOD_S = 0.1
RECOVERY_WAIT_S = 90.0
"""Bound on the stream coming back (elections) and the verdict being stored and acted on."""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    nodes = NatsCluster(tmp_path / "nats", size=3)
    nodes.start()
    yield nodes
    nodes.stop()


@pytest.fixture
def services(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def spawn(started: list[subprocess.Popen[bytes]], log_dir: Path, url: str, command: str, *args: str) -> None:
    with open(log_dir / f"{command}.log", "wb") as log:
        started.append(
            subprocess.Popen(
                [sys.executable, "-m", "deadpool_cli", command, "--nats", url, "--js-replicas", "3", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        )


@contextlib.asynccontextmanager
async def running(coroutine: Coroutine[Any, Any, Any]) -> AsyncIterator[None]:
    """Run `coroutine` as a task for the block; cancel it after."""
    task = asyncio.create_task(coroutine)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def events_stream_leader(nc: Client) -> str:
    """Create the events stream with 3 replicas and return the node leading it (asked again while the
    new cluster elects its metadata leader, then the stream its leader)."""
    deadline = time.monotonic() + 30.0
    while True:
        with contextlib.suppress(TimeoutError, nats.errors.Error):
            await ensure_events_stream(nc, replicas=3)
        info = await stream_info_or_none(nc)
        if info is not None and info.cluster is not None and info.cluster.leader:
            return info.cluster.leader
        if time.monotonic() > deadline:
            raise AssertionError("the events stream has no leader")
        await asyncio.sleep(0.2)


@pytest.mark.timeout(480)  # JetStream is held away for 125 s on purpose: 145 s measured, 240 s is too close
async def test_a_verdict_made_while_jetstream_is_away_for_longer_than_the_old_give_up_time_is_stored_and_acted_on(
    cluster: NatsCluster, services: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    setup = await nats.connect(cluster.servers[0].url)
    leader = await events_stream_leader(setup)
    await setup.close()
    survivor = next(s for s in cluster.servers if s.name != leader)
    victims: list[NatsServer] = [s for s in cluster.servers if s is not survivor]
    nc = await nats.connect(survivor.url, max_reconnect_attempts=-1)  # core NATS stays up throughout
    spawn(services, tmp_path, survivor.url, "detector", "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S),
          "--hang-floor-s", "3", "--first-step-s", "1000")  # fmt: skip
    spawn(services, tmp_path, survivor.url, "swapper", "--replication", "1")
    await wait_for_micro_service(nc, "deadpool-detector")
    await wait_for_micro_service(nc, "deadpool-swapper")
    await wait_for_leader(nc)
    rebuilds = await queue_of(nc, S.rebuild, Rebuild)
    attempts: asyncio.Queue[Failure] = asyncio.Queue()  # each attempt to store a verdict, stored or not

    async def on_attempt(msg: Msg) -> None:
        await attempts.put(decode(msg.data, Failure))

    await nc.subscribe(S.failure, cb=on_attempt)
    quiet = asyncio.Event()

    async def members_beat() -> None:
        step = 0
        while True:
            step += 1
            for member, rank in (("r0", 0), ("r1", 1), ("sp", -1)):
                if member == "r1" and quiet.is_set():
                    continue
                beat = Heartbeat(JOB, 1, member, rank, 1000 + rank, 0, False, 0.0, time.time(), host=f"h-{member}")
                await nc.publish(S.heartbeat, encode(beat))
            await asyncio.sleep(HEARTBEAT_PERIOD_S)

    async with running(announce_store(nc, 0.5)):  # core NATS: the swapper needs a live store to rebuild
        assert (await start_run(nc, JOB, 2)).accepted
        for member, hint in (("sp", -1), ("r0", 0), ("r1", 1)):  # the spare first: formation names it
            port = 4100 + hint
            hello = MemberHello(JOB, 0, member, f"h-{member}", 1000, "l0", hint, 2, "127.0.0.1", port, 0.0, run=RUN)
            reply = decode((await nc.request(S.hello, encode(hello), timeout=10)).data, HelloReply)
            assert reply.accepted, reply.reason
        formation = await asyncio.wait_for(rebuilds.get(), 10)
        assert formation.generation == 1 and formation.ranks == ["r0", "r1"] and formation.spares == ["sp"]
        async with running(members_beat()):
            for member in formation.ranks:
                now = time.time()
                ack = RebuildAck(
                    JOB, 1, member, formation.rank_of(member), -1, -1, RestoreSource.FRESH, RebuildMarks(ready=now), now
                )
                await nc.publish(S.rebuild_ack, encode(ack))
            while (await leader_status(nc, JOB))["rebuild_pending"]:
                await asyncio.sleep(0.1)  # polling a status: the swapper publishes no event for this

            for victim in victims:
                victim.kill()
            quiet.set()
            first = await asyncio.wait_for(attempts.get(), HEARTBEAT_TIMEOUT_S + 10)
            declared_t = time.monotonic()
            assert (first.member, first.reason) == ("r1", "heartbeat")
            await asyncio.sleep(OLD_PUBLISH_DEADLINE_S + OUTAGE_PAST_DEADLINE_S)
            info = await stream_info_or_none(nc)  # the survivor's replica may answer, but leads nothing
            assert info is None or info.cluster is None or not info.cluster.leader, "the outage did not hold"
            for victim in victims:
                await asyncio.to_thread(victim.start)
            outage_s = time.monotonic() - declared_t

            stored: asyncio.Queue[Failure] = asyncio.Queue()

            async def on_event(event: Message, _seq: int) -> None:
                assert isinstance(event, Failure)
                await stored.put(event)

            stop = asyncio.Event()
            reader = EventReader(nc, [S.failure], on_event, get_logger(test="jetstream-outage"), (Failure,))
            async with running(reader.start(stop, start_seq=1)):
                try:
                    verdict = await asyncio.wait_for(stored.get(), RECOVERY_WAIT_S)
                    swap = await asyncio.wait_for(rebuilds.get(), RECOVERY_WAIT_S)
                    while swap.generation == 1:
                        swap = await asyncio.wait_for(rebuilds.get(), RECOVERY_WAIT_S)
                except TimeoutError:
                    print_service_logs(tmp_path, stored_so_far=stored.qsize())
                    raise
            stop.set()
            await reader.stop()
    assert outage_s > OLD_PUBLISH_DEADLINE_S
    assert (verdict.member, verdict.reason, verdict.generation) == ("r1", "heartbeat", 1)
    assert verdict.traceparent == first.traceparent and verdict.t_detected == first.t_detected  # the same one
    assert swap.generation == 2 and swap.ranks == ["r0", "sp"], swap
    await nc.close()


async def stream_info_or_none(nc: Client) -> StreamInfo | None:
    """The events stream's info, or None when JetStream cannot answer (no quorum)."""
    try:
        return await nc.jetstream(timeout=2.0).stream_info(EVENTS_STREAM)
    except (TimeoutError, nats.errors.Error):
        return None


def print_service_logs(log_dir: Path, **context: object) -> None:
    """What the detector and the swapper said, without their heartbeat lines: on a failure, the
    output says where recovery stopped."""
    print(f"recovery did not complete: {context}")
    for log in sorted(log_dir.glob("*.log")):
        lines = [line for line in log.read_text(errors="replace").splitlines() if "heartbeat" not in line]
        print(f"--- {log.name}: last {min(len(lines), 25)} of {len(lines)} lines")
        for line in lines[-25:]:
            print(line[:240])
