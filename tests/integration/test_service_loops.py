"""The services' own loops keep going when one pass fails, and hold a bounded amount while they cannot
say what they decided (issue 21's audit of every asyncio loop: a computed timeout that can reach 0, a
retry without pause or cap, a held list without bound).

A real nats-server; the services run in this process, so one pass can be made to fail on purpose.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nats.aio.client import Client
from structlog.testing import capture_logs

from deadpool_detector.core import DetectorConfig
from deadpool_detector.service import BEATS_BACKLOG_MAX, DetectorService, DetectorServiceConfig
from deadpool_protocol import (
    Commit,
    Failure,
    Heartbeat,
    HeartbeatBatch,
    HelloReply,
    MemberHello,
    Rebuild,
    SnapshotComplete,
    StoreAddress,
    Subjects,
    encode,
)
from deadpool_runtime import ensure_events_stream
from deadpool_runtime.events import stream_position
from deadpool_runtime.logs import get_logger
from deadpool_swapper.core import Decision, Publish, SwapperConfig, SwapperCore
from deadpool_swapper.job_records import JobRecords
from deadpool_swapper.job_worker import HELD_MAX, REPLIES_HELD_MAX, Event, Hello, JobWorker

WAIT_S = 20.0


async def test_a_failing_detector_pass_does_not_end_the_detector(nc: Client, nats_url: str) -> None:
    """A pass that raises (a bug, or a publish refused while NATS is away) used to end the detector's
    loop, and with it every verdict."""
    service = DetectorService(DetectorServiceConfig(nats_url, DetectorConfig(), check_period_s=0.01), nc, get_logger())
    passes = {"failed": 0, "after": 0}
    real_check = service.core.check

    def check(now: float, hang_rules: bool = True, timeouts: bool = True) -> Any:
        if passes["failed"] < 3:
            passes["failed"] += 1
            raise RuntimeError("a pass that fails")
        passes["after"] += 1
        return real_check(now, hang_rules, timeouts)

    service.core.check = check  # type: ignore[method-assign]
    stop = asyncio.Event()
    running = asyncio.create_task(service.run(stop))
    deadline = time.monotonic() + WAIT_S
    while passes["after"] < 5:
        assert not running.done(), "the detector's loop ended"
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(running, WAIT_S)


async def test_a_job_worker_holds_a_bounded_amount_while_its_record_cannot_be_saved(nc: Client) -> None:
    log = get_logger()
    records = await JobRecords.open(nc.jetstream(timeout=2.0), log, 1, nc.max_payload)
    await ensure_events_stream(nc)
    core = SwapperCore(SwapperConfig())
    worker = JobWorker("bounds", core, records, nc, log, _nothing, _no_fence, lambda: True, await stream_position(nc))
    repeat = Publish(Commit("bounds", 1, 7))
    for _ in range(100):  # the same command retransmitted while nothing can be saved: held once
        worker._take(Decision([repeat], "tick", routine=True))
    assert worker._held.count(repeat) == 1
    for step in range(HELD_MAX + 500):
        worker._take(Decision([Publish(Commit("bounds", 1, 100 + step))], "commit"))
    assert len(worker._held) == HELD_MAX and worker._held[-1].message == Commit("bounds", 1, 100 + HELD_MAX + 499)
    hello = MemberHello("bounds", 0, "m0", "h", 1, "l0", 0, 1, "127.0.0.1", 4000, 0.0)
    for _ in range(REPLIES_HELD_MAX + 10):
        worker._replies.append((Hello(hello), HelloReply("bounds", 0, "m0", True, "")))
        worker._take(Decision([], "hello"))
    assert len(worker._replies) == REPLIES_HELD_MAX


async def _nothing(_: Publish) -> None:
    return None


async def _no_fence(_: object) -> float:
    return 0.0


async def test_an_event_that_waited_long_in_the_inbox_is_logged_when_its_wait_is_the_longest_yet(nc: Client) -> None:
    records = await JobRecords.open(nc.jetstream(timeout=2.0), get_logger(), 1, nc.max_payload)
    await ensure_events_stream(nc)
    core, position = SwapperCore(SwapperConfig()), await stream_position(nc)
    worker = JobWorker("waits", core, records, nc, get_logger(), _nothing, _no_fence, lambda: True, position)
    now = time.monotonic()
    with capture_logs() as logs:
        for seq, waited_s in ((1, 1.0), (2, 0.8), (3, 0.1), (4, 1.5)):
            complete = SnapshotComplete("waits", 1, "store0", seq, [0], [10])
            worker._decide(Event(complete, seq, received=now - waited_s), now)
    waits = [
        (line["kind"], line["seq"], line["waited_s"]) for line in logs if line["event"] == "event waited in the inbox"
    ]
    assert waits == [("snapshot_complete", 1, 1.0), ("snapshot_complete", 4, 1.5)]  # 0.8 s was not the longest
    assert worker.unheard_s_max == 1.5


async def test_a_detector_behind_on_reading_heartbeats_declares_nobody_for_the_beats_it_has_not_read(
    nc: Client, nats_url: str
) -> None:
    """A detector starved of CPU reads beats late; it once declared 576 members, then 5,250, whose
    beats waited unread (8,192 simulated members on 2 cores). Here its batch handler is held for
    three heartbeat timeouts while the member keeps beating: the unread beats hold the verdict back,
    and once they are read nobody is declared."""
    config = DetectorConfig(heartbeat_timeout_s=1.0)
    service = DetectorService(DetectorServiceConfig(nats_url, config, check_period_s=0.02), nc, get_logger())
    reading = asyncio.Event()
    reading.set()
    taken = service._on_heartbeat_batch

    async def held(batch: HeartbeatBatch, msg: Any) -> None:
        await reading.wait()
        await taken(batch, msg)

    service._on_heartbeat_batch = held  # type: ignore[method-assign, assignment]
    verdicts: list[Failure] = []
    real_check = service.core.check

    def check(now: float, hang_rules: bool = True, timeouts: bool = True) -> list[Failure]:
        found = real_check(now, hang_rules, timeouts)
        verdicts.extend(found)
        return found

    service.core.check = check  # type: ignore[method-assign]
    stop = asyncio.Event()
    running = asyncio.create_task(service.run(stop))
    subjects = Subjects.for_job("j")
    rebuild = Rebuild(
        "j", 1, 1, ["m0"], [], "m0", "127.0.0.1", 4000, -1, [StoreAddress("s0", "127.0.0.1", 1)], [["s0"]], "", 0.0
    )

    async def beat() -> None:
        now = time.time()
        batch = HeartbeatBatch("j", 1, "l0", [Heartbeat("j", 1, "m0", 0, 100, 3, True, now, now)])
        await nc.publish(subjects.heartbeat_batch, encode(batch))

    deadline = time.monotonic() + WAIT_S
    while "j" not in service.core.jobs or service.core.jobs["j"].members.get("m0") is None:
        await nc.publish(subjects.rebuild, encode(rebuild))
        await beat()
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    reading.clear()
    for _ in range(BEATS_BACKLOG_MAX + 50):  # unread beats: more than the detector's bound
        await beat()
    held_until = time.monotonic() + 3 * config.heartbeat_timeout_s
    while time.monotonic() < held_until:
        await beat()
        await asyncio.sleep(0.05)
    assert not verdicts, [v.member for v in verdicts]
    assert service._behind_since is not None
    reading.set()
    caught_up = time.monotonic() + WAIT_S
    while service._behind_since is not None:
        await beat()
        assert time.monotonic() < caught_up, "the detector never caught up"
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(running, WAIT_S)
    assert not verdicts, [v.member for v in verdicts]
