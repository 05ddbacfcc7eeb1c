"""`deadpool swapper`: the asyncio shell around `SwapperCore`.

Feeds it every event (hello requests, failures, acks, snapshot completions, done reports, store
status), carries out the actions it returns in order (a fence is awaited before the rebuild that
follows it), persists job state to JetStream KV, and records one trace per incident. Serves every job.
A `nats.micro` service (`deadpool-swapper`) with endpoints `hello` (member registration) and
`status` (job state as JSON, for `deadpool status`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.micro import add_service
from nats.micro.request import Request

from deadpool_protocol import (
    SWAPPER_STATUS,
    Failure,
    FenceReply,
    FenceRequest,
    GroupBroken,
    MemberDone,
    MemberHello,
    ProtocolError,
    RebuildAck,
    SnapshotComplete,
    StoreStatus,
    Subjects,
    decode,
    encode,
)
from deadpool_protocol.codec import to_fields
from deadpool_protocol.subjects import STORE_STATUS
from deadpool_runtime import publish, run_nats_service, stopped_within, subscribe_validated
from deadpool_swapper.core import Decision, Fence, Persist, Publish, SwapperConfig, SwapperCore
from deadpool_swapper.job_records import JobRecords
from deadpool_swapper.tracing import IncidentTracer

__all__ = ["SwapperServiceConfig", "main"]

VERSION = "0.1.0"


@dataclass(frozen=True)
class SwapperServiceConfig:
    nats_url: str
    replication: int = 2
    fence_timeout_s: float = 5.0
    tick_period_s: float = 0.05
    trace_file: str = ""


class SwapperService:
    def __init__(self, config: SwapperServiceConfig, nc: Client, records: JobRecords, log: Any) -> None:
        self.config = config
        self.nc = nc
        self.records = records
        self.log = log
        self.core = SwapperCore(SwapperConfig(replication=config.replication))
        self.tracer = IncidentTracer(config.trace_file)
        self._lock = asyncio.Lock()
        """Decisions and their actions run one at a time, in arrival order."""
        self._last_reason: dict[str, str] = {}

    async def _apply(self, decision: Decision, job: str = "") -> None:
        if decision.reason != self._last_reason.get(job) and decision.reason != "tick":
            self.log.info("decision", job=job or None, reason=decision.reason)
            self._last_reason[job] = decision.reason
        # The new state is in KV before anyone hears of it: a swapper that restarts after publishing a
        # generation always knows that generation.
        for name in dict.fromkeys(a.job for a in decision.actions if isinstance(a, Persist)):
            await self.records.save(self.core.jobs[name])
        for action in decision.actions:
            if isinstance(action, Fence):
                await self._fence(action)
            elif isinstance(action, Publish):
                subjects = Subjects.for_job(action.message.job)
                await publish(self.nc, getattr(subjects, action.subject_kind), action.message)
                if action.subject_kind == "incident":
                    self._log_incident(action.message)

    def _log_incident(self, incident: Any) -> None:
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
        self.tracer.record(incident)

    async def _fence(self, fence: Fence) -> None:
        """Ask the member's launcher to SIGKILL it and wait for the answer (bounded)."""
        started = time.monotonic()
        if not fence.launcher:
            self.log.error("cannot fence a member without a launcher", member=fence.member)
            return
        request = FenceRequest(fence.job, fence.generation, fence.member, fence.reason)
        try:
            msg = await self.nc.request(
                Subjects.for_job(fence.job).fence(fence.launcher),
                encode(request),
                timeout=self.config.fence_timeout_s,
            )
            reply = decode(msg.data, FenceReply)
            self.log.info("member fenced", job=fence.job, member=fence.member, killed=reply.killed, detail=reply.detail)
        except (NatsTimeoutError, NoRespondersError, ProtocolError) as exc:
            self.log.error(
                "fence got no answer: going on without it",
                job=fence.job,
                member=fence.member,
                reason=repr(exc),
            )
        self.core.on_fenced(fence.job, fence.member, time.monotonic() - started)

    async def _on_hello(self, req: Request) -> None:
        try:
            hello = decode(req.data, MemberHello)
        except ProtocolError as exc:
            self.log.warning("rejected hello", reason=str(exc))
            await req.respond_error("400", str(exc))
            return
        async with self._lock:
            reply, decision = self.core.on_hello(hello, time.time())
            await req.respond(encode(reply))
            await self._apply(decision, hello.job)

    async def _on_failure(self, failure: Failure, _msg: Msg) -> None:
        async with self._lock:
            await self._apply(self.core.on_failure(failure, time.time()), failure.job)

    async def _on_group_broken(self, broken: GroupBroken, _msg: Msg) -> None:
        async with self._lock:
            await self._apply(self.core.on_group_broken(broken, time.time()), broken.job)

    async def _on_ack(self, ack: RebuildAck, _msg: Msg) -> None:
        async with self._lock:
            await self._apply(self.core.on_ack(ack, time.time()), ack.job)

    async def _on_snapshot(self, sc: SnapshotComplete, _msg: Msg) -> None:
        async with self._lock:
            decision = self.core.on_snapshot_complete(sc, time.time())
            if decision.actions:
                await self._apply(decision, sc.job)

    async def _on_done(self, done: MemberDone, _msg: Msg) -> None:
        async with self._lock:
            await self._apply(self.core.on_done(done, time.time()), done.job)

    async def _on_store(self, status: StoreStatus, _msg: Msg) -> None:
        async with self._lock:
            decision = self.core.on_store_status(status, time.time())
            if decision.actions:
                await self._apply(decision)

    async def _status_endpoint(self, req: Request) -> None:
        job = req.data.decode(errors="replace").strip()
        state = self.core.jobs.get(job)
        if state is None:
            await req.respond_error("404", f"no job named {job!r}")
            return
        body = {
            "job": state.job,
            "world_size": state.world_size,
            "generation": state.generation,
            "ranks": state.ranks,
            "spares": state.spares,
            "members": {m: to_fields(i) for m, i in state.members.items()},
            "committed_step": state.committed_step,
            "finished": state.finished,
            "rebuild_pending": state.pending is not None,
            "open_incidents": [to_fields(i) for i in state.open_incidents],
            "incidents": [to_fields(i) | {"detect_s": i.detect_s, "downtime_s": i.downtime_s} for i in state.incidents],
            "stores": [to_fields(s) for s in self.core.live_stores(time.time())],
        }
        await req.respond(json.dumps(body).encode())

    async def run(self, stop: asyncio.Event) -> None:
        for state in await self.records.load_all():
            self.core.jobs[state.job] = state
            self.log.info("job state loaded", job=state.job, generation=state.generation)
        s = Subjects.any_job()
        await subscribe_validated(self.nc, s.failure, Failure, self._on_failure, self.log)
        await subscribe_validated(self.nc, s.group_broken, GroupBroken, self._on_group_broken, self.log)
        await subscribe_validated(self.nc, s.rebuild_ack, RebuildAck, self._on_ack, self.log)
        await subscribe_validated(self.nc, s.snapshot_complete, SnapshotComplete, self._on_snapshot, self.log)
        await subscribe_validated(self.nc, s.member_done, MemberDone, self._on_done, self.log)
        await subscribe_validated(self.nc, STORE_STATUS, StoreStatus, self._on_store, self.log)
        service = await add_service(
            self.nc, name="deadpool-swapper", version=VERSION, description="DeadPool swap scheduler"
        )
        await service.add_endpoint(
            name="hello", subject=s.hello, handler=self._on_hello, queue_group="deadpool-swapper"
        )
        await service.add_endpoint(name="status", subject=SWAPPER_STATUS, handler=self._status_endpoint)
        self.log.info("swapper ready", replication=self.config.replication)
        while True:
            async with self._lock:
                await self._apply(self.core.tick(time.time()))
            if await stopped_within(stop, self.config.tick_period_s):
                break
        await service.stop()
        self.tracer.shutdown()


async def _serve(config: SwapperServiceConfig, nc: Client, log: Any, stop: asyncio.Event) -> None:
    records = await JobRecords.open(nc.jetstream(), log)
    await SwapperService(config, nc, records, log).run(stop)


def main(config: SwapperServiceConfig) -> None:
    run_nats_service(
        "swapper", config.nats_url, "deadpool-swapper", lambda nc, log, stop: _serve(config, nc, log, stop)
    )
