"""Follows one job on the bus: heartbeats, rank maps, failures, incidents, completion.

The demo uses it to find the process holding a rank, to time its kill mid-step, and to collect the
swapper's incident reports.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from deadpool_protocol import Failure, Heartbeat, HeartbeatBatch, Incident, JobFinished, Rebuild, Subjects
from deadpool_runtime import subscribe_validated

__all__ = ["JobWatch"]


@dataclass
class MemberView:
    pid: int = 0
    rank: int = -1
    generation: int = 0
    step: int = -1
    in_step: bool = False
    step_started_t: float = 0.0
    waiting: bool = False
    where: str = ""
    beat_t: float = 0.0
    step_times: list[float] = field(default_factory=list)
    _last_step_t: float = 0.0


class JobWatch:
    def __init__(self, nc: Client, job: str, log: Any) -> None:
        self.nc = nc
        self.job = job
        self.log = log
        self.members: dict[str, MemberView] = {}
        self.rebuild: Rebuild | None = None
        self.failures: list[Failure] = []
        self.incidents: list[Incident] = []
        self.finished = asyncio.Event()
        self.changed = asyncio.Condition()

    async def start(self) -> None:
        s = Subjects.for_job(self.job)
        await subscribe_validated(self.nc, s.heartbeat, Heartbeat, self._on_heartbeat, self.log)
        await subscribe_validated(self.nc, s.heartbeat_batch, HeartbeatBatch, self._on_batch, self.log)
        await subscribe_validated(self.nc, s.rebuild, Rebuild, self._on_rebuild, self.log)
        await subscribe_validated(self.nc, s.failure, Failure, self._on_failure, self.log)
        await subscribe_validated(self.nc, s.incident, Incident, self._on_incident, self.log)
        await subscribe_validated(self.nc, s.finished, JobFinished, self._on_finished, self.log)
        await self.nc.flush()

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def _on_batch(self, batch: HeartbeatBatch, msg: Msg) -> None:
        for hb in batch.beats:
            await self._on_heartbeat(hb, msg)

    async def _on_heartbeat(self, hb: Heartbeat, _msg: Msg) -> None:
        view = self.members.setdefault(hb.member, MemberView())
        if hb.step > view.step >= 0 and view._last_step_t:
            view.step_times.append((hb.t - view._last_step_t) / (hb.step - view.step))
        if hb.step != view.step:
            view._last_step_t = hb.t
        view.pid, view.rank, view.generation, view.step = hb.pid, hb.rank, hb.generation, hb.step
        view.in_step, view.step_started_t, view.waiting, view.where, view.beat_t = (
            hb.in_step,
            hb.step_started_t,
            hb.waiting,
            hb.where,
            hb.t,
        )
        await self._notify()

    async def _on_rebuild(self, rebuild: Rebuild, _msg: Msg) -> None:
        if self.rebuild is None or rebuild.generation > self.rebuild.generation:
            self.rebuild = rebuild
            await self._notify()

    async def _on_failure(self, failure: Failure, _msg: Msg) -> None:
        self.failures.append(failure)

    async def _on_incident(self, incident: Incident, _msg: Msg) -> None:
        self.incidents.append(incident)
        await self._notify()

    async def _on_finished(self, _finished: JobFinished, _msg: Msg) -> None:
        self.finished.set()
        await self._notify()

    def holder_of(self, rank: int) -> str | None:
        if self.rebuild is None or rank >= len(self.rebuild.ranks):
            return None
        return self.rebuild.ranks[rank]

    def median_step_s(self, member: str) -> float:
        times = self.members.get(member, MemberView()).step_times
        return statistics.median(times) if times else 0.0

    def describe_members(self, now: float) -> list[str]:
        """One line per member from its last heartbeat: what a run that never finished was doing."""
        lines = []
        for member, v in sorted(self.members.items(), key=lambda kv: (kv[1].rank < 0, kv[1].rank, kv[0])):
            state = "in a step" if v.in_step else "between steps"
            lines.append(
                f"{member} (pid {v.pid}): rank {v.rank}, generation {v.generation}, step {v.step}, {state}, "
                f"{'waiting on peers' if v.waiting else 'busy'} at {v.where or '?'}; "
                f"last heartbeat {now - v.beat_t:.1f} s ago"
            )
        return lines

    async def wait_for(self, predicate: Any) -> None:
        async with self.changed:
            await self.changed.wait_for(predicate)
