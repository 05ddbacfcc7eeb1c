"""`deadpool detector`: turns exit reports, error reports, heartbeat silence and stalled step progress
into `failure` events, and slow ranks into `straggler` events.

Serves every job on the bus. A `nats.micro` service (`deadpool-detector`); its `status` endpoint
answers with the members it watches.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
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
    Rebuild,
    Subjects,
)
from deadpool_runtime import publish, run_nats_service, stopped_within, subscribe_validated

__all__ = ["DetectorServiceConfig", "main"]

VERSION = "0.1.0"
REVIEW_PERIOD_S = 1.0
"""Stragglers and culprit-less stalls are reviewed this often (verdicts run every check period)."""


@dataclass(frozen=True)
class DetectorServiceConfig:
    nats_url: str
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    check_period_s: float = 0.05


class DetectorService:
    def __init__(self, config: DetectorServiceConfig, nc: Client, log: Any) -> None:
        self.config = config
        self.nc = nc
        self.log = log
        self.core = DetectorCore(config.detector)
        self._last_check = time.time()
        self._was_connected = True
        self._stalls_logged: dict[str, list[str]] = {}
        self._last_review = 0.0

    async def _check(self) -> None:
        """One pass: verdicts, unless the detector itself just missed time (its outage, its pause)."""
        now = time.time()
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
        await self._emit(self.core.check(now))
        for broken in self.core.broken_groups(now):
            self.log.warning(
                "process group broken, every rank alive and awaiting a rebuild",
                job=broken.job,
                generation=broken.generation,
                evidence=broken.evidence,
            )
            await publish(self.nc, Subjects.for_job(broken.job).group_broken, broken)
        if now - self._last_review < REVIEW_PERIOD_S:
            return
        self._last_review = now
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

    async def _emit(self, failures: list[Failure]) -> None:
        for failure in failures:
            self.log.warning(
                "failure detected",
                job=failure.job,
                generation=failure.generation,
                member=failure.member,
                rank=failure.rank,
                reason=failure.reason,
                evidence=failure.evidence,
                detect_s=round(failure.t_detected - failure.t_fault, 4),
            )
            await publish(self.nc, Subjects.for_job(failure.job).failure, failure)

    async def _on_heartbeat(self, hb: Heartbeat, _msg: Msg) -> None:
        self.core.on_heartbeat(hb, time.time())

    async def _on_heartbeat_batch(self, batch: HeartbeatBatch, _msg: Msg) -> None:
        now = time.time()
        for hb in batch.beats:
            self.core.on_heartbeat(hb, now)

    async def _on_rebuild(self, rebuild: Rebuild, _msg: Msg) -> None:
        self.core.on_rebuild(rebuild, time.time())

    async def _on_exit(self, exit_: ChildExit, _msg: Msg) -> None:
        await self._emit(self.core.on_exit(exit_, time.time()))

    async def _on_error(self, error: MemberError, _msg: Msg) -> None:
        await self._emit(self.core.on_error(error, time.time()))

    async def _on_done(self, done: MemberDone, _msg: Msg) -> None:
        self.core.on_done(done)

    async def _on_finished(self, finished: JobFinished, _msg: Msg) -> None:
        self.core.on_finished(finished)

    async def _status_endpoint(self, req: Request) -> None:
        body = {
            job: {
                "generation": view.generation,
                "finished": view.finished,
                "watched": {m: {"rank": w.rank, "step": w.last_step, "done": w.done} for m, w in view.members.items()},
                "declared": sorted(view.declared),
            }
            for job, view in self.core.jobs.items()
        }
        for job, view in self.core.jobs.items():
            body[job]["hang_threshold_s"] = round(self.core.hang_threshold_s(view), 3)
        await req.respond(json.dumps(body).encode())

    async def run(self, stop: asyncio.Event) -> None:
        s = Subjects.any_job()
        for subject, kind, handler in (
            (s.heartbeat, Heartbeat, self._on_heartbeat),
            (s.heartbeat_batch, HeartbeatBatch, self._on_heartbeat_batch),
            (s.rebuild, Rebuild, self._on_rebuild),
            (s.child_exit, ChildExit, self._on_exit),
            (s.member_error, MemberError, self._on_error),
            (s.member_done, MemberDone, self._on_done),
            (s.finished, JobFinished, self._on_finished),
        ):
            await subscribe_validated(self.nc, subject, kind, handler, self.log)  # type: ignore[arg-type]
        service = await add_service(
            self.nc, name="deadpool-detector", version=VERSION, description="DeadPool failure detector"
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
            await self._check()
            if await stopped_within(stop, self.config.check_period_s):
                break
        await service.stop()


def main(config: DetectorServiceConfig) -> None:
    run_nats_service(
        "detector",
        config.nats_url,
        "deadpool-detector",
        lambda nc, log, stop: DetectorService(config, nc, log).run(stop),
    )
