"""`deadpool swapper`: the asyncio shell around `SwapperCore`, highly available.

Run two or more. Exactly one leads (`LeaderLease`, a JetStream KV lease); the others stand by and
never act: they answer no hello, publish nothing, write no record. Every instance follows the
stores' announcements, so a new leader can place snapshots at once. On taking the lead, an instance
loads every job's record from KV and starts one `JobWorker` per job, whose reader replays the events
its predecessor had not made durable; the rebuild in flight, if any, is retransmitted and finished, or
superseded by a newer generation. On losing the lead it stops every worker at once.

A `nats.micro` service (`deadpool-swapper`, on every instance, for discovery). The leader alone
answers `deadpool.<job>.member.hello` (member registration) and `deadpool.swapper.status` (job state
as JSON, for `deadpool status`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro import add_service

from deadpool_protocol import (
    SWAPPER_STATUS,
    FenceReply,
    FenceRequest,
    Incident,
    MemberHello,
    ProtocolError,
    Rebuild,
    RebuildDelta,
    RunStart,
    StoreStatus,
    Subjects,
    decode,
    encode,
)
from deadpool_protocol.codec import decode_on, to_fields
from deadpool_protocol.dataplane import job_token, seal_key
from deadpool_protocol.message_parts import MESSAGE_PART_BYTES_MAX
from deadpool_protocol.subjects import STORE_STATUS, service_inbox
from deadpool_runtime import ensure_events_stream, publish, run_nats_service, stopped_within, subscribe_validated
from deadpool_runtime.events import stream_position
from deadpool_runtime.log_limit import RefusalLog
from deadpool_runtime.metrics import Metrics
from deadpool_swapper.core import Fence, JobState, Publish, SwapperConfig, SwapperCore
from deadpool_swapper.job_records import KV_TIMEOUT_S, JobRecords, UnreadableRecordError
from deadpool_swapper.job_worker import Hello, JobWorker, RunRequest
from deadpool_swapper.leader_lease import LeaderLease, LeaseConfig
from deadpool_swapper.tracing import IncidentTracer

__all__ = ["SwapperServiceConfig", "main"]

VERSION = "0.2.0"
INCIDENTS_MEASURED_KEPT = 10_000
VIEW_CHECK_S = 0.1
"""How often the swapper checks that it could hear the stores (its NATS connection, its own loop)."""
STATUS_MARGIN_BYTES = 4096
HELLO_ANSWER_S = 10.0
"""How long a hello may wait for its job's worker (the member retries after its own timeout anyway)."""
START_RETRY_S = 0.5


@dataclass(frozen=True)
class SwapperServiceConfig:
    nats_url: str
    replication: int = SwapperConfig.replication
    fence_timeout_s: float = 5.0
    trace_file: str = ""
    js_replicas: int = 1
    """JetStream replicas of the KV buckets and the events stream (3 on a 3-node NATS cluster)."""
    last_call_s: float = SwapperConfig.last_call_s
    lease: LeaseConfig = field(default_factory=LeaseConfig)
    jobs_relist_s: float = 5.0
    """How often the leader lists the job records again and adopts a running job it has no worker for:
    right after JetStream came back from losing its quorum, the listing made on taking the lead was
    seen to come back empty, and a job nobody drives waits for good."""
    instance: str = ""
    """This instance's name in the lease (default: host, pid and a random suffix)."""
    nkey_file: str = ""
    """The swapper role's NATS nkey seed ('' where the server has no auth)."""
    dataplane_key: bytes = b""
    """The stores' data-plane key: each accepted member is given its job's token ('' where stores take
    no tokens)."""
    signing_key: bytes = b""
    """The key seal keys are derived from (`seal.key`, which stores never hold): each accepted member is
    given its job's, to sign its snapshots and check those it restores ('': unsigned snapshots)."""


class SwapperService:
    def __init__(self, config: SwapperServiceConfig, nc: Client, log: Any) -> None:
        self.config = config
        self.nc = nc
        self.log = log
        self._refusals = RefusalLog(log)
        self.instance = config.instance or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"
        self.core = SwapperCore(
            SwapperConfig(replication=config.replication, last_call_s=config.last_call_s, runs_required=True),
            wall_offset=lambda: time.time() - time.monotonic(),
        )
        self.core.reset_store_view(time.monotonic())
        self.tracer = IncidentTracer(config.trace_file)
        self.metrics = Metrics("deadpool-swapper")
        self._recoveries = self.metrics.meter.create_counter("deadpool.recoveries", description="closed incidents")
        self._downtime = self.metrics.meter.create_histogram(
            "deadpool.recovery.downtime", unit="s", description="fault to every rank's first step after it"
        )
        self._measured: OrderedDict[str, None] = OrderedDict()
        """Incidents already traced and counted (an incident published again is measured once)."""
        self._job_gauges()
        self.workers: dict[str, JobWorker] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._answering: set[asyncio.Task[None]] = set()
        """Hellos in the inbox of their job's worker, each waiting for its answer (at most the inboxes hold)."""
        self.records: JobRecords | None = None
        self.lease: LeaderLease | None = None
        self._leading = False
        self._settled: set[str] = set()
        """Jobs whose record the re-listing found finished, never formed or unreadable: not loaded again
        while this instance leads (at most one name per record in the bucket)."""
        self._transition = asyncio.Lock()
        """Taking and giving up the lead, and creating a job's worker, one at a time."""

    def leading(self) -> bool:
        return self._leading and self.lease is not None and self.lease.held()

    # ------------------------------------------------------------------ leadership

    async def _on_lead_change(self) -> None:
        """Follow the lease as it is now (take the lead, or step down)."""
        assert self.lease is not None
        async with self._transition:
            held = self.lease.held()
            if held and not self._leading:
                await self._take_lead()
            elif not held and self._leading:
                await self._step_down()

    async def _take_lead(self) -> None:
        assert self.records is not None and self.lease is not None
        started = time.monotonic()
        try:
            states = await self.records.load_all(time.monotonic())
            stream = await stream_position(self.nc)
        except (TimeoutError, nats.errors.Error) as exc:
            why = "cannot take the lead: job records unreachable; giving the lease up"
            self._refusals.warning(why, error=repr(exc))
            await self.lease.release()  # a lease held by an instance that cannot act would wedge every job
            return
        self.core.jobs = {s.job: s for s in states}
        self._settled.clear()
        self._leading = True
        for state in states:
            if not state.finished:
                self._start_worker(state.job, stream)
        self.log.info(
            "leading",
            instance=self.instance,
            jobs=len(states),
            running=sum(not s.finished for s in states),
            took_s=round(time.monotonic() - started, 3),
        )

    async def _step_down(self) -> None:
        self._leading = False
        workers, self.workers = list(self.workers.values()), {}
        await asyncio.gather(*(w.stop() for w in workers))
        self.core.jobs.clear()
        self.log.warning("no longer leading", instance=self.instance)

    def _forget_pruned(self) -> None:
        """Stop the workers of jobs the core has forgotten (finished long ago, or never formed)."""
        for job in [j for j, w in self.workers.items() if w.forgotten]:
            worker = self.workers.pop(job)
            task = asyncio.create_task(worker.stop())
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    def _start_worker(self, job: str, stream: tuple[str, int]) -> JobWorker:
        assert self.records is not None
        worker = JobWorker(
            job,
            self.core,
            self.records,
            self.nc,
            self.log,
            publish=self._publish,
            fence=self._fence,
            leading=self.leading,
            stream=stream,
        )
        self.workers[job] = worker
        worker.start()
        return worker

    async def _worker_for(self, job: str) -> JobWorker | None:
        """The job's worker, started (with the job's record, if one exists) when it is new."""
        worker = self.workers.get(job)
        if worker is not None or not self.leading():
            return worker
        async with self._transition:
            if job in self.workers or not self.leading():
                return self.workers.get(job)
            self._forget_pruned()
            if len(self.workers) >= self.core.config.jobs_max:
                self.log.warning("job not started: jobs_max reached", job=job, jobs=len(self.workers))
                return None
            try:
                read = await self._read_job(job)
            except UnreadableRecordError:
                return None  # logged: its members get no answer rather than a job started over
            if read is None:
                return None
            state, stream = read
            if state is not None:
                self.core.jobs[job] = state
            return self._start_worker(job, stream)

    async def _read_job(self, job: str) -> tuple[JobState | None, tuple[str, int]] | None:
        """The job's record (None: it has none) and where the events stream stands now, or None when
        KV cannot answer (logged). Raises UnreadableRecordError (logged by `load`)."""
        assert self.records is not None
        try:
            return await self.records.load(job, time.monotonic()), await stream_position(self.nc)
        except (TimeoutError, nats.errors.Error) as exc:
            self._refusals.warning("job record not read: KV unreachable", job=job, error=repr(exc))
            return None

    async def _adopt_unlisted_jobs(self, stop: asyncio.Event) -> None:
        """Every `jobs_relist_s` while leading: start a worker for each running job whose record the
        leader has not loaded (its listing on taking the lead missed it)."""
        while not await stopped_within(stop, self.config.jobs_relist_s):
            if not self.leading():
                continue
            assert self.records is not None
            try:
                names = await self.records.names()
            except (TimeoutError, nats.errors.Error) as exc:
                self._refusals.warning("job records not listed again: KV unreachable", error=repr(exc))
                continue
            for job in names:
                known = job in self.core.jobs or job in self.workers or job in self._settled
                if not known and not await self._adopt(job):
                    break

    async def _adopt(self, job: str) -> bool:
        """Load a job the leader does not know and start its worker if it is running. False when the
        records cannot be read now (the re-listing ends this round)."""
        async with self._transition:
            if not self.leading() or job in self.core.jobs or job in self.workers:
                return True
            try:
                read = await self._read_job(job)
            except UnreadableRecordError:  # logged by load
                self._settled.add(job)
                return True
            if read is None:
                return False
            state, stream = read
            if state is None or state.finished or not state.started():
                self._settled.add(job)
                return True
            if len(self.workers) >= self.core.config.jobs_max:
                self.log.warning("job not adopted: jobs_max reached", job=job, jobs=len(self.workers))
                return False
            self.core.jobs[job] = state
            self._start_worker(job, stream)
            self.log.warning(
                "job adopted: its record was not listed when this swapper took the lead",
                job=job,
                generation=state.generation,
            )
            return True

    # ------------------------------------------------------------------ actions

    async def _publish(self, action: Publish) -> None:
        message, subject = action.message, action.subject
        if isinstance(message, Rebuild | RebuildDelta) and message.incident:
            message = self._traced(message)
        try:
            await publish(self.nc, subject, message)
        except nats.errors.Error as exc:  # retransmission covers commands; an incident is also in KV
            self.log.warning("publish failed", job=message.job, kind=message.KIND, error=repr(exc))
        if isinstance(message, Incident):
            self._log_incident(message)

    def _traced(self, rebuild: Rebuild | RebuildDelta) -> Rebuild | RebuildDelta:
        """The rebuild (whole or its delta) with its first incident's `recovery` span as its trace context."""
        first = rebuild.incident.split(",")[0]
        state = self.core.jobs.get(rebuild.job)
        opened = next((i for i in state.incident_log.open_incidents if i.incident_id == first), None) if state else None
        t_fault = opened.t_fault if opened is not None else rebuild.t_decided
        context = self.tracer.recovery_context(first, rebuild.traceparent, t_fault, rebuild.job)
        return replace(rebuild, traceparent=context) if context else rebuild

    def _job_gauges(self) -> None:
        def per_job(value: Callable[[JobState], float]) -> Callable[[], list[tuple[float, dict[str, Any]]]]:
            def observe() -> list[tuple[float, dict[str, Any]]]:
                """Read from the metric reader's thread while the loop changes the jobs: a read that
                races a change gives nothing this time (the next collection reads again)."""
                if not self._leading:
                    return []  # a standby's copy of the jobs is not the truth
                try:
                    return [(value(s), {"job": job}) for job, s in list(self.core.jobs.items()) if not s.finished]
                except RuntimeError:  # a dict changed size while read
                    return []

            return observe

        self.metrics.gauge(
            "deadpool.job.committed_step",
            "{step}",
            "the job's committed step",
            per_job(lambda s: s.ledger.committed_step),
        )
        self.metrics.gauge(
            "deadpool.job.commit_lag",
            "{step}",
            "steps stored past the committed one",
            per_job(lambda s: max(s.ledger.completes, default=s.ledger.committed_step) - s.ledger.committed_step),
        )
        self.metrics.gauge(
            "deadpool.job.spares_free", "{member}", "warm spares", per_job(lambda s: len(s.membership.spares))
        )
        self.metrics.gauge(
            "deadpool.job.unprotected",
            "1",
            "1 while no snapshot store receives the job's snapshots (a lost rank has no RAM copy)",
            per_job(lambda s: float(s.protection.unprotected_since is not None)),
        )
        self.metrics.gauge(
            "deadpool.job.unprotected_since_step",
            "{step}",
            "the committed step when the job became unprotected (-1 while protected): every step after it "
            "is at risk (each member's deadpool.member.steps_at_risk counts them)",
            per_job(
                lambda s: float(s.protection.unprotected_step if s.protection.unprotected_since is not None else -1)
            ),
        )

    def _log_incident(self, incident: Incident) -> None:
        self.log.info(
            "incident closed",
            job=incident.job,
            generation=incident.generation,
            rank=incident.rank,
            member=incident.member,
            replacement=incident.replacement,
            reason=incident.reason,
            detect_s=round(incident.detect_s, 4),
            downtime_s=round(incident.downtime_s, 4),
            lost_steps=incident.lost_steps,
            phases={k: round(v, 4) for k, v in incident.phases.items()},
        )
        if incident.incident_id in self._measured:
            return
        self._measured[incident.incident_id] = None
        while len(self._measured) > INCIDENTS_MEASURED_KEPT:
            self._measured.popitem(last=False)
        self.tracer.record(incident)
        attrs = {"job": incident.job, "reason": incident.reason}
        self._recoveries.add(1, attrs)
        self._downtime.record(incident.downtime_s, attrs)

    async def _fence(self, fence: Fence) -> float:
        """Ask the member's launcher to SIGKILL it and wait for the answer (bounded); returns how long
        that took."""
        started = time.monotonic()
        if not fence.launcher:
            self.log.error("cannot fence a member without a launcher", member=fence.member)
            return 0.0
        request = FenceRequest(fence.job, fence.generation, fence.member, fence.reason)
        try:
            msg = await self.nc.request(
                Subjects.for_job(fence.job).fence(fence.launcher), encode(request), timeout=self.config.fence_timeout_s
            )
            reply = decode(msg.data, FenceReply)
            self.log.info("member fenced", job=fence.job, member=fence.member, killed=reply.killed, detail=reply.detail)
        except (TimeoutError, nats.errors.Error, ProtocolError) as exc:
            self.log.error(
                "fence got no answer: going on without it", job=fence.job, member=fence.member, reason=repr(exc)
            )
        return time.monotonic() - started

    # ------------------------------------------------------------------ inputs

    async def _on_hello(self, msg: Msg) -> None:
        if not self.leading():
            return  # a standby never answers: the leader does
        try:
            hello = decode_on(msg.subject, msg.data, MemberHello)
        except ProtocolError as exc:
            self._refusals.warning("rejected hello", reason=str(exc))
            await _respond_error(self.nc, msg, "400", str(exc))
            return
        worker = await self._worker_for(hello.job)
        if worker is None:
            return
        item = Hello(hello)
        try:
            await asyncio.wait_for(worker.inbox.put(item), HELLO_ANSWER_S)
        except TimeoutError:
            return  # the member asks again
        # The answer comes once the record holding the member is saved; meanwhile the next hellos are
        # read (a job of thousands registers in a few saves, not one save per member).
        task = asyncio.create_task(self._answer_hello(msg, item))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def _on_run_start(self, msg: Msg) -> None:
        """A launcher starts a run (only launchers may publish here: a member cannot squat a name)."""
        if not self.leading():
            return
        try:
            start = decode_on(msg.subject, msg.data, RunStart)
        except ProtocolError as exc:
            self.log.warning("rejected run start", reason=str(exc))
            await _respond_error(self.nc, msg, "400", str(exc))
            return
        worker = await self._worker_for(start.job)
        if worker is None:
            return
        item = RunRequest(start)
        try:
            await asyncio.wait_for(worker.inbox.put(item), HELLO_ANSWER_S)
            reply = await asyncio.wait_for(asyncio.shield(item.reply), HELLO_ANSWER_S)
        except (TimeoutError, asyncio.CancelledError):
            return  # the launcher asks again
        if not reply.accepted and not reply.not_yet:  # not yet: a spares-only launcher asks again
            self.log.warning("run refused", job=start.job, run=start.run, launcher=start.launcher, reason=reply.reason)
        with contextlib.suppress(nats.errors.Error):
            await self.nc.publish(msg.reply, encode(reply))

    async def _answer_hello(self, msg: Msg, item: Hello) -> None:
        try:
            reply = await asyncio.wait_for(asyncio.shield(item.reply), HELLO_ANSWER_S)
        except (TimeoutError, asyncio.CancelledError):
            return  # the member asks again
        if reply.accepted and self.config.dataplane_key:
            reply = replace(reply, store_token=job_token(self.config.dataplane_key, reply.job))
        if reply.accepted and self.config.signing_key:
            reply = replace(reply, seal_key=seal_key(self.config.signing_key, reply.job))
        with contextlib.suppress(nats.errors.Error):
            await self.nc.publish(msg.reply, encode(reply))

    async def _on_store(self, status: StoreStatus, _msg: Msg) -> None:
        if self.core.on_store_status(status, time.monotonic()):
            for worker in self.workers.values():  # a store came, came back or moved: jobs act on it now
                worker.poke()

    async def _watch_store_view(self, stop: asyncio.Event) -> None:
        """The stores' view is only as fresh as this process's hearing: while its NATS connection is
        down, and after its loop was paused, a silent store may just be unheard, so the core waits a
        full store timeout before taking silence for loss (a failure handled meanwhile waits for it)."""
        last = heard_until = time.monotonic()  # heard_until: the last check with nothing missed
        while not await stopped_within(stop, VIEW_CHECK_S):
            now = time.monotonic()
            if not self.nc.is_connected or now - last > self.core.config.store_timeout_s / 2:
                self.core.reset_store_view(now, heard_until=heard_until)  # the stores live then, heard again
            else:
                heard_until = now
            last = now

    async def _on_status(self, msg: Msg) -> None:
        if not self.leading():
            return
        job = msg.data.decode(errors="replace").strip()
        state = self.core.jobs.get(job)
        if state is None:
            await _respond_error(self.nc, msg, "404", f"no job named {job!r}")
            return
        now = time.monotonic()
        worker = self.workers.get(job)
        body = {
            "job": state.job,
            "leader": self.instance,
            "world_size": state.membership.world_size,
            "generation": state.generation,
            "ranks": state.membership.ranks,
            "spares": state.membership.spares,
            "members": {m: to_fields(i) for m, i in state.membership.members.items()},
            "committed_step": state.ledger.committed_step,
            "finished": state.finished,
            "failed_reason": state.failed_reason,
            "rebuild_pending": state.recovery.pending is not None,
            "open_incidents": [to_fields(i) for i in state.incident_log.open_incidents],
            "incidents": [
                to_fields(i) | {"detect_s": i.detect_s, "downtime_s": i.downtime_s}
                for i in state.incident_log.incidents
            ],
            "stores": [to_fields(s) | {"heard_s_ago": round(now - s.last_seen, 3)} for s in self.core.live_stores(now)],
            "placement": state.stores.placement,
            "placement_version": state.stores.placement_version,
            "replicas_short": self.core.replicas_short(state.job, now),
            "commit_lag_steps": max(state.ledger.completes, default=state.ledger.committed_step)
            - state.ledger.committed_step,
            "unprotected": None
            if state.protection.unprotected_since is None
            else {
                "since_committed_step": state.protection.unprotected_step,
                "for_s": round(now - state.protection.unprotected_since, 1),
            },
            "unheard_s_max": round(worker.unheard_s_max, 4) if worker is not None else 0.0,
        }
        data = json.dumps(body).encode()
        if len(data) > MESSAGE_PART_BYTES_MAX - STATUS_MARGIN_BYTES:  # a job of thousands: the details go
            details: dict[str, Any] = {
                "members": {},
                "placement": [],
                "ranks": [],
                "spares": [],
                "open_incidents": [],
                "incidents": [],
            }
            body |= details | {"truncated": True}
            data = json.dumps(body).encode()
        try:
            await self.nc.publish(msg.reply, data)
        except nats.errors.Error as exc:
            self.log.warning("status not answered", job=job, bytes=len(data), error=repr(exc))

    async def _open(self, stop: asyncio.Event) -> bool:
        """Open the KV buckets and the events stream, retrying until JetStream answers."""
        js = self.nc.jetstream(timeout=KV_TIMEOUT_S)
        attempts = 0
        while not stop.is_set():
            attempts += 1
            try:
                await ensure_events_stream(self.nc, self.config.js_replicas)
                self.records = await JobRecords.open(js, self.log, self.config.js_replicas, self.nc.max_payload)
                self.lease = await LeaderLease.open(
                    js, self.instance, self.config.lease, self.log, self.config.js_replicas
                )
                return True
            except (TimeoutError, nats.errors.Error) as exc:
                if attempts == 1 or attempts % 20 == 0:
                    self.log.warning("JetStream not ready: retrying", error=repr(exc))
                if await stopped_within(stop, START_RETRY_S):
                    break
        return False

    async def run(self, stop: asyncio.Event) -> None:
        await subscribe_validated(self.nc, STORE_STATUS, StoreStatus, self._on_store, self.log)
        if not await self._open(stop):
            return
        assert self.lease is not None
        await self.nc.subscribe(Subjects.any_job().hello, cb=self._on_hello)
        await self.nc.subscribe(Subjects.any_job().run_start, cb=self._on_run_start)
        await self.nc.subscribe(SWAPPER_STATUS, cb=self._on_status)
        service = await add_service(
            self.nc,
            name="deadpool-swapper",
            version=VERSION,
            description="DeadPool swap scheduler",
            metadata={"instance": self.instance, "host": socket.gethostname()},
        )
        self.log.info("swapper ready", instance=self.instance, replication=self.config.replication)
        watch = asyncio.create_task(self._watch_store_view(stop), name="store-view")
        relist = asyncio.create_task(self._adopt_unlisted_jobs(stop), name="relist-jobs")
        await self.lease.run(stop, self._on_lead_change, lambda: self._leading)
        watch.cancel()
        relist.cancel()
        await service.stop()
        self.tracer.shutdown()
        self.metrics.shutdown()


async def _respond_error(nc: Client, msg: Msg, code: str, text: str) -> None:
    """Answer a request with a `nats.micro`-style error (headers only), as members expect."""
    if msg.reply:
        await nc.publish(msg.reply, b"", headers={"Nats-Service-Error-Code": code, "Nats-Service-Error": text})


def main(config: SwapperServiceConfig) -> None:
    run_nats_service(
        "swapper",
        config.nats_url,
        "deadpool-swapper",
        lambda nc, log, stop: SwapperService(config, nc, log).run(stop),
        config.nkey_file,
        service_inbox("swapper"),
    )
