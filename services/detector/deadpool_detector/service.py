"""`deadpool detector`: turns exit reports, error reports, heartbeat silence and stalled step progress
into `failure` events, and slow ranks into `straggler` events.

Serves every job on the bus. Run two for redundancy: both watch everything and both publish their
verdicts; the swapper handles a failure once per (member, generation), so two verdicts never cause
two swaps. Verdicts and broken-group reports go into the events stream (stored before they count as
sent). Exits, members' own error reports and done reports are read from the stream, from
`replay_s` before the detector started, and the job records in KV say which ranks and spares each
job has: a detector that restarts watches them at once and declares a rank whose heartbeat does not
come back, and sees an exit that happened while it was down. A verdict is published again until a
rebuild answers it (`DetectorCore.repeats`), and the publisher retries each one until it is stored,
however long JetStream is away.

Every duration here is measured on the monotonic clock; the wall clock only stamps what is reported
(and the stream's replay start, which JetStream compares with its own wall-clock stamps).

A `nats.micro` service (`deadpool-detector`); its `status` endpoint answers with the members it
watches.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import statistics
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import BucketNotFoundError, KeyNotFoundError
from nats.micro import add_service
from nats.micro.request import Request

from deadpool_detector.core import DetectorConfig, DetectorCore
from deadpool_protocol import (
    ChildExit,
    Failure,
    Heartbeat,
    HeartbeatBatch,
    JobFinished,
    MemberDone,
    MemberError,
    Message,
    ProtocolError,
    Rebuild,
    Subjects,
)
from deadpool_protocol.events import DETECTOR_EVENTS, event_subjects
from deadpool_protocol.job_record import JOBS_BUCKET, is_record_key, unpack_record
from deadpool_protocol.subjects import service_inbox
from deadpool_runtime import (
    EventPublisher,
    EventReader,
    ensure_events_stream,
    publish,
    run_nats_service,
    stopped_within,
    subscribe_validated,
)
from deadpool_runtime.event_loop import IO_WAIT_MIN_S, coalescing_loop
from deadpool_runtime.job_record_kv import bucket_keys, read_record
from deadpool_runtime.log_limit import RefusalLog
from deadpool_runtime.tracing import Tracing

__all__ = ["DetectorServiceConfig", "main"]

VERSION = "0.1.0"
HANG_RULES_PERIOD_S = 0.25
"""The rules that wait seconds (hangs, a rank stuck in its rebuild, a broken group: `hang_floor_s`,
`rebuild_lag_s`, `regroup_wait_s`) run this often; the heartbeat timeout every check period. Each is
a scan of every member: at 4,096 members they were a sixth of the detector's CPU at 20 passes a second."""
REVIEW_PERIOD_S = 1.0
"""Stragglers and culprit-less stalls are reviewed this often (verdicts run every check period)."""
START_RETRY_S = 0.5
REFUSALS_LOGGED_MAX = 10_000
"""Distinct refused heartbeats logged (then refusals go unlogged, not the detector's memory)."""
TRACES_KEPT = 10_000
"""Failures whose trace context is remembered, for when they are published again (least recently
published first out: a verdict still repeated stays)."""
REPEATS_LOGGED_MAX = 20
"""Verdicts named in the one log line of a pass that published verdicts again."""
KV_KEYS_TIMEOUT_S = 5.0
KV_GET_TIMEOUT_S = 2.0
EVENT_REREAD_S = 0.2
UNRECORDED_KEPT = 1024
"""Jobs remembered to have no record (`_load_job`), oldest out first."""
BEATS_BACKLOG_MAX = 256
"""Heartbeat messages received and not read yet past which the detector is behind: their silence is
not silence, so no verdict is drawn from it until they are read."""
INTAKE_ROUND_TRIP_MAX_S = 1.0
"""How long a verdict of silence waits for the round trip to the server that makes sure the beats on
their way here are read (`_read_beats_on_their_way`); past it the detector counts as behind."""
INTAKE_READ_MAX_S = 0.25
"""How long, after that round trip, the beats it brought in may take to be handed to the core."""
BEHIND_DEFER_MAX_S = 5.0
"""How long verdicts wait for the detector to catch up; past it they are drawn from what was read
(an overloaded detector must still find a failure), and it says so."""
"""The least time between two reads of one job's record for exits and reports of unnamed members (the
events reader waits for each read)."""


@dataclass(frozen=True)
class DetectorServiceConfig:
    nats_url: str
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    check_period_s: float = 0.05
    replay_s: float = 60.0
    """At start, exits and error reports this far back are read again (they may have come while the
    detector was down; ones about members already replaced are ignored)."""
    js_replicas: int = 1
    nkey_file: str = ""
    """The detector role's NATS nkey seed ('' where the server has no auth)."""
    trace_file: str = ""
    """JSON-lines spans when no OTLP endpoint is configured (default: `DEADPOOL_TRACE_FILE`)."""
    io_wait_min_s: float = IO_WAIT_MIN_S
    """Its event loop waits for I/O at most once per this (`deadpool_runtime.event_loop`): the launchers'
    batches are read several at a time, not one wake-up each. 0: asyncio's own loop; at most
    `IO_WAIT_MAX_S`."""

    def __post_init__(self) -> None:
        coalescing_loop(self.io_wait_min_s)  # raises ValueError for a wait out of bounds


class DetectorService:
    def __init__(self, config: DetectorServiceConfig, nc: Client, log: Any) -> None:
        self.config = config
        self.nc = nc
        self.log = log
        self.core = DetectorCore(config.detector)
        self.events = EventPublisher(nc, log)
        self._last_check = time.monotonic()
        self._was_connected = True
        self._beat_subscriptions: list[Subscription] = []
        self._behind_since: float | None = None
        self._stalls_logged: dict[str, list[str]] = {}
        self._last_review = 0.0
        self._hang_rules_t = 0.0
        self._refusals_logged: set[tuple[str, str, str]] = set()
        self._refusals = RefusalLog(log)
        self.tracing = Tracing("deadpool-detector", config.trace_file)
        self._naming: dict[str, asyncio.Task[None]] = {}
        """Reads of a job's record under way, for members heard of and not named (`records_wanted`)."""
        self._unrecorded: dict[str, float] = {}
        """Jobs a report named whose record was not there, and when that was read."""
        self._traces: OrderedDict[tuple[str, str, int], str] = OrderedDict()
        """(job, member, generation) -> the trace its failure started (a failure published again joins it)."""

    async def _check(self) -> None:
        """One pass: verdicts, unless the detector itself just missed time (its outage, its pause)."""
        now = time.monotonic()
        connected = self.nc.is_connected
        paused_s = now - self._last_check
        self._last_check = now
        if not connected:
            self._was_connected = False
            return  # heartbeats cannot reach us: silence means nothing now
        if not self._was_connected or paused_s > self.config.detector.heartbeat_timeout_s / 2:
            self._was_connected = True
            self.core.grace(now)
            self.log.warning("detector missed time; every member's clocks restarted", missed_s=round(paused_s, 3))
            return
        overdue = self.core.overdue(now)
        read_all = True
        if overdue:
            read_all = await self._read_beats_on_their_way()
            now = self._last_check = time.monotonic()  # the wait is the detector's, not a missed stretch
        if self._behind(now, read_all):
            return
        hang_rules = now - self._hang_rules_t >= HANG_RULES_PERIOD_S
        if hang_rules:
            self._hang_rules_t = now
        self._emit(self.core.check(now, hang_rules, timeouts=overdue))
        self._emit_again(self.core.repeats(now))
        for job in self.core.records_wanted(now):
            if job not in self._naming:
                self._naming[job] = asyncio.create_task(self._naming_task(job))
        for broken in self.core.broken_groups(now) if hang_rules else []:
            self.log.warning(
                "process group broken, every rank alive and awaiting a rebuild",
                job=broken.job,
                generation=broken.generation,
                evidence=broken.evidence,
            )
            self.events.publish_soon(Subjects.for_job(broken.job).group_broken, broken)
        if now - self._last_review < REVIEW_PERIOD_S:
            return
        self._last_review = now
        pruned = self.core.prune(now)
        if pruned:
            self.log.info("jobs forgotten: finished, or nothing heard of them for long", jobs=pruned[:20])
        for event in self.core.stragglers(now):
            self.log.warning("straggler", job=event.job, member=event.member, rank=event.rank, evidence=event.evidence)
            await publish(self.nc, Subjects.for_job(event.job).straggler, event)
        stalls = self.core.stalls(now)
        if stalls != self._stalls_logged:
            for job, members in stalls.items():
                self.log.warning(
                    "job stalled; every stalled rank waits on a peer, no culprit", job=job, members=members
                )
            self._stalls_logged = stalls

    def _emit(self, failures: list[Failure]) -> None:
        for failure in failures:
            self.log.warning(
                "failure detected",
                job=failure.job,
                generation=failure.generation,
                member=failure.member,
                rank=failure.rank,
                reason=failure.reason,
                evidence=failure.described(),
                detect_s=round(failure.t_detected - failure.t_fault, 4),
            )
            self.events.publish_soon(Subjects.for_job(failure.job).failure, self._traced(failure))

    def _emit_again(self, failures: list[Failure]) -> None:
        """Publish verdicts no rebuild answered yet again, each with the trace context it was first sent
        with (the publisher holds one copy of a verdict still in flight)."""
        if not failures:
            return
        self.log.info(
            "failures published again: no rebuild answered them yet",
            count=len(failures),
            failures=[(f.job, f.member, f.generation) for f in failures[:REPEATS_LOGGED_MAX]],
            in_flight=self.events.in_flight,
        )
        for failure in failures:
            self.events.publish_soon(Subjects.for_job(failure.job).failure, self._traced(failure))

    def _traced(self, failure: Failure) -> Failure:
        """The failure with its trace context: a new `detect` span, or the one it was first sent with."""
        if not self.tracing.on:
            return failure
        key = (failure.job, failure.member, failure.generation)
        context = self._traces.get(key)
        if context is not None:
            self._traces.move_to_end(key)
        else:
            attrs = {
                "job": failure.job,
                "generation": failure.generation,
                "rank": failure.rank,
                "member": failure.member,
                "reason": failure.reason,
            }
            context = self.tracing.record("detect", "", failure.t_fault, failure.t_detected, attrs)
            self._traces[key] = context
            while len(self._traces) > TRACES_KEPT:
                self._traces.popitem(last=False)
        return replace(failure, traceparent=context)

    async def _on_heartbeat(self, hb: Heartbeat, _msg: Msg) -> None:
        self._refused(hb.job, hb.member, self.core.on_heartbeat(hb, time.monotonic()))

    async def _on_heartbeat_batch(self, batch: HeartbeatBatch, _msg: Msg) -> None:
        for member, reason in self.core.on_batch(batch, time.monotonic()):
            self._refused(batch.job, member, reason)

    def _refused(self, job: str, member: str, reason: str) -> None:
        """Log a refused heartbeat, once per (job, member, reason) so a flood cannot fill the log."""
        if reason and len(self._refusals_logged) < REFUSALS_LOGGED_MAX:
            key = (job, member, reason)
            if key not in self._refusals_logged:
                self._refusals_logged.add(key)
                self._refusals.warning("heartbeat refused", job=job, member=member, reason=reason)

    async def _on_rebuild(self, rebuild: Rebuild, _msg: Msg) -> None:
        self.core.on_rebuild(rebuild, time.monotonic())

    async def _on_event(self, event: Message, _seq: int) -> None:
        if isinstance(event, ChildExit | MemberError) and self.core.unnamed_refusal(event.job, event.member):
            if event.job not in self.core.jobs:
                await self._load_job(event.job)  # a job this detector never heard of: a restart found no record
            elif self.core.claim_record_read(event.job, time.monotonic(), EVENT_REREAD_S):
                await self._name_from_record(event.job)  # a member accepted since the last rebuild is listed there
        now = time.monotonic()
        if isinstance(event, ChildExit):
            if refused := self.core.exit_refusal(event):
                self._refusals.warning("child exit refused", job=event.job, member=event.member, reason=refused)
            self._emit(self.core.on_exit(event, now))
        elif isinstance(event, MemberError):
            if (cause := self.core.error_cause(event)) != event.cause:
                self._refusals.warning(
                    "member error taken as the member's own",
                    job=event.job,
                    member=event.member,
                    reason=f"cause {event.cause} claimed for rank {event.rank} in generation {event.generation}",
                    taken_as=str(cause),
                )
            if refused := self.core.unnamed_refusal(event.job, event.member):
                self._refusals.warning("member error refused", job=event.job, member=event.member, reason=refused)
            self._emit(self.core.on_error(event, now))
        elif isinstance(event, MemberDone):
            self.core.on_done(event)

    async def _naming_task(self, job: str) -> None:
        try:
            await self._name_from_record(job)
        finally:
            self._naming.pop(job, None)

    async def _name_from_record(self, job: str) -> None:
        """Read `job`'s record and watch the members heard of that it lists (a spare accepted since the
        last rebuild); the others stay unwatched (`DetectorCore.name_from_record`)."""
        try:
            kv = await self.nc.jetstream(timeout=KV_GET_TIMEOUT_S).key_value(JOBS_BUCKET)
            stored = await read_record(kv, job, KV_GET_TIMEOUT_S, groups=("summary",))
            if stored is None:
                return
            summary, _ = unpack_record(stored.record)
        except (TimeoutError, nats.errors.Error, ProtocolError) as exc:
            self.log.warning("job record not read for unnamed members", job=job, reason=repr(exc))
            return
        named = self.core.name_from_record(summary, time.monotonic())
        if named:
            self.log.info("members named by the job record: watched", job=job, members=named[:20], count=len(named))

    async def _load_job(self, job: str) -> None:
        """Watch `job` as its record says, for a report about a job this detector has no view of: a
        restart's listing of the records (`_load_jobs`) once came back empty under load while the job
        ran, and the exit of a rank killed meanwhile was refused for good. A job without a record is
        not read again for `EVENT_REREAD_S` (a flood of reports about no job costs nothing)."""
        now = time.monotonic()
        watching_enough = len(self.core.jobs) >= self.core.config.jobs_max
        if watching_enough or now - self._unrecorded.get(job, -math.inf) < EVENT_REREAD_S:
            return
        try:
            kv = await self.nc.jetstream(timeout=KV_GET_TIMEOUT_S).key_value(JOBS_BUCKET)
            stored = await read_record(kv, job, KV_GET_TIMEOUT_S, groups=("summary",))
            summary = None if stored is None else unpack_record(stored.record)[0]
        except (TimeoutError, nats.errors.Error, ProtocolError) as exc:
            self.log.warning("job record not read for a report", job=job, reason=repr(exc))
            return
        if summary is None or summary.finished:
            self._unrecorded[job] = now
            if len(self._unrecorded) > UNRECORDED_KEPT:
                self._unrecorded.pop(next(iter(self._unrecorded)))
            return
        self.core.load_job(summary, time.monotonic())
        self.log.info("job loaded from its record for a report", job=job, generation=summary.generation)

    async def _load_jobs(self) -> None:
        """Each running job's ranks, spares and declared members, from the job records (if any)."""
        js = self.nc.jetstream(timeout=5.0)
        try:
            kv = await js.key_value(JOBS_BUCKET)
            keys = await bucket_keys(kv, KV_KEYS_TIMEOUT_S)
        except BucketNotFoundError:
            return
        if not keys:
            self.log.info("no job records to load")
            return
        now = time.monotonic()
        for key in filter(is_record_key, keys):  # not a record's parts, nor an archived run
            try:
                stored = await read_record(kv, key, KV_GET_TIMEOUT_S, groups=("summary",))
                if stored is None:
                    continue
                summary, _ = unpack_record(stored.record)
            except (KeyNotFoundError, ProtocolError) as exc:
                self.log.warning("job record not loaded", job=key, reason=str(exc))
                continue
            if not summary.finished:
                self.core.load_job(summary, now)
                self.log.info("job loaded from its record", job=key, generation=summary.generation)

    async def _start_events(self, stop: asyncio.Event) -> EventReader | None:
        """Job records, then the events reader, retrying until JetStream answers."""
        while not stop.is_set():
            try:
                await ensure_events_stream(self.nc, self.config.js_replicas)
                await self._load_jobs()
                break
            except (TimeoutError, nats.errors.Error) as exc:
                self.log.warning("JetStream not ready: retrying", error=repr(exc))
                if await stopped_within(stop, START_RETRY_S):
                    return None
        reader = EventReader(
            self.nc,
            event_subjects("*", DETECTOR_EVENTS),
            self._on_event,
            self.log,
            (ChildExit, MemberError, MemberDone),
        )
        await reader.start(stop, start_time=time.time() - self.config.replay_s)
        return reader

    async def _on_finished(self, finished: JobFinished, _msg: Msg) -> None:
        self.core.on_finished(finished, time.monotonic())

    async def _status_endpoint(self, req: Request) -> None:
        now = time.monotonic()
        body = {
            job: {
                "generation": view.generation,
                "finished": view.finished,
                "watched": {
                    m: {
                        "rank": w.rank,
                        "step": w.last_step,
                        "done": w.done,
                        "host": w.host,
                        "phase": w.phase,
                        "rebuild_state": w.rebuild_state,
                        "local_step": w.local_step,
                        "snapshot_every": w.snapshot_every,
                        "heartbeat_age_s": round(now - w.last_seen, 3),
                    }
                    for m, w in view.members.items()
                },
                "declared": sorted(view.declared),
                "median_step_s": round(statistics.median(view.step_times), 4) if view.step_times else None,
            }
            for job, view in self.core.jobs.items()
        }
        for job, view in self.core.jobs.items():
            body[job]["hang_threshold_s"] = round(self.core.hang_threshold_s(view), 3)
        await req.respond(json.dumps(body).encode())

    async def _read_beats_on_their_way(self) -> bool:
        """Whether every heartbeat the server held for this detector is read (True), or the round trip
        that makes sure of it took longer than its bound (False).

        A silence is declared only once the beats already sent to the detector are read: a ping to the
        server, whose answer comes after every message it queued for us before it, then the beats that
        answer brought in handed to the core. Beats wait unread, outside `_behind`'s view (in the
        server's buffers, in this socket), when the detector or its host is starved for a moment: at
        16,384 simulated members whole hosts were declared 20 ms before their beats, sent 0.46 s
        earlier, were read. One round trip per pass that finds a silence."""
        try:
            await self.nc.flush(timeout=INTAKE_ROUND_TRIP_MAX_S)  # type: ignore[arg-type]
        except (nats.errors.Error, TimeoutError):  # late, or the connection lost meanwhile
            return False
        arrived = [sub.delivered for sub in self._beat_subscriptions]
        deadline = time.monotonic() + INTAKE_READ_MAX_S
        while time.monotonic() < deadline:
            if all(
                sub.delivered - sub.pending_msgs >= n for sub, n in zip(self._beat_subscriptions, arrived, strict=True)
            ):
                return True
            await asyncio.sleep(0)  # the subscriptions' tasks hand what arrived to the core
        return False

    def _behind(self, now: float, read_all: bool = True) -> bool:
        """Whether heartbeats wait unread (the detector starved of CPU: at 8,192 simulated members on
        2 cores it once declared 576 members, then 5,250, whose beats it had not read), or were not
        all read before a verdict of silence (`read_all`, from `_read_beats_on_their_way`). Verdicts
        wait for them, at most `BEHIND_DEFER_MAX_S`."""
        backlog = sum(sub.pending_msgs for sub in self._beat_subscriptions)
        if read_all and backlog <= BEATS_BACKLOG_MAX:
            if self._behind_since is not None:
                self.log.info("detector caught up on heartbeats", behind_s=round(now - self._behind_since, 3))
            self._behind_since = None
            return False
        if self._behind_since is None:
            self._behind_since = now
            self.log.warning("detector behind on heartbeats: verdicts wait for them", unread=backlog)
        if now - self._behind_since < BEHIND_DEFER_MAX_S:
            return True
        self._refusals.warning("detector behind on heartbeats for long: verdicts from what was read", unread=backlog)
        return False

    async def run(self, stop: asyncio.Event) -> None:
        s = Subjects.any_job()
        for subject, kind, handler in (
            (s.heartbeat, Heartbeat, self._on_heartbeat),
            (s.heartbeat_batch, HeartbeatBatch, self._on_heartbeat_batch),
            (s.rebuild, Rebuild, self._on_rebuild),
            (s.finished, JobFinished, self._on_finished),
        ):
            sub = await subscribe_validated(self.nc, subject, kind, handler, self.log)  # type: ignore[arg-type]
            if kind in (Heartbeat, HeartbeatBatch):
                self._beat_subscriptions.append(sub)
        reader = await self._start_events(stop)
        service = await add_service(
            self.nc,
            name="deadpool-detector",
            version=VERSION,
            description="DeadPool failure detector",
            metadata={"host": socket.gethostname()},
        )
        await service.add_endpoint(name="status", subject="deadpool.detector.status", handler=self._status_endpoint)
        c = self.config.detector
        self.log.info(
            "detector ready",
            heartbeat_timeout_s=c.heartbeat_timeout_s,
            hang_factor=c.hang_factor,
            hang_floor_s=c.hang_floor_s,
            first_step_s=c.first_step_s,
        )
        while True:
            try:
                await self._check()
            except Exception:  # a bug, or a publish refused while NATS is away: the next pass goes on
                self.log.exception("detector pass failed; going on")
            if await stopped_within(stop, self.config.check_period_s):
                break
        if reader is not None:
            await reader.stop()
        await self.events.drain(2.0)
        await service.stop()
        self.tracing.shutdown()


def main(config: DetectorServiceConfig) -> None:
    run_nats_service(
        "detector",
        config.nats_url,
        "deadpool-detector",
        lambda nc, log, stop: DetectorService(config, nc, log).run(stop),
        config.nkey_file,
        service_inbox("detector"),
        loop_factory=coalescing_loop(config.io_wait_min_s),
    )
