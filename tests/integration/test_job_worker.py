"""A job's worker keeps reading its events whatever its deadlines: real NATS, a real events stream and
real job records, the worker driven as the swapper leader drives it.

Seen: with every store of a job lost, the worker computed a deadline in the past (a dead store's
"lost at" moment), called `wait_for(inbox.get(), 0)` (which cancels the read before it runs), and
never read an event again while using most of a core: a rank killed later was never replaced, and
"done" reports went unheard."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from deadpool_protocol import (
    Commit,
    Failure,
    FailureReason,
    GenerationVoid,
    MemberHello,
    Message,
    Rebuild,
    RebuildAck,
    RebuildAckBatch,
    RebuildMarks,
    RestoreSource,
    SnapshotComplete,
    StoreStatus,
    Subjects,
    decode,
)
from deadpool_runtime import EventPublisher, ensure_events_stream
from deadpool_runtime.bus import publish as bus_publish
from deadpool_runtime.events import stream_position
from deadpool_runtime.logs import get_logger
from deadpool_swapper.core import Decision, Fence, Publish, SwapperConfig, SwapperCore
from deadpool_swapper.job_records import JobRecords
from deadpool_swapper.job_worker import Event, JobWorker
from deadpool_swapper.lanes import AHEAD

JOB = "worker-job"
W = 2
STORE_TIMEOUT_S = 0.5
LIVENESS_BOUND_S = 20.0
"""Every event must be handled well within this (a liveness bound, not a timing goal)."""
FENCE_TO_REBUILD_S = 0.5
"""A fence's answer -> its rebuild out, at most: the worker's own reaction, not its next input or tick
(a rebuild's retransmission, a second)."""


class WatchedCore(SwapperCore):
    """The real core, counting its ticks and noting the order in which events reach it."""

    def __init__(self, config: SwapperConfig) -> None:
        super().__init__(config)
        self.ticks = 0
        self.seen: list[tuple[int, int]] = []
        self.acked: list[int] = []
        """The generation of each ack batch that reached the core."""

    def tick_job(self, job: str, now: float) -> Decision:
        self.ticks += 1
        return super().tick_job(job, now)

    def on_snapshot_complete(self, sc: SnapshotComplete, now: float) -> Decision:
        self.seen.append((sc.step, sc.ranks[0]))
        return super().on_snapshot_complete(sc, now)

    def on_ack_batch(self, batch: RebuildAckBatch, now: float) -> Decision:
        self.acked.append(batch.generation)
        return super().on_ack_batch(batch, now)


def ack_batch(generation: int) -> RebuildAckBatch:
    """Launcher l0's batch of r0's ack (of a generation no longer pending: the core ignores it)."""
    marks = RebuildMarks(received=0.0, ready=0.0)
    ack = RebuildAck(JOB, generation, "r0", 0, -1, -1, RestoreSource.FRESH, marks, 0.0)
    return RebuildAckBatch(JOB, generation, "l0", [ack])


def formed(core: SwapperCore, now: float) -> Rebuild:
    """A job of W ranks and a spare, formed, with two stores placed."""
    for i in range(2):
        core.on_store_status(StoreStatus(f"store{i}", "127.0.0.1", 5000 + i, 0, 10**9, 0, 0.0), now)
    decisions = [
        core.on_hello(MemberHello(JOB, 0, m, "h0", 100, "l0", h, W, "127.0.0.1", 4000, 0.0), now)[1]
        for m, h in (("r0", 0), ("r1", 1), ("s0", -1))
    ]
    (formation,) = [
        a.message for d in decisions for a in d.actions if isinstance(a, Publish) and a.message.KIND == "rebuild"
    ]
    assert isinstance(formation, Rebuild)
    for rank, member in enumerate(formation.ranks):
        marks = RebuildMarks(received=0.0, ready=0.0)
        core.on_ack(RebuildAck(JOB, 1, member, rank, -1, -1, RestoreSource.FRESH, marks, 0.0), now)
    assert core.jobs[JOB].recovery.formed and core.jobs[JOB].recovery.pending is None
    return formation


async def test_a_worker_reads_every_event_in_order_with_deadlines_past_and_rules_never_satisfied(
    nc: Client,
) -> None:
    log = get_logger()
    await ensure_events_stream(nc)
    records = await JobRecords.open(nc.jetstream(timeout=2.0), log, 1, nc.max_payload)
    core = WatchedCore(SwapperConfig(replication=2, store_timeout_s=STORE_TIMEOUT_S, last_call_s=0.0))
    now = time.monotonic()
    formed(core, now)
    for store in core.stores.values():  # every store was lost long ago: its "lost at" is in the past
        store.last_seen = now - 100.0
    published: list[Message] = []

    async def publish(action: Publish) -> None:
        published.append(action.message)

    async def fence(_: Fence) -> float:
        return 0.0

    worker = JobWorker(JOB, core, records, nc, log, publish, fence, lambda: True, await stream_position(nc))
    worker.start()
    try:
        await until(
            lambda: core.jobs[JOB].protection.unprotected_since is not None, "the job is known to be unprotected"
        )
        ticks_before = core.ticks
        await asyncio.sleep(1.0)  # nothing arrives: the worker must sleep, not spin
        assert core.ticks - ticks_before <= 3, f"{core.ticks - ticks_before} ticks in 1 s with nothing to do"

        events = EventPublisher(nc, log)
        subjects = Subjects.for_job(JOB)
        sent = [(step, rank) for step in range(1, 21) for rank in range(W)]
        for step, rank in sent:
            stored = await events.publish(
                subjects.snapshot_complete_by("store0"), SnapshotComplete(JOB, 1, "store0", step, [rank], [10])
            )
            assert stored
        await until(lambda: len(core.seen) == len(sent), "every snapshot report handled")
        assert core.seen == sent, "events handled out of order"

        # A rule that can never be satisfied (no store for the vacant rank's rebuild to place on, and
        # none comes) must not stop the worker from hearing the failure, nor make it spin.
        failure = Failure(JOB, 1, "r1", 1, FailureReason.EXIT, {}, time.time(), time.time())
        assert await events.publish(subjects.failure, failure)
        await until(lambda: any(isinstance(m, Rebuild) and m.generation == 2 for m in published), "rank 1 swapped")
        (rebuild,) = [m for m in published if isinstance(m, Rebuild) and m.generation == 2]
        assert rebuild.ranks == ["r0", "s0"] and rebuild.placement == [[], []]  # no store to place on
        assert worker.unheard_s_max < LIVENESS_BOUND_S
        ticks_before = core.ticks
        await asyncio.sleep(1.0)
        assert core.ticks - ticks_before <= 5, f"{core.ticks - ticks_before} ticks in 1 s while a rebuild is pending"
    finally:
        await worker.stop()


async def test_a_new_leader_reads_what_was_stored_after_a_record_saved_on_an_empty_stream(nc: Client) -> None:
    """A job that started on an empty events stream is saved at position 0; a failure stored after
    that save and before a new leader's worker starts must reach the new leader. (Seen: the new worker
    took 0 for "no position" and read from the stream's end: the verdict was skipped, and the job was
    left to the detector's repeats and its ranks' bounds.)"""
    log = get_logger()
    await ensure_events_stream(nc)
    records = await JobRecords.open(nc.jetstream(timeout=2.0), log, 1, nc.max_payload)

    async def publish(_: Publish) -> None:
        pass

    async def fence(_: Fence) -> float:
        return 0.0

    first = SwapperCore(SwapperConfig(replication=2))
    formed(first, time.monotonic())
    old_leader = JobWorker(JOB, first, records, nc, log, publish, fence, lambda: True, await stream_position(nc))
    old_leader.start()
    await until(lambda: first.jobs[JOB].position.stream_id != "", "the job's state placed in the stream")
    await old_leader.stop()
    assert first.jobs[JOB].position.applied_seq == 0  # position 0 of the still empty stream
    await records.save(first.jobs[JOB], time.monotonic())

    failure = Failure(JOB, 1, "r1", 1, FailureReason.EXIT, {}, time.time(), time.time())
    assert await EventPublisher(nc, log).publish(Subjects.for_job(JOB).failure, failure)  # no leader hears it

    now = time.monotonic()
    second = SwapperCore(SwapperConfig(replication=2))
    state = await records.load(JOB, now)
    assert state is not None and state.position.applied_seq == 0
    second.jobs[JOB] = state
    for i in range(2):
        second.on_store_status(StoreStatus(f"store{i}", "127.0.0.1", 5000 + i, 0, 10**9, 0, 0.0), now)
    published: list[Message] = []

    async def keep(action: Publish) -> None:
        published.append(action.message)

    new_leader = JobWorker(JOB, second, records, nc, log, keep, fence, lambda: True, await stream_position(nc))
    new_leader.start()
    try:
        await until(lambda: any(isinstance(m, Rebuild) and m.generation == 2 for m in published), "rank 1 swapped")
        assert state.position.applied_seq == 1
    finally:
        await new_leader.stop()


async def answered_at_once(_: Fence) -> float:
    return 0.0


async def watched_worker(
    nc: Client,
    count: Callable[[WatchedCore], int],
    core_class: type[WatchedCore] = WatchedCore,
    send: bool = False,
    fence: Callable[[Fence], Awaitable[float]] = answered_at_once,
) -> tuple[WatchedCore, JobWorker, list[tuple[Message, int]], int]:
    """A worker, not started, of a formed job whose stores stay live, on real job records: its core (a
    `core_class`), the worker, its publications each with `count(core)` when it went out (`send`: on
    `nc` too, as the swapper publishes), and the stream's last sequence (the worker reads what comes
    after it). Its fences are `fence`'s (each answered at once by default)."""
    log = get_logger()
    await ensure_events_stream(nc)
    records = await JobRecords.open(nc.jetstream(timeout=2.0), log, 1, nc.max_payload)
    core = core_class(SwapperConfig(replication=2, store_timeout_s=LIVENESS_BOUND_S, last_call_s=0.0))
    formed(core, time.monotonic())
    published: list[tuple[Message, int]] = []

    async def publish(action: Publish) -> None:
        published.append((action.message, count(core)))
        if send:
            await bus_publish(nc, action.subject, action.message)

    position = await stream_position(nc)
    return core, JobWorker(JOB, core, records, nc, log, publish, fence, lambda: True, position), published, position[1]


class HeldFences:
    """A launcher's fences, each noted, and answered (saying it took `took_s`) only once `answer` is set."""

    def __init__(self, took_s: float) -> None:
        self.took_s = took_s
        self.asked: list[Fence] = []
        self.answer = asyncio.Event()

    async def __call__(self, fence: Fence) -> float:
        self.asked.append(fence)
        await self.answer.wait()
        return self.took_s


def rebuilds(published: list[tuple[Message, int]]) -> list[Rebuild]:
    return [m for m, _ in published if isinstance(m, Rebuild) and m.generation > 1]


async def test_the_spare_of_a_lost_host_does_not_wait_for_a_fence_nobody_can_answer(nc: Client) -> None:
    """Seen in `test_multi_node.py`: a host whose link went down stays connected on the server until its
    pings go unanswered (tens of seconds), so a fence sent to its launcher gets no "no responders"
    either, and the spare waited the whole fence timeout: 5.00 s of the host's 10.25 s of downtime. A
    member of a lost host is fenced by generation (hello, stores); its fence still goes, and holds
    nothing."""
    gone = HeldFences(0.0)  # the launcher's host is gone: no answer, until cancelled
    core, worker, published, _ = await watched_worker(nc, lambda core: 0, fence=gone)
    worker.start()
    try:
        t = time.time()
        lost = Failure(JOB, 1, "r1", 1, FailureReason.HEARTBEAT, {}, t, t, lost_host="h1", lost_host_members=1)
        assert await EventPublisher(nc, get_logger()).publish(Subjects.for_job(JOB).failure, lost)
        await until(lambda: rebuilds(published), "rank 1 swapped while its launcher never answers")
        assert [(f.member, f.holds_rebuild) for f in gone.asked] == [("r1", False)]
        assert rebuilds(published)[0].ranks == ["r0", "s0"]
        assert core.jobs[JOB].incident_log.open_incidents[0].fence_s == 0.0  # nobody waited for it
    finally:
        await worker.stop()


async def test_a_rebuild_held_by_a_fence_goes_out_as_soon_as_the_fence_answers(nc: Client) -> None:
    """A lone silent member may still run: its rebuild waits for the fence (`Fence.holds_rebuild`),
    then goes out with the fence's answer, not at the worker's next input or tick."""
    launcher = HeldFences(0.05)
    core, worker, published, _ = await watched_worker(nc, lambda core: 0, fence=launcher)
    worker.start()
    try:
        t = time.time()
        silent = Failure(JOB, 1, "r1", 1, FailureReason.HEARTBEAT, {}, t, t)
        assert await EventPublisher(nc, get_logger()).publish(Subjects.for_job(JOB).failure, silent)
        await until(lambda: any(isinstance(m, GenerationVoid) for m, _ in published), "generation 1 voided")
        assert [(f.member, f.holds_rebuild) for f in launcher.asked] == [("r1", True)]
        assert not rebuilds(published), "the rebuild went out before the fence answered"
        answered = time.monotonic()
        launcher.answer.set()
        await until(lambda: rebuilds(published), "rank 1 swapped once fenced")
        assert time.monotonic() - answered < FENCE_TO_REBUILD_S
        assert core.jobs[JOB].incident_log.open_incidents[0].fence_s == 0.05
    finally:
        await worker.stop()


async def test_a_commit_goes_out_before_the_inputs_waiting_behind_its_report(nc: Client) -> None:
    """The worker decides what waits in its inbox together, in one save; a commit decided on the way is
    saved and sent at once, not after the rest. (Seen at 8,192 ranks: a commit waited up to 311 ms
    behind the launchers' acks that came after its store report.)"""
    core, worker, published, last = await watched_worker(nc, lambda core: len(core.seen))
    # Step 1 sealed on both stores (its commit), then 100 reports of step 2 from one store, all waiting
    # in the inbox when the worker starts: a burst, as the events stream hands it over.
    reports = [SnapshotComplete(JOB, 1, f"store{i}", 1, [0, 1], [10, 10]) for i in range(2)]
    reports += [SnapshotComplete(JOB, 1, "store0", 2, [n % W], [10]) for n in range(100)]
    for seq, report in enumerate(reports, last + 1):
        worker.inbox.put_nowait(Event(report, seq))
    worker.start()
    try:
        await until(lambda: len(core.seen) == len(reports), "every report handled")
        await until(lambda: any(isinstance(m, Commit) for m, _ in published), "step 1 committed")
        (commit, seen) = next((m, seen) for m, seen in published if isinstance(m, Commit))
        assert isinstance(commit, Commit) and commit.step == 1
        assert seen == 2, f"the commit went out after {seen - 2} more reports were decided"
        assert core.jobs[JOB].ledger.committed_step == 1  # the later reports committed nothing
    finally:
        await worker.stop()


BUSY_S = 1.0
"""How long the input after a commit holds the worker's loop (a batch's deciding, a save's encoding)."""


class BusyCore(WatchedCore):
    """Holds the loop for `BUSY_S` on each ack batch, noting when it began and ended."""

    def __init__(self, config: SwapperConfig) -> None:
        super().__init__(config)
        self.busy: list[tuple[float, float]] = []

    def on_ack_batch(self, batch: RebuildAckBatch, now: float) -> Decision:
        began = time.monotonic()
        time.sleep(BUSY_S)
        self.busy.append((began, time.monotonic()))
        return super().on_ack_batch(batch, now)


class CommitListener(threading.Thread):
    """Hears the job's commits on a connection and a loop of its own (the worker's may be held), and
    notes when each arrives."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.heard: list[tuple[int, float]] = []
        self.listening = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        asyncio.run(self._listen())

    async def _listen(self) -> None:
        nc = await nats.connect(self.url)

        async def on_commit(msg: Msg) -> None:
            self.heard.append((decode(msg.data, Commit).step, time.monotonic()))

        await nc.subscribe(Subjects.for_job(JOB).commit, cb=on_commit)
        await nc.flush()
        self.listening.set()
        while not self.done.is_set():
            await asyncio.sleep(0.01)
        await nc.close()


async def test_a_commit_is_on_the_wire_before_the_worker_decides_what_came_after_it(nc: Client, nats_url: str) -> None:
    """A publish only queues the commit's bytes: the client's flusher, a task of the worker's loop,
    writes them once the worker yields. At 8,192 ranks the worker went on at once to the next batch's
    deciding and its save's encoding, and a commit waited behind them (the decision to the commit heard
    elsewhere: 180-530 ms p99). Here the input after the commit holds the loop for a second: the commit
    must have reached a listener on another connection by then."""
    core, worker, published, last = await watched_worker(nc, lambda core: len(core.acked), BusyCore, send=True)
    listener = CommitListener(nats_url)
    listener.start()
    assert await asyncio.to_thread(listener.listening.wait, LIVENESS_BOUND_S), "the listener subscribed"
    for seq, store in enumerate(("store0", "store1"), last + 1):
        worker.inbox.put_nowait(Event(SnapshotComplete(JOB, 1, store, 1, [0, 1], [10, 10]), seq))
    worker.inbox.put_nowait(Event(ack_batch(1), last + 3))  # waiting behind the reports: taken next
    worker.start()
    try:
        await until(lambda: len(core.acked) == 1, "the ack batch handled")
        assert isinstance(core, BusyCore)
        (busy_began, busy_ended) = core.busy[0]
        assert [m.step for m, acked in published if isinstance(m, Commit)] == [1]
        await until(lambda: bool(listener.heard), "the commit heard")
        ((step, heard_at),) = listener.heard
        assert step == 1
        assert heard_at < busy_ended - BUSY_S / 2, (
            f"the commit was heard {heard_at - busy_began:.3f} s after the next input began to hold the loop "
            f"({BUSY_S} s): it waited for it"
        )
    finally:
        listener.done.set()
        await worker.stop()
        await asyncio.to_thread(listener.join, LIVENESS_BOUND_S)


async def test_a_report_waiting_behind_a_rebuilds_acks_is_decided_before_them(nc: Client) -> None:
    """The stores' reports are read in a lane of their own, ahead of the rest: a commit waits behind
    none of a rebuild's acks (a batch per host: 1,024 at 8,192 ranks), and each lane's position is its
    own."""
    core, worker, published, last = await watched_worker(nc, lambda core: len(core.acked))
    acks = last + 100
    for seq in range(last + 1, acks + 1):  # stored first: as the stream hands them over
        worker.inbox.put_nowait(Event(ack_batch(1), seq))
    for seq, store in enumerate(("store0", "store1"), acks + 1):
        worker.inbox.put_nowait(Event(SnapshotComplete(JOB, 1, store, 1, [0, 1], [10, 10]), seq), AHEAD)
    worker.start()
    try:
        await until(lambda: len(core.acked) == 100, "every ack batch handled")
        (acked_before,) = [acked for m, acked in published if isinstance(m, Commit)]
        assert acked_before == 0, f"the commit waited behind {acked_before} ack batches"
        state = core.jobs[JOB]
        assert (state.position.applied_seq, state.position.reported_seq) == (acks, acks + 2)
    finally:
        await worker.stop()


async def test_a_new_leader_reads_each_lane_from_its_own_position(nc: Client) -> None:
    """A record saved with the reports' lane ahead of the other (acks stored before a report that was
    applied, themselves not yet): a new leader applies those acks, and not the report again."""
    log = get_logger()
    await ensure_events_stream(nc)
    records = await JobRecords.open(nc.jetstream(timeout=2.0), log, 1, nc.max_payload)
    events = EventPublisher(nc, log)
    subjects = Subjects.for_job(JOB)
    assert await events.publish(subjects.rebuild_ack_batch, ack_batch(1))
    _, ack_seq = await stream_position(nc)
    assert await events.publish(
        subjects.snapshot_complete_by("store0"), SnapshotComplete(JOB, 1, "store0", 1, [0, 1], [10, 10])
    )
    stream_id, report_seq = await stream_position(nc)
    assert report_seq > ack_seq

    core = WatchedCore(SwapperConfig(replication=2, store_timeout_s=LIVENESS_BOUND_S))
    formed(core, time.monotonic())
    position = core.jobs[JOB].position
    position.stream_id, position.applied_seq, position.reported_seq = stream_id, ack_seq - 1, report_seq

    async def publish(_: Publish) -> None:
        pass

    async def fence(_: Fence) -> float:
        return 0.0

    worker = JobWorker(JOB, core, records, nc, log, publish, fence, lambda: True, (stream_id, report_seq))
    worker.start()
    try:
        await until(lambda: core.acked == [1], "the acks not yet applied, applied")
        assert position.applied_seq == ack_seq
        assert await events.publish(subjects.rebuild_ack_batch, ack_batch(1))  # a later one: the lane still reads
        await until(lambda: core.acked == [1, 1], "the next ack batch applied")
        assert core.seen == [] and position.reported_seq == report_seq  # the report was not applied again
    finally:
        await worker.stop()


async def until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + LIVENESS_BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {LIVENESS_BOUND_S} s: {what}"
        await asyncio.sleep(0.02)
