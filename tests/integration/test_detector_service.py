"""A real detector process on a real NATS server: exits and silence become exactly one failure each."""

from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest
from nats.aio.client import Client

from deadpool_cli.nats_server import NatsServer
from deadpool_detector import core as detector_core
from deadpool_detector import service as detector_service
from deadpool_detector.core import DetectorConfig
from deadpool_detector.service import DetectorService, DetectorServiceConfig
from deadpool_protocol import ChildExit, Failure, Heartbeat, MemberError, Rebuild, Subjects, decode, encode
from deadpool_runtime import ensure_events_stream
from deadpool_runtime.logs import get_logger
from deadpool_swapper.core import JobState
from deadpool_swapper.job_parts import Membership, Recovery
from deadpool_swapper.job_records import JobRecords
from deadpool_swapper.placement import MemberInfo

from .conftest import SpawnService, wait_for_micro_service

S = Subjects.for_job("j")


async def failures_of(nc: Client) -> asyncio.Queue[Failure]:
    queue: asyncio.Queue[Failure] = asyncio.Queue()

    async def on_failure(msg: object) -> None:
        await queue.put(decode(msg.data, Failure))  # type: ignore[attr-defined]

    await nc.subscribe(S.failure, cb=on_failure)
    await nc.flush()
    return queue


async def named(nc: Client, ranks: list[str], spares: list[str] = []) -> None:  # noqa: B006 (read only)
    """Publish generation 1's rebuild naming `ranks` and `spares`, as the swapper would, and wait until the
    detector watches them (it watches only members a rebuild or the job record named)."""
    rebuild = Rebuild(
        "j", 1, len(ranks), ranks, spares, ranks[0], "127.0.0.1", 4000, -1, [], [[] for _ in ranks], "", 0
    )
    deadline = time.monotonic() + 10
    while not set(ranks + spares) <= set(await watched(nc)):
        assert time.monotonic() < deadline, "the detector never watched the rebuild's members"
        await nc.publish(S.rebuild, encode(rebuild))  # again: the detector may have subscribed after it
        await asyncio.sleep(0.1)  # polling a status: the detector answers nothing when it reads a rebuild


async def test_each_dead_member_yields_exactly_one_failure(nc: Client, spawn_service: SpawnService) -> None:
    spawn_service("detector", "--heartbeat-timeout-s", "30", "--hang-floor-s", "60")
    await wait_for_micro_service(nc, "deadpool-detector")
    await named(nc, ["m0", "m1"], ["m2"])
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
    sent = -1

    async def beats() -> None:
        nonlocal sent
        while True:
            sent += 1
            await nc.publish(S.heartbeat, encode(Heartbeat("j", 1, "quiet", 0, 77, sent, True, 0.0, time.time())))
            await asyncio.sleep(0.1)

    beating = asyncio.create_task(beats())
    try:
        await named(nc, ["quiet"])
    finally:
        beating.cancel()
    failure = await asyncio.wait_for(failures.get(), 10)
    assert (failure.member, failure.reason, failure.rank) == ("quiet", "heartbeat", 0)
    assert failure.evidence["last_step"] == str(sent)
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
    await named(nc, ["m0", "m9"])
    await nc.publish(S.child_exit, encode(ChildExit("j", 1, "l0", "m9", 1, 1, time.time())))
    failure = await asyncio.wait_for(failures.get(), 10)
    assert failure.member == "m9"


class SteppedClock:
    """`time` as the detector's modules see it: the real monotonic clock, and a wall clock `step_s` off."""

    def __init__(self) -> None:
        self.step_s = 0.0

    def time(self) -> float:
        return time.time() + self.step_s

    def monotonic(self) -> float:
        return time.monotonic()


async def test_wall_clock_steps_of_an_hour_neither_fire_nor_delay_a_verdict(
    nats_url: str, nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The heartbeat and hang clocks were wall-clock: a member silent since just before a 1 h step back
    was declared an hour late."""
    clock = SteppedClock()
    monkeypatch.setattr(detector_service, "time", clock)
    monkeypatch.setattr(detector_core, "time", clock, raising=False)
    config = DetectorServiceConfig(nats_url, DetectorConfig(heartbeat_timeout_s=1.0, hang_floor_s=3, first_step_s=600))
    detector_nc = await nats.connect(nats_url)
    stop = asyncio.Event()
    running = asyncio.create_task(DetectorService(config, detector_nc, get_logger(test="clock-step")).run(stop))
    failures = await failures_of(nc)
    quiet = asyncio.Event()

    async def beats() -> None:
        while True:
            for member, rank in (("steady", 0), ("quiet", 1)):
                if member != "quiet" or not quiet.is_set():
                    await nc.publish(
                        S.heartbeat, encode(Heartbeat("j", 1, member, rank, 77, 5, True, 0.0, time.time()))
                    )
            await asyncio.sleep(0.1)

    beating = asyncio.create_task(beats())
    try:
        await wait_for_micro_service(nc, "deadpool-detector")
        await named(nc, ["steady", "quiet"])
        clock.step_s = 3600.0
        await asyncio.sleep(2.0)  # two heartbeat timeouts of beats after the step forward: the fault's size
        assert failures.empty(), "nobody stopped beating: no verdict"
        quiet.set()  # a member falls silent, and the wall clock steps back an hour
        clock.step_s = -3600.0
        failure = await asyncio.wait_for(failures.get(), 5.0)
        assert (failure.member, failure.reason) == ("quiet", "heartbeat")
        assert abs(failure.t_detected - (time.time() - 3600.0)) < 5.0  # stamped by the wall clock as it reads now
        await asyncio.sleep(1.5)
        later = [failures.get_nowait() for _ in range(failures.qsize())]
        assert {f.member for f in later} <= {"quiet"}, "only the silent member is declared (its verdict repeated)"
    finally:
        beating.cancel()
        stop.set()
        await asyncio.wait_for(running, 10)
        await detector_nc.close()


class HeldLink:
    """A TCP relay between the detector and the NATS server whose server-to-detector direction can be
    held: what the server sends waits (in this relay, the sockets' buffers, the server's), as it does
    when the detector or its host is starved for a moment. The detector-to-server direction flows."""

    def __init__(self, server_port: int) -> None:
        self.server_port = server_port
        self.flowing = asyncio.Event()
        self.flowing.set()
        self._server: asyncio.Server | None = None
        self._pumps: list[asyncio.Task[None]] = []

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.server_port)
        self._pumps += [
            asyncio.create_task(self._pump(reader, upstream_writer, None)),
            asyncio.create_task(self._pump(upstream_reader, writer, self.flowing)),
        ]

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, gate: asyncio.Event | None) -> None:
        try:
            while data := await reader.read(65536):
                if gate is not None:
                    await gate.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        self.flowing.set()
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def test_beats_held_on_their_way_to_the_detector_are_read_before_a_verdict(
    nats_server: NatsServer, nc: Client
) -> None:
    """At 16,384 simulated members the detector declared whole hosts of healthy members 20 ms before
    it read their beats, sent 0.46 s earlier: the beats waited in the server's buffers and its socket
    while it was starved, where its count of unread messages does not look. Here everything the server
    sends the detector is held for longer than the heartbeat timeout while one member goes on beating
    and another falls silent: only the silent one is declared."""
    link = HeldLink(nats_server.port)
    config = DetectorServiceConfig(await link.start(), DetectorConfig(heartbeat_timeout_s=1.0, hang_floor_s=30))
    detector_nc = await nats.connect(config.nats_url)
    stop = asyncio.Event()
    running = asyncio.create_task(DetectorService(config, detector_nc, get_logger(test="held-beats")).run(stop))
    failures = await failures_of(nc)
    quiet = asyncio.Event()

    async def beats() -> None:
        step = 0
        while True:
            step += 1
            for member, rank in (("steady", 0), ("quiet", 1)):
                if member != "quiet" or not quiet.is_set():
                    hb = Heartbeat("j", 1, member, rank, 77, step, True, 0.0, time.time())
                    await nc.publish(S.heartbeat, encode(hb))
            await asyncio.sleep(0.1)

    beating = asyncio.create_task(beats())
    try:
        await wait_for_micro_service(nc, "deadpool-detector")
        await named(nc, ["steady", "quiet"])
        link.flowing.clear()  # the detector reads nothing from here on: beats, and answers to its pings
        quiet.set()
        await asyncio.sleep(1.5)  # past the heartbeat timeout of both, by what the detector could read
        link.flowing.set()
        failure = await asyncio.wait_for(failures.get(), 5.0)
        assert (failure.member, failure.reason) == ("quiet", "heartbeat")
        await asyncio.sleep(1.5)
        later = [failures.get_nowait() for _ in range(failures.qsize())]
        assert {f.member for f in later} <= {"quiet"}, "the member that beat on is not declared"
    finally:
        beating.cancel()
        link.flowing.set()
        stop.set()
        await asyncio.wait_for(running, 10)
        await detector_nc.close()
        await link.close()


async def test_a_detector_that_cannot_read_what_is_on_its_way_still_declares_after_its_bound(
    nats_server: NatsServer, nc: Client
) -> None:
    """The round trip before a verdict never comes back while everything the server sends the
    detector is held: each pass counts as behind, and after `BEHIND_DEFER_MAX_S` the detector declares
    from what it read (an overloaded detector must still find a failure), while still held."""
    link = HeldLink(nats_server.port)
    config = DetectorServiceConfig(await link.start(), DetectorConfig(heartbeat_timeout_s=1.0, hang_floor_s=30))
    detector_nc = await nats.connect(config.nats_url)
    stop = asyncio.Event()
    running = asyncio.create_task(DetectorService(config, detector_nc, get_logger(test="never-read")).run(stop))
    failures = await failures_of(nc)
    quiet = asyncio.Event()

    async def beats() -> None:
        while not quiet.is_set():
            await nc.publish(S.heartbeat, encode(Heartbeat("j", 1, "quiet", 0, 77, 1, True, 0.0, time.time())))
            await asyncio.sleep(0.1)

    beating = asyncio.create_task(beats())
    try:
        await wait_for_micro_service(nc, "deadpool-detector")
        await named(nc, ["quiet"])
        link.flowing.clear()
        quiet.set()
        # the timeout, the first round trip, the bound, a pass of a round trip, and room on a busy machine
        held_s = 1.0 + 2 * detector_service.INTAKE_ROUND_TRIP_MAX_S + detector_service.BEHIND_DEFER_MAX_S + 5.0
        failure = await asyncio.wait_for(failures.get(), held_s)  # the link is held all along
        assert (failure.member, failure.reason) == ("quiet", "heartbeat")
        assert failure.t_detected - failure.t_fault >= detector_service.BEHIND_DEFER_MAX_S, "it waited its bound"
    finally:
        beating.cancel()
        link.flowing.set()
        stop.set()
        await asyncio.wait_for(running, 10)
        await detector_nc.close()
        await link.close()


async def watched(nc: Client) -> dict[str, object]:
    reply = await nc.request("deadpool.detector.status", b"", timeout=2.0)
    members: dict[str, object] = json.loads(reply.data).get("j", {}).get("watched", {})
    return members


async def test_a_restarted_detector_whose_listing_of_the_records_came_back_empty_declares_an_exit_by_the_record(
    nats_url: str, nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted detector lists the job records; under load that listing once came back empty while a
    job ran (CI), and the exit of a rank killed while the detector was down was refused for good: no
    beat or rebuild had named its member. A report about a job the detector has no view of now has it
    read that job's record. The empty listing is injected, as nats.py's `NoKeysError` gave it."""
    records = await JobRecords.open(nc.jetstream(timeout=10.0), get_logger(), payload_bytes=nc.max_payload)
    state = JobState("j", run="r", generation=1, membership=Membership(world_size=2), recovery=Recovery(formed=True))
    infos = [MemberInfo(m, "h0", 100 + i, "l0", i, "h0", 29500, 0.0) for i, m in enumerate(["m0", "m1"])]
    state.membership.members = {info.member: info for info in infos}
    state.membership.ranks = ["m0", "m1"]
    await records.save(state, time.monotonic())
    await ensure_events_stream(nc)
    await nc.publish(S.child_exit, encode(ChildExit("j", 1, "l0", "m1", 4321, -9, time.time())))  # while it was down

    async def listing_came_back_empty(_self: DetectorService) -> None:
        return

    monkeypatch.setattr(DetectorService, "_load_jobs", listing_came_back_empty)
    config = DetectorServiceConfig(nats_url, DetectorConfig(heartbeat_timeout_s=30.0, hang_floor_s=60))
    detector_nc = await nats.connect(nats_url)
    stop = asyncio.Event()
    failures = await failures_of(nc)
    running = asyncio.create_task(DetectorService(config, detector_nc, get_logger(test="no-listing")).run(stop))
    try:
        failure = await asyncio.wait_for(failures.get(), 20)
        assert (failure.member, failure.rank, failure.reason) == ("m1", 1, "exit")
    finally:
        stop.set()
        await asyncio.wait_for(running, 10)
        await detector_nc.close()
